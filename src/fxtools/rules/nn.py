"""VJP rules of neural-network ops: activations, normalisation, attention, convolution, losses."""
from __future__ import annotations

import torch

from ..registry import vjp_rule

aten = torch.ops.aten


@vjp_rule(aten.linear)
def linear(ct, out, x, weight, bias=None):
    gx = ct @ weight
    gw = (ct.reshape(-1, ct.shape[-1]).mT @ x.reshape(-1, x.shape[-1])) if ct.dim() > 2 else ct.mT @ x if ct.dim() == 2 else torch.outer(ct, x)
    gb = None if bias is None else (ct.sum(list(range(ct.dim() - 1))) if ct.dim() > 1 else ct)
    return gx, gw, gb
