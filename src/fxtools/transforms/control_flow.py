"""Structured control flow: ``torch.cond``, ``scan`` and ``while_loop`` differentiated as themselves.

Capture records each as one higher-order node whose functions are subgraphs (GraphModules held
as attributes of the captured module, read by ``get_attr`` nodes). ``prepare`` treats every
subgraph as a program of its own (functionalized, expanded, its own control flow prepared in
turn), differentiates it with the reverse engine, and gives the node a rule whose forward and
backward are again the same control flow, so the generated code keeps it:

- ``cond(pred, true_fn, false_fn, operands)``: the forward is the ``cond``; the backward is
  ``cond(pred, true_vjp, false_vjp, (*operands, *cotangents))``, each branch's VJP recomputing
  its branch (what is saved: the predicate and the operands);
- ``scan(step, init, xs, consts)``: the forward scan also returns each step's input carry,
  stacked (what is saved per step); the backward is a reverse scan of the step's VJP, carrying
  the carry's cotangent and the sum of the constants' cotangents, so the code does not grow with
  the number of steps;
- ``while_loop(cond_fn, body_fn, carried, consts)``: as PyTorch differentiates it, the forward
  loop also counts its steps and stacks the carry entering each step (a size known only at run
  time); the backward is a ``while_loop`` over the steps in reverse. That backward is not
  differentiated again (second order through a while_loop is refused, naming the line).

Forward mode (``jvp``, by transposing the VJP) and second order differentiate the backward's
``cond`` / ``scan`` in turn. A control-flow op without a rule here (``flex_attention``, say) is
refused by ``check_supported``; one whose values carry no gradient just runs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental import proxy_tensor
from torch.utils import _pytree as pytree

from ..capture.decompose import expand
from ..capture.functionalize import functionalize
from ..capture.trace import Captured
from ..errors import FxtoolsError, current_user_line, user_line_of
from ..graph import meta
from ..graph.nodes import is_float
from ..registry import Rule
from .retrace import retrace
from .reverse import ReverseSpec, reverse

hop = torch.ops.higher_order

__all__ = ["prepare", "is_control_flow"]


def is_control_flow(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _where(node) -> str:
    """The user's line of ``node``; for a node fxtools' own code made (a rule's while_loop in a
    generated module being differentiated again), the script's call of fxtools."""
    return user_line_of(node) or current_user_line()


def prepare(gm: fx.GraphModule, node: fx.Node | None = None) -> None:
    """Prepare the subgraphs of every ``cond`` / ``scan`` / ``while_loop`` in ``gm`` and give each node its rule.

    ``node`` is the control-flow node ``gm`` is a subgraph of (its line names errors inside).
    """
    for n in list(gm.graph.nodes):
        if not is_control_flow(n):
            continue
        if n.meta.get("stack_trace") is None and node is not None:
            n.meta["stack_trace"] = node.meta.get("stack_trace")
        make = _RULE_MAKERS.get(n.target)
        if make is None:
            continue
        for sub in _subgraphs(gm, n):
            _prepare_graph(sub, n)
        meta.RULE.set(n, make(gm, n))


def _subgraphs(gm, node) -> list[fx.GraphModule]:
    return [getattr(gm, str(a.target)) for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]


def _prepare_graph(sub: fx.GraphModule, node: fx.Node) -> None:
    for n in sub.graph.nodes:  # a subgraph's ops are traced without stack traces: they have the call's
        if n.op == "call_function" and not n.meta.get("stack_trace"):
            n.meta["stack_trace"] = node.meta.get("stack_trace")
    functionalize(sub)
    expand(sub)
    prepare(sub, node)


def _captured(sub: fx.GraphModule, node: fx.Node) -> Captured:
    """A subgraph as the reverse engine's input: its placeholders are its (tensor) arguments."""
    ph = [p for p in sub.graph.nodes if p.op == "placeholder"]
    leaves = [p.meta.get("val") for p in ph]
    for p, v in zip(ph, leaves):
        if not isinstance(v, torch.Tensor):
            what = "a Python number" if isinstance(v, (int, float, torch.SymInt, torch.SymFloat)) else f"a {type(v).__name__}"
            raise FxtoolsError(
                f"{node.target.name()} (at {_where(node)}) passes {what} to its function; fxtools differentiates "
                "control flow over tensors only: pass it as a 0-dim tensor (torch.tensor(0)), or close over it."
            )
    out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    outs = [o.meta.get("val") if isinstance(o, fx.Node) else o for o in out]
    _, in_spec = pytree.tree_flatten(tuple(leaves))
    _, out_spec = pytree.tree_flatten(list(outs))
    n = len(leaves)
    names = [p.name for p in ph]
    return Captured(sub, names, sub, in_spec, out_spec, leaves, names, [True] * n, list(range(n)), outs)


