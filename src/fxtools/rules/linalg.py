"""VJP rules of the matrix-multiply family: mm, bmm, matmul, addmm, linear, einsum, ..."""
from __future__ import annotations

import torch

from ..registry import vjp_rule

aten = torch.ops.aten


@vjp_rule(aten.mm)
def mm(ct, out, a, b):
    return ct @ b.mT, a.mT @ ct


@vjp_rule(aten.linear)
def linear(ct, out, x, weight, bias=None):
    ct2, x2 = ct.reshape(-1, ct.shape[-1]), x.reshape(-1, x.shape[-1])
    return ct @ weight, ct2.mT @ x2, None if bias is None else ct2.sum(0)
