"""The last-resort rule for an op: PyTorch's own derivative formula, traced into code.

For an op with no hand-written rule and no decomposition, fxtools traces
``torch.autograd.grad`` of that single op (at the example's shapes) with ``make_fx``. The
resulting ATen graph becomes the op's backward, so generated code never calls autograd at run
time.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from .capture import data_dependent_error, is_data_dependent, realize_constants
from .errors import FxtoolsError
from .functionalize import functionalize
from .registry import Rule


def _is_float(x):
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def derived_rule(node: fx.Node) -> Rule | None:
    """A Rule computing ``node``'s VJP from PyTorch's derivative of its op, or None if it has none."""
    op = node.target
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    flat, spec = pytree.tree_flatten((args, kwargs))
    diff = [i for i, a in enumerate(flat) if _is_float(a)]
    out_vals = pytree.tree_leaves(node.meta.get("val"))
    out_float = [i for i, o in enumerate(out_vals) if _is_float(o)]
    if not diff or not out_float:
        return None
    fake_mode = torch._guards.detect_fake_mode(flat)
    tensor_pos = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]

    def backward(*tensors_and_cts):
        tensors, cts = tensors_and_cts[: len(tensor_pos)], tensors_and_cts[len(tensor_pos):]
        full = list(flat)
        for i, t in zip(tensor_pos, tensors):
            full[i] = t.detach().requires_grad_(i in diff)
        a, k = pytree.tree_unflatten(full, spec)
        with torch.enable_grad():
            outs = pytree.tree_leaves(op(*a, **k))
            outs = [outs[i] for i in out_float]
            ins = [full[i] for i in diff]
            grads = torch.autograd.grad(outs, ins, cts, allow_unused=True)
        return tuple(g if g is not None else torch.zeros_like(x) for g, x in zip(grads, ins))

    try:
        with fake_mode, warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*autograd kernel was not registered.*")
            bw = make_fx(backward)(*[flat[i] for i in tensor_pos], *[out_vals[i] for i in out_float])
    except Exception as exc:  # noqa: BLE001 - PyTorch has no derivative for this op here
        if is_data_dependent(exc):
            raise data_dependent_error(exc, node) from exc
        return None
    realize_constants(bw)
    try:
        functionalize(bw)  # PyTorch's formulas sometimes update buffers in place (masked_fill_)
    except FxtoolsError:
        pass  # left as traced: simplify keeps in-place ops and never merges across them

    def fwd(*a, **k):
        out = op(*a, **k)
        return out, (a, k)

    def bwd(aux, ct):
        a, k = aux
        flat_now, _ = pytree.tree_flatten((a, k))
        cts = ct if isinstance(ct, tuple) else (ct,)
        cts = [cts[i] for i in out_float]
        cts = [c if c is not None else torch.zeros(out_vals[j].shape, dtype=out_vals[j].dtype)
               for c, j in zip(cts, out_float)]
        grads = bw(*[flat_now[i] for i in tensor_pos], *cts)
        per_flat = [None] * len(flat_now)
        for i, g in zip(diff, grads):
            per_flat[i] = g
        pa, _ = pytree.tree_unflatten(per_flat, spec)
        return tuple(pa)

    return Rule(fwd, bwd, "derived")
