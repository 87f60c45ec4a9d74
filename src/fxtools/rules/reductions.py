"""VJP rules of reductions: the cotangent is broadcast back over the reduced dimensions."""
from __future__ import annotations

import torch

from ..registry import vjp_rule
from .common import keep_dims

aten = torch.ops.aten


@vjp_rule(aten.sum.default)
def sum_(ct, out, x, dtype=None):
    return ct.to(x.dtype).expand(x.shape)


@vjp_rule(aten.sum.dim_IntList)
def sum_dim(ct, out, x, dim, keepdim=False, dtype=None):
    return keep_dims(ct, x.shape, dim, keepdim).to(x.dtype).expand(x.shape)


@vjp_rule(aten.trace)
def trace(ct, out, x):
    return ct * torch.eye(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
