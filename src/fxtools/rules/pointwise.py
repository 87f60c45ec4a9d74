"""VJP rules of elementwise ops: each cotangent is the output cotangent times a local derivative.

Binary ops broadcast, so their cotangents are reduced back to each input's shape
(``unbroadcast``). Python-number arguments get no cotangent.
"""
from __future__ import annotations

import torch

from ..registry import mark_nondifferentiable, vjp_rule
from .common import unbroadcast

aten = torch.ops.aten


@vjp_rule(aten.sin)
def sin(ct, out, x):
    return ct * torch.cos(x)


@vjp_rule(aten.cos)
def cos(ct, out, x):
    return -ct * torch.sin(x)


@vjp_rule(aten.exp)
def exp(ct, out, x):
    return ct * out


@vjp_rule(aten.neg)
def neg(ct, out, x):
    return -ct


@vjp_rule(aten.add.Tensor)
def add(ct, out, x, y, alpha=1):
    return unbroadcast(ct, x), unbroadcast(ct if alpha == 1 else ct * alpha, y)


@vjp_rule(aten.sub.Tensor)
def sub(ct, out, x, y, alpha=1):
    return unbroadcast(ct, x), unbroadcast(-ct if alpha == 1 else ct * -alpha, y)


@vjp_rule(aten.mul.Tensor)
def mul(ct, out, x, y):
    return unbroadcast(ct * y, x), unbroadcast(ct * x, y)


@vjp_rule(aten.div.Tensor)
def div(ct, out, x, y):
    return unbroadcast(ct / y, x), unbroadcast(-ct * out / y, y)


mark_nondifferentiable(aten.detach, aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like)
