"""The last-resort rule for an op: PyTorch's own derivative formula, traced into code.

For an op with no hand-written rule and no decomposition, fxtools traces
``torch.autograd.grad`` of that single op (at the example's shapes) with ``make_fx``. The
resulting ATen graph becomes the op's backward, so generated code never calls autograd at run
time.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError, MissingRuleError
from ..graph.nodes import is_float
from ..passes.complex_scatters import complex_scatters_on_real_views
from ..registry import Rule
from .fake_kernels import tracing_kernels
from .functionalize import functionalize
from .trace import data_dependent_error, is_data_dependent, realize_constants


def _draws_random_numbers(gm: fx.GraphModule) -> bool:
    """Whether a random op (``bernoulli``, ``normal``) contributes to the graph's outputs."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    seen, stack = set(), [output]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags:
            return True
        stack.extend(n.all_input_nodes)
    return False


def _differentiable(op, flat, spec, diff, out_float, fake_mode):
    """The float arguments autograd accepts as differentiable inputs of ``op`` (a fractional max
    pool's ``random_samples`` is refused) and the float outputs it differentiates (``lu_unpack``'s
    permutation matrix is not), found by running the op on FakeTensors under autograd."""

    def run(mask):
        full = [a.detach().requires_grad_(i in mask) if i in diff else a for i, a in enumerate(flat)]
        a, k = pytree.tree_unflatten(full, spec)
        with fake_mode, tracing_kernels(), torch.enable_grad():  # the kernels the trace used
            return pytree.tree_leaves(op(*a, **k))

    try:
        outs = run(set(diff))
    except RuntimeError:
        ok = []
        for i in diff:
            try:
                run({i})
                ok.append(i)
            except RuntimeError:
                continue
        diff = ok
        if not diff:
            return [], []
        try:
            outs = run(set(diff))
        except RuntimeError:
            return [], []
    except Exception:  # noqa: BLE001 - let the traced backward report what it can
        return diff, out_float
    grad_outs = [i for i in out_float if i < len(outs) and getattr(outs[i], "requires_grad", False)]
    return diff, grad_outs


def derived_rule(node: fx.Node) -> Rule | None:
    """A Rule computing ``node``'s VJP from PyTorch's derivative of its op, or None if it has none."""
    derivation = _Derivation.of(node)
    if derivation is None:
        return None
    try:
        bw = derivation.traced()
    except Exception as exc:  # noqa: BLE001 - PyTorch has no derivative for this op here
        if is_data_dependent(exc):
            # refused when (and only if) a gradient is asked of it: a call on detached values
            # (``torch.bincount(idx, weights=x.detach())``) needs none
            return _refusing_rule(node, data_dependent_error(exc, node))
        return None
    if bw is None or _draws_random_numbers(bw):
        # the traced backward re-runs the op: it would draw new random numbers (a new dropout mask)
        return None
    if derivation.no_gradient:
        return _no_gradient_rule(node)
    _keep_differentiable(bw)
    realize_constants(bw)
    try:
        functionalize(bw)  # PyTorch's formulas sometimes update buffers in place (masked_fill_)
    except FxtoolsError:
        pass  # left as traced: simplify keeps in-place ops and never merges across them
    complex_scatters_on_real_views(bw)  # replayed where its inputs may require grad
    bw.recompile()
    return derivation.rule(bw)


def _keep_differentiable(bw: fx.GraphModule) -> None:
    """Drop the ``detach`` calls tracing put in ``bw``: the detached copies of the op's inputs
    (``torch.autograd.grad`` needs leaves) and of the outputs autograd saves. They are the same
    values, but they would make the backward a constant of the point to fxtools' next derivative
    (the Hessian through ``torch.linalg.svd``'s vectors, a nuclear norm, was wrong): the formula
    is a function of the inputs, and its derivative is the second derivative."""
    detach = torch.ops.aten.detach.default
    for n in list(bw.graph.nodes):
        if n.op == "call_function" and n.target is detach:
            n.replace_all_uses_with(n.args[0])
            bw.graph.erase_node(n)
    bw.recompile()