def _fresh(outs, inputs):
    """Outputs of a subgraph may alias neither its inputs nor each other, and must have the same
    layout whatever branch or step computed them (control flow's rules): copy those that would
    not, contiguous (a gradient may come out as an expanded or transposed view)."""
    seen = list(inputs)
    fresh = []
    for o in outs:
        if not o.is_contiguous():
            o = o.contiguous()
        elif any(o is s for s in seen):
            o = o.clone()
        seen.append(o)
        fresh.append(o)
    return tuple(fresh)


def _vjp_function(sub: fx.GraphModule, node: fx.Node):
    """``fn(*inputs, *cts) -> grads``: the VJP of ``sub``, cotangents for its floating-point
    outputs, gradients for its floating-point inputs (zeros where none flows)."""
    cap = _captured(sub, node)
    wrt = [is_float(v) for v in cap.leaves]
    rev = reverse(cap.gm, ReverseSpec(wrt, "cotangent"))
    joint, ct_index = rev.gm, rev.ct_index
    n_in, n_out = len(cap.leaves), len(cap.out_leaves)
    float_outs = [i for i, o in enumerate(cap.out_leaves) if is_float(o)]

    def vjp_fn(*flat):
        inputs, cts = flat[:n_in], flat[n_in:]
        ct_of = dict(zip(float_outs, cts))
        res = joint(*inputs, *(ct_of[i] for i in ct_index))
        return _fresh(res[n_out:], flat)

    return vjp_fn, cap


def _traced_node(tensor) -> fx.Node | None:
    """The node of the trace in progress that holds ``tensor``, or None."""
    mode = proxy_tensor.get_innermost_proxy_mode()
    if mode is None:
        return None
    try:
        return proxy_tensor.get_proxy_slot(tensor, mode.tracer).proxy.node
    except Exception:  # noqa: BLE001 - not a traced tensor
        return None


def _label(tensor, name: str, note: str | None) -> None:
    """Name the traced node holding ``tensor`` and say what it holds (``Split.report`` prints it)."""
    node = _traced_node(tensor)
    if node is None:
        return
    node._rename(name)
    if note:
        meta.NOTE.set(node, note)


def _label_steps(stacked, each: str):
    """Label ``stacked``, the carry entering each step of a loop, one per row; returns it."""
    kind = str(stacked.dtype).replace("torch.", "") + str(list(stacked.shape[1:]))
    _label(stacked, "carry_steps", f"per step: {kind}, the carry entering each {each}")
    return stacked


def _mark_grad(results) -> None:
    """Mark the control-flow node that computed ``results`` as a backward's (its functions are
    then named ``true_branch_grad``, ``step_grad``, ...)."""
    node = _traced_node(results[0]) if results else None
    if node is not None and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        meta.GRAD_OF_CONTROL_FLOW.set(node.args[0], True)


def _fill(mask, values):
    it = iter(values)
    return [next(it) if m else None for m in mask]


def _split(seq, *sizes) -> list:
    """``seq`` cut into consecutive pieces of the given sizes, and the rest."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(seq[start : start + size])
        start += size
    return [*pieces, seq[start:]]


def _floats(vals) -> list[bool]:
    return [is_float(v) for v in vals]


def _only_floats(vals) -> list:
    return [v for v in vals if is_float(v)]


def _zero_cts(consts) -> list:
    """Zeros to start the sum of the floating-point constants' cotangents over the steps."""
    return [torch.zeros_like(a) for a in consts if is_float(a)]


def _accumulate(acc, grads) -> tuple:
    return tuple(s + g for s, g in zip(acc, grads))


def _flip(t):
    return torch.flip(t, [0])


def _float_cts(ct, outs):
    """The cotangents of the floating-point outputs, zeros where none came."""
    if not isinstance(ct, (tuple, list)):
        ct = (ct,)
    return [c if c is not None else torch.zeros_like(o) for c, o in zip(ct, outs) if is_float(o)]


def _refuse_different_shapes(node, true_gm, false_gm) -> None:
    """Branches returning different shapes (eager runs one, so it accepts them; the output's size
    then depends on the predicate's value) are refused, naming the user's line."""

    def shapes(sub):
        outs = pytree.tree_leaves(next(n for n in sub.graph.nodes if n.op == "output").args[0])
        return [list(o.meta["val"].shape) if isinstance(o, fx.Node) and "val" in o.meta else None for o in outs]

    a, b = shapes(true_gm), shapes(false_gm)
    if a != b:
        raise FxtoolsError(
            f"torch.cond at {user_line_of(node) or 'an unknown line'}: its branches return different shapes "
            f"({a} and {b}), so the output's shape depends on the predicate's value. fxtools builds one module "
            "for every value of the predicate (as torch.export does): make both branches return the same "
            "shapes (pad, or slice after the cond), or decide with a Python bool."
        )


