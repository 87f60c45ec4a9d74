"""``torch.autograd.grad`` inside a program fxtools captures (a PINN's input derivative, a WGAN-GP
gradient penalty).

The trace records no autograd graph: its values are FakeTensors with proxies. What it does record
is the computation itself, so the gradient is taken from there: the nodes of the running trace
that lie between ``inputs`` and ``outputs`` are replayed as a function of ``inputs`` (everything
else they read is the outer value itself, as in a closure), and ``torch.func.vjp`` of that
function, which fxtools traces below functorch (``capture/nested.py``), gives the gradient as ATen
ops in the program. Later transforms differentiate them like any others: ``create_graph=True`` is
a second derivative, ``create_graph=False`` a ``detach()`` of the result (no gradient flows
through it, as in eager). Replaying recomputes the forward; common-subexpression elimination
merges the copies.

Refused, naming the user's line (``AutogradInsideError``): a random op between ``inputs`` and
``outputs`` (replayed, it would draw again), a function with its own backward, an in-place write
into a value computed outside that stretch or into one it read (directly or through a view, after the read), ``is_grads_batched``, ``GradientEdge``s and dict inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental import proxy_tensor

from ..errors import FxtoolsError, current_user_line
from ..graph import meta
from ..graph.nodes import ancestors, calls_with_grad_mode, is_impure

__all__ = ["AutogradInsideError", "grad_in_trace"]


class AutogradInsideError(FxtoolsError):
    """``torch.autograd.grad`` inside a traced program that fxtools cannot take from the trace."""


def _refuse(why: str) -> AutogradInsideError:
    return AutogradInsideError(
        f"torch.autograd.grad (at {current_user_line()}) {why}; fxtools takes the gradient from its trace "
        "and cannot here. Write it with torch.func.grad / torch.func.vjp (which fxtools differentiates "
        "as written), or keep it outside the function fxtools transforms."
    )


def _node(t, tracer) -> fx.Node | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return proxy_tensor.get_proxy_slot(t, tracer).proxy.node
    except Exception:  # noqa: BLE001 - not a traced value (a real tensor of the closure)
        return None


def _stretch(graph: fx.Graph, ins: list[fx.Node], outs: list[fx.Node]) -> tuple[list[fx.Node], set[fx.Node]]:
    """The nodes computed from ``ins`` with grad enabled that ``outs`` read, in order, and the
    inputs they read. A value computed under ``no_grad`` carries no gradient (as in eager): it is
    read, not replayed. An input computed from another input is replayed too: eager's gradient
    flows both into it and through it."""
    below: set[fx.Node] = set(ins)
    derived: set[fx.Node] = set()
    for n, grad_enabled in calls_with_grad_mode(graph):
        if grad_enabled and any(a in below for a in n.all_input_nodes):
            below.add(n)
            derived.add(n)
    reached = ancestors(outs, below.__contains__)
    return [n for n in graph.nodes if n in derived and n in reached], reached


def _check(nodes: list[fx.Node], replayed: set[fx.Node]) -> None:
    for n in nodes:
        target = n.target
        if meta.RULE.on(n) or n.op != "call_function":
            raise _refuse("differentiates through a function with its own backward")
        if isinstance(target, torch._ops.OpOverload):
            if torch.Tag.nondeterministic_seeded in target.tags and is_impure(n):  # draws (not eval dropout)
                raise _refuse(f"differentiates through a random op ({target}), which a replay would draw again")
            for i, a in enumerate(target._schema.arguments):
                written = a.alias_info is not None and a.alias_info.is_write
                if written and i < len(n.args) and n.args[i] not in replayed:
                    raise _refuse(f"differentiates through an in-place write ({target}) into a value computed before")


def _views(n: fx.Node) -> bool:
    """Whether ``n`` is a view of its first argument."""
    if not isinstance(n.target, torch._ops.OpOverload) or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    schema = n.target._schema
    first, out = schema.arguments[0].alias_info, schema.returns[0].alias_info if schema.returns else None
    return first is not None and not first.is_write and out is not None


def _written_after(n: fx.Node, reads: list[fx.Node]) -> bool:
    """Whether an op of the trace wrote ``n``'s tensor in place, directly or through a view of it,
    after the first of ``reads`` read it (eager's backward would see the version change)."""
    order = {m: i for i, m in enumerate(n.graph.nodes)}
    first = min(order[m] for m in reads)
    while _views(n):  # from the tensor whose storage it shares
        n = n.args[0]  # type: ignore[assignment]
    todo, seen = [n], set()
    while todo:
        m = todo.pop()
        seen.add(m)
        for user in m.users:
            if not isinstance(user.target, torch._ops.OpOverload) or user in seen:
                continue
            schema = user.target._schema.arguments
            for i, a in enumerate(user.args):
                alias = schema[i].alias_info if a is m and i < len(schema) else None
                if alias is not None and alias.is_write and order[user] > first:
                    return True
                if alias is not None and not alias.is_write:  # a view of it
                    todo.append(user)
    return False


def _released(n: fx.Node, tracer) -> Any:
    """The value of node ``n`` of the trace whose tensor the program no longer holds: a constant
    the trace stored, or a temporary Python released (``torch.ones_like(u)`` passed as
    ``grad_outputs``), which the trace's record of it stands for again."""
    if n.op == "get_attr":
        return functools.reduce(getattr, str(n.target).split("."), tracer.root)
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return val  # a symbolic size
    proxy_tensor.track_tensor_tree(val, fx.Proxy(n, tracer), constant=None, tracer=tracer)
    return val


def _as_list(x) -> list:
    return list(x) if isinstance(x, Sequence) and not isinstance(x, torch.Tensor) else [x]


def _cotangents(outputs: list, grad_outputs) -> list:
    given = _as_list(grad_outputs) if grad_outputs is not None else [None] * len(outputs)
    if len(given) != len(outputs):
        raise RuntimeError(f"grad requires one grad_output per output: got {len(given)} for {len(outputs)} outputs")
    cts = []
    for out, g in zip(outputs, given):
        if g is None:
            if out.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(out)
        cts.append(g)
    return cts


def grad_in_trace(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph=None,
    create_graph=False,
    only_inputs=True,
    allow_unused=None,
    is_grads_batched=False,
    materialize_grads=False,
):
    """``torch.autograd.grad`` of values of the running trace (see the module docstring)."""
    if is_grads_batched:
        raise _refuse("is given is_grads_batched=True")
    if isinstance(inputs, dict) or any(not isinstance(t, torch.Tensor) for t in (*_as_list(outputs), *_as_list(inputs))):
        raise _refuse("is given something other than tensors (a GradientEdge or a dict)")
    mode = proxy_tensor.get_innermost_proxy_mode()
    if mode is None:
        raise _refuse("runs where fxtools records no trace")
    tracer = mode.tracer
    outs, ins = _as_list(outputs), _as_list(inputs)
    cts = _cotangents(outs, grad_outputs)
    found, out_nodes = [_node(t, tracer) for t in ins], [_node(t, tracer) for t in outs]
    in_nodes = [n for n in found if n is not None]
    if len(in_nodes) < len(found):
        raise _refuse("differentiates with respect to a tensor the trace did not compute")
    nodes, reached = _stretch(tracer.graph, in_nodes, [n for n in out_nodes if n is not None])
    replayed = set(nodes) | set(in_nodes)
    _check(nodes, replayed)
    used = [i for i, n in enumerate(in_nodes) if n in reached]
    if len(used) < len(ins) and not (allow_unused or materialize_grads):
        raise RuntimeError(
            "One of the differentiated Tensors appears to not have been used in the graph. "
            "Set allow_unused=True if this is the desired behavior."
        )
    keep = [k for k, n in enumerate(out_nodes) if n in replayed]
    live = {slot.proxy.node: t for t, slot in tracer.tensor_tracker.items()}
    for a in {a for n in nodes for a in n.all_input_nodes if a not in replayed}:
        if _written_after(a, [n for n in nodes if a in n.all_input_nodes]):
            raise _refuse("differentiates through a value written in place after it was read")
        if a not in live:
            live[a] = _released(a, tracer)

    def replay(*xs):
        env: dict[fx.Node, Any] = dict(zip([in_nodes[i] for i in used], xs))

        def value(a: fx.Node):
            return env[a] if a in env else live[a]

        for n in nodes:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), value)
            out = n.target(*args, **kwargs)  # type: ignore[operator]
            given = env.get(n)  # an input computed from another: both derivatives (value + 0)
            env[n] = out if given is None else out + (given - given.detach())
        return tuple(env[out_nodes[k]] for k in keep)  # type: ignore[index]  # kept: not None

    grads: list = [None] * len(ins)
    if used and keep:
        vjp_fn = torch.func.vjp(replay, *[ins[i] for i in used])[1]
        for i, g in zip(used, vjp_fn(tuple(cts[k] for k in keep))):
            grads[i] = g if create_graph else g.detach()
    if materialize_grads:
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(ins, grads)]
    return tuple(grads)