@dataclasses.dataclass
class _Derivation:
    """Autograd's backward of one call of ``op``, on the call's fake values: ``flat`` its
    flattened arguments (``spec`` their structure), ``diff`` the positions of those differentiated,
    ``out_float`` the positions of the outputs differentiated."""

    op: Any
    flat: list
    spec: Any
    diff: list
    out_vals: list
    out_float: list
    fake_mode: Any
    no_gradient: bool = False  # the last trace gave no input a gradient

    @classmethod
    def of(cls, node: fx.Node) -> _Derivation | None:
        """The derivation of ``node``'s call, or None if no float input or float output links it."""
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        flat, spec = pytree.tree_flatten((args, kwargs))
        diff = [i for i, a in enumerate(flat) if is_float(a)]
        out_vals = pytree.tree_leaves(node.meta.get("val"))
        out_float = [i for i, o in enumerate(out_vals) if is_float(o)]
        if not diff or not out_float:
            return None
        return cls(node.target, flat, spec, diff, out_vals, out_float, torch._guards.detect_fake_mode(flat))

    @property
    def tensor_pos(self) -> list:
        return [i for i, a in enumerate(self.flat) if isinstance(a, torch.Tensor)]

    def backward(self, *tensors_and_cts):
        """Gradients of the differentiated inputs, by ``torch.autograd.grad`` (what ``make_fx`` traces)."""
        n = len(self.tensor_pos)
        tensors, cts = tensors_and_cts[:n], tensors_and_cts[n:]
        full = list(self.flat)
        for i, t in zip(self.tensor_pos, tensors):
            full[i] = t.detach().requires_grad_(i in self.diff)
        a, k = pytree.tree_unflatten(full, self.spec)
        with torch.enable_grad():
            outs = pytree.tree_leaves(self.op(*a, **k))
            outs = [outs[i] for i in self.out_float]
            ins = [full[i] for i in self.diff]
            grads = torch.autograd.grad(outs, ins, cts, allow_unused=True)
        self.no_gradient = all(g is None for g in grads)
        return tuple(g if g is not None else torch.zeros_like(x) for g, x in zip(grads, ins))

    def trace(self) -> fx.GraphModule:
        with self.fake_mode, tracing_kernels(), warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*autograd kernel was not registered.*")
            tensors = [self.flat[i] for i in self.tensor_pos]
            return make_fx(self.backward)(*tensors, *[self.out_vals[i] for i in self.out_float])

    def traced(self) -> fx.GraphModule | None:
        """The traced backward; if autograd refuses some float arguments or does not
        differentiate some float outputs, traced again with only those it does (None if none)."""
        try:
            return self.trace()
        except Exception as exc:  # noqa: BLE001 - retried with what autograd accepts
            if is_data_dependent(exc):
                raise
            self.diff, self.out_float = _differentiable(self.op, self.flat, self.spec, self.diff, self.out_float, self.fake_mode)
            if not self.diff or not self.out_float:
                return None
            return self.trace()

    def rule(self, bw: fx.GraphModule) -> Rule:
        """The Rule calling the op forward and ``bw`` backward (missing cotangents as zeros)."""
        op, tensor_pos, diff, out_float, out_vals, spec = (
            self.op,
            self.tensor_pos,
            self.diff,
            self.out_float,
            self.out_vals,
            self.spec,
        )

        def fwd(*a, **k):
            out = op(*a, **k)
            return out, (a, k)

        def bwd(aux, ct):
            a, k = aux
            flat_now, _ = pytree.tree_flatten((a, k))
            every = ct if isinstance(ct, tuple) else (ct,)
            cts = [every[i] for i in out_float]
            cts = [
                c if c is not None else torch.zeros(out_vals[j].shape, dtype=out_vals[j].dtype) for c, j in zip(cts, out_float)
            ]
            grads = bw(*[flat_now[i] for i in tensor_pos], *cts)
            per_flat = [None] * len(flat_now)
            for i, g in zip(diff, grads):
                per_flat[i] = g
            pa, _ = pytree.tree_unflatten(per_flat, spec)
            return tuple(pa)

        return Rule(fwd, bwd, "derived")


def _refusing_rule(node: fx.Node, error: Exception) -> Rule:
    """A Rule that runs ``node``'s op and raises ``error`` if its backward is ever called."""
    op = node.target

    def refuse(aux, ct):
        raise error

    return Rule(lambda *a, **k: (op(*a, **k), None), refuse, "derived")


def _no_gradient_rule(node: fx.Node) -> Rule:
    """A Rule for an op whose outputs require grad yet whose backward gives no input a gradient:
    it was specialised to inputs that do not require grad (a wrapper passed ``x.requires_grad``,
    False while fxtools traces, to a custom op). Zeros would be silently wrong, so it fails when
    (and only if) a gradient is asked of it."""
    from ..errors import user_line_of

    op = node.target
    message = (
        f"PyTorch's derivative of {op} (called from {user_line_of(node) or 'an unknown line'}) gives "
        "no gradient to any input, though its outputs require grad: the call was probably "
        "specialised to inputs that do not require grad. Register a rule with "
        "fxtools.register_vjp, or call a differentiable formulation of it."
    )

    def no_bwd(aux, ct):
        raise MissingRuleError(message)

    return Rule(lambda *a, **k: (op(*a, **k), None), no_bwd, "derived")