def _cond_rule(gm, node) -> Rule:
    """``cond``'s rule: the backward is a ``cond`` over the two branches' VJPs."""
    _, true_n, false_n, _ = node.args
    _refuse_different_shapes(node, getattr(gm, true_n.target), getattr(gm, false_n.target))
    true_vjp, cap = _vjp_function(getattr(gm, true_n.target), node)
    false_vjp, _ = _vjp_function(getattr(gm, false_n.target), node)
    vals = [*cap.leaves, *_only_floats(cap.out_leaves)]
    true_bwd, false_bwd = retrace(true_vjp, vals), retrace(false_vjp, vals)

    def fwd(pred, true_fn, false_fn, operands):
        out = hop.cond(pred, true_fn, false_fn, operands)
        return out, (pred, operands, out)

    def bwd(aux, ct):
        pred, operands, out = aux
        grads = hop.cond(pred, true_bwd, false_bwd, (*operands, *_float_cts(ct, out)))
        _mark_grad(grads)
        return None, None, None, _fill(_floats(operands), grads)

    return Rule(fwd, bwd, source="control flow")


def _scan_rule(gm, node) -> Rule:
    """``scan``'s rule: the forward also stacks each step's input carry; the backward is a
    reverse scan of the step's VJP."""
    step_n, init_n, xs_n, _ = node.args
    step = getattr(gm, step_n.target)
    n_c, n_x = len(init_n), len(xs_n)
    step_vjp, cap = _vjp_function(step, node)
    carry_v, x_v, const_v = _split(cap.leaves, n_c, n_x)
    n_y = len(cap.out_leaves) - n_c
    fc, fx_, fa = _floats(carry_v), _floats(x_v), _floats(const_v)
    nfc, nfa = sum(fc), sum(fa)

    def step_saving_carry(*a):
        return (*step(*a), *(c.clone() for c in a[:n_c]))

    step_fwd = retrace(step_saving_carry, cap.leaves)
    step_back = _scan_step_backward(step_vjp, carry_v, x_v, const_v, cap.out_leaves[n_c:])

    def fwd(step_fn, init, xs, consts):
        res = hop.scan(step_fwd, init, xs, consts)
        value, carries = list(res[: n_c + n_y]), res[n_c + n_y :]
        return value, (carries, init, xs, consts, value)

    def bwd(aux, ct):
        carries, init, xs, consts, value = aux
        ct_carry, ct_y = _split(_float_cts(ct, value), nfc)
        zeros = _zero_cts(consts)
        steps = [_label_steps(_flip(c), f"of the {c.shape[0]} steps of the scan, last step first") for c in carries]
        res = hop.scan(step_back, [*ct_carry, *zeros], [*steps, *map(_flip, xs), *map(_flip, ct_y)], consts)
        _mark_grad(res)
        g_init, g_consts, g_xs = _split(res, nfc, nfa)
        return None, _fill(fc, g_init), _fill(fx_, [_flip(g) for g in g_xs]), _fill(fa, g_consts)

    return Rule(fwd, bwd, source="control flow")


def _scan_step_backward(step_vjp, carry_v, x_v, const_v, y_v) -> fx.GraphModule:
    """The reverse scan's step: carrying the carry's cotangent and the sum of the constants'
    cotangents, over each step's input carry, ``x`` and output cotangent (last step first), it
    runs the step's VJP and returns the new carry and that step's ``x`` cotangent."""
    n_c, n_x = len(carry_v), len(x_v)
    nfc, nfx, nfa, nfy = (sum(_floats(vs)) for vs in (carry_v, x_v, const_v, y_v))

    def step_bwd(*a):
        ct_carry, acc, carry, x, ct_y, consts = _split(a, nfc, nfa, n_c, n_x, nfy)
        grads = step_vjp(*carry, *x, *consts, *ct_carry, *ct_y)
        g_carry, g_x, g_const = _split(grads, nfc, nfx)
        return _fresh((*g_carry, *_accumulate(acc, g_const), *g_x), a)

    vals = [*_only_floats(carry_v), *_only_floats(const_v), *carry_v, *x_v, *_only_floats(y_v), *const_v]
    return retrace(step_bwd, vals)


