"""VJP rules of the matrix-multiply family."""
from __future__ import annotations

import torch

from ..registry import vjp_rule

aten = torch.ops.aten


@vjp_rule(aten.mm)
def mm(ct, out, a, b):
    return ct @ b.mT, a.mT @ ct
