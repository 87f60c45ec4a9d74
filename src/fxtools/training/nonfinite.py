"""``fxtools.find_nonfinite``: the first NaN (or unintended infinity) of a value-and-gradient step,
named by the generated code and by the user's line (the machinery is ``training/finite.py``)."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..graph.nodes import is_float
from ..transforms.vjp import argnums_tuple
from .finite import NonFiniteReport, locate
from .partition import split

__all__ = ["find_nonfinite"]


def _grad_leaves(args: tuple, nums: tuple[int, ...]) -> list[bool]:
    """One bool per tensor leaf of ``args`` (forward placeholder order): whether ``argnums`` picks its argument."""
    return [i in nums for i, a in enumerate(args) for x in pytree.tree_leaves(a) if isinstance(x, torch.Tensor)]


def find_nonfinite(f, *args, argnums=None) -> NonFiniteReport | None:
    """Run ``f``'s value and gradient once at ``args`` and report the first non-finite value.

    The gradient is reverse mode with respect to every floating-point argument (an ``nn.Module``'s
    parameters and every input), or to the arguments ``argnums`` picks (an int or a tuple, as on
    ``fxtools.grad``); an output that is not one number gets a cotangent of ones. Values are
    checked in execution order: the arguments (phase ``"input"``), the forward, the backward.
    Returns None when the results and the gradients are finite (a NaN written on purpose and
    dropped, ``masked_fill(mask, nan)`` then ``nanmean``, is no cause), else a ``NonFiniteReport``
    of the first value whose non-finite entries reach them: ``phase``, ``name`` (the
    value's name in the generated code, an argument's path for an input), ``line``, ``filename``,
    ``lineno`` (the user's statement; for a backward value the forward statement whose derivative
    made it), ``op``; ``print(report)`` adds the generated statement, each operand's summary and
    hints for the classic causes. An infinity that a constant of the program put there (the
    ``-inf`` of ``masked_fill``, ``where`` or ``full``) and values computed from it are intended and
    not reported; the NaN they may cause is.
    """
    nums = tuple(range(len(args))) if argnums is None else argnums_tuple(argnums, len(args))
    if isinstance(f, torch.nn.Module):
        grad_leaves = [True] * len(list(f.parameters())) + _grad_leaves(args, nums)
    else:
        grad_leaves = _grad_leaves(args, nums)
    sp = split(f, *args, policy="save_all", grad_leaves=grad_leaves)
    full = (dict(f.named_parameters()), *args) if isinstance(f, torch.nn.Module) else args
    leaves = [x.detach() if is_float(x) else x for x in sp.flatten(*full)]
    with torch.no_grad():
        return locate(sp, leaves)
