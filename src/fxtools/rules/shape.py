"""VJP rules of shape and view ops, indexing, and joining/splitting tensors."""
from __future__ import annotations

import torch

from ..registry import vjp_rule

aten = torch.ops.aten


@vjp_rule(aten.view)
def view(ct, out, x, shape):
    return ct.view(x.shape)


@vjp_rule(aten.reshape)
def reshape(ct, out, x, shape):
    return ct.reshape(x.shape)


@vjp_rule(aten.transpose.int)
def transpose(ct, out, x, dim0, dim1):
    return ct.transpose(dim0, dim1)


@vjp_rule(aten.t)
def t(ct, out, x):
    return ct.t()