def _while_loop_rule(gm, node) -> Rule:
    """``while_loop``'s rule, as PyTorch's (``while_loop_stack_output``): the forward loop also
    counts its steps and stacks the carry entering each step; the backward is a ``while_loop``
    over the steps in reverse, carrying the carry's cotangent and the sum of the constants'
    cotangents. (Counting tells no steps from one: both stack one carry.)"""
    cond_n, body_n, carried_n, _ = node.args
    body = getattr(gm, body_n.target)
    n_c = len(carried_n)
    body_vjp, cap = _vjp_function(body, node)
    carry_v, const_v = _split(cap.leaves, n_c)
    fc, fa = _floats(carry_v), _floats(const_v)
    nfc = sum(fc)
    count_cond, count_body = _counting_loop(getattr(gm, cond_n.target), body, carry_v, const_v)
    back_cond, back_body = _while_loop_backward(body_vjp, carry_v, const_v)

    def fwd(cond_fn, body_fn, carried, consts):
        n0 = torch.zeros((), dtype=torch.int64, device=carried[0].device)
        stacked = hop.while_loop_stack_output(count_cond, count_body, (n0, *carried, *map(torch.zeros_like, carried)), consts)
        torch._check(stacked[0].size(0) >= 1)
        value = tuple(s[-1] for s in stacked[1 : 1 + n_c])
        n = stacked[0][-1]
        _label(n, "n_steps", None)
        for s in stacked[1 + n_c :]:
            _label_steps(s, "step of the while_loop")
        return value, (n, stacked[1 + n_c :], consts, value)

    def bwd(aux, ct):
        n, steps, consts, value = aux
        zeros = _zero_cts(consts)
        step = torch.zeros_like(n)
        res = hop.while_loop(back_cond, back_body, (step, *_float_cts(ct, value), *zeros), (n, *steps, *consts))
        _mark_grad(res)
        return None, None, _fill(fc, res[1 : 1 + nfc]), _fill(fa, res[1 + nfc :])

    return Rule(fwd, bwd, source="control flow")


def _counting_loop(cond_gm, body, carry_v, const_v):
    """The forward loop's functions: ``(n, *carry, *carry_in), consts``, where ``n`` counts the
    steps and ``carry_in`` is the carry entering the step (stacked by ``while_loop_stack_output``)."""
    n_c = len(carry_v)

    def counting_cond(n, *a):
        return cond_gm(*a[:n_c], *a[2 * n_c :])

    def counting_body(n, *a):
        carry, consts = a[:n_c], a[2 * n_c :]
        return (n + 1, *_fresh(body(*carry, *consts), a), *(c.clone() for c in carry))

    vals = [torch.zeros((), dtype=torch.int64), *carry_v, *carry_v, *const_v]
    return retrace(counting_cond, vals), retrace(counting_body, vals)


def _while_loop_backward(body_vjp, carry_v, const_v):
    """The backward loop's functions: ``(i, *ct_carry, *acc), (n, *steps, *consts)``, running
    the body's VJP on step ``n - 1 - i``'s input carry while ``i < n``."""
    n_c, nfc, nfa = len(carry_v), sum(_floats(carry_v)), sum(_floats(const_v))

    def back_cond(i, *a):
        return i < a[nfc + nfa]

    def back_body(i, *a):
        ct_carry, acc, (n,), steps, consts = _split(a, nfc, nfa, 1, n_c)
        t = (n - 1 - i).reshape(1)
        carry = [torch.index_select(s, 0, t).squeeze(0) for s in steps]
        grads = body_vjp(*carry, *consts, *ct_carry)
        return (i + 1, *_fresh((*grads[:nfc], *_accumulate(acc, grads[nfc:])), a))

    count_v = torch.zeros((), dtype=torch.int64)
    steps_v = [torch.empty((2, *v.shape), dtype=v.dtype, device=v.device) for v in carry_v]
    vals = [count_v, *_only_floats(carry_v), *_only_floats(const_v), count_v, *steps_v, *const_v]
    return retrace(back_cond, vals), retrace(back_body, vals)


def _refused_rule(gm, node) -> Rule:
    """A control-flow op fxtools does not differentiate: runs where no gradient flows through it."""

    def refuse(*args):
        raise FxtoolsError(
            f"fxtools cannot differentiate the gradient of a while_loop again (at {_where(node)}): "
            "hvp, hessian, or jvp of a gradient through a while_loop. When the number of steps is known, "
            "write the loop as a scan (torch._higher_order_ops.scan), which fxtools differentiates to any order."
        )

    return Rule(refuse, refuse, source="control flow")


_RULE_MAKERS = {
    hop.cond: _cond_rule,
    hop.scan: _scan_rule,
    hop.while_loop: _while_loop_rule,
    hop.while_loop_stack_output: _refused_rule,
}
