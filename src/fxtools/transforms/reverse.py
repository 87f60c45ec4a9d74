"""Reverse mode: turn a captured graph into one graph computing its value and its VJP.

This is seed 000's ``vjp_template``, traced with ``make_fx`` instead of ``symbolic_trace``:

1. Walk the captured graph in order. For each op that carries a gradient, call its rule's
   forward ``fwd(*args) -> (value, aux)`` and push ``(node, rule, aux)`` on a tape. Ops that
   carry no gradient (integer math, ops on constants, ``no_grad`` regions) just run.
2. Seed the output cotangents, then walk the tape backwards calling ``bwd(aux, ct)`` and adding
   each returned cotangent into its argument's. Absent cotangents are ``None``, never zeros:
   branches that do not reach the output emit no code.

The template runs on FakeTensors under ``make_fx``, so the torch calls inside the rules are
what the resulting graph contains. Cotangent nodes are named ``grad_<value>``.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental import proxy_tensor

from .. import registry
from ..capture.names import name_rule_steps, recording_rule_lines
from ..capture.trace import data_dependent_error, is_data_dependent, trace_flat
from ..errors import MissingRuleError, user_line_of
from ..graph import meta
from ..graph.data_dependent import cotangent_example, dynamic_nodes, is_dynamic, symbolic_mode, tie
from ..graph.nodes import is_float
from ..registry import differentiable_nodes
from .replay import Memo

aten = torch.ops.aten


def _value(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def missing_rule(node) -> MissingRuleError:
    where = user_line_of(node)
    op = node.target
    name = getattr(op, "__name__", str(op))
    return MissingRuleError(
        f"no VJP rule for {op} "
        f"(called from {where or 'an unknown line'}), and PyTorch gives no decomposition or "
        f"derivative for it.\nRegister one with\n"
        f"    fxtools.register_vjp(torch.ops.aten.{name.split('.')[0]}, fwd, bwd)\n"
        "where fwd(*args) -> (value, aux) and bwd(aux, ct) -> one cotangent per argument."
    )


def rule_for(node):
    rule = (
        meta.RULE.get(node)
        or getattr(node.target, "vjp_rule", None)  # custom.CustomCall
        or registry.lookup(node.target)
    )
    if rule is None:
        raise missing_rule(node)
    if not registry.handles(rule, node) and not meta.RULE.on(node):
        rule = registry.lookup_node(node)
    if rule is None:
        kind, other = ("complex", "real") if registry.lookup(node.target).complex == "real" else ("real", "complex")
        raise MissingRuleError(
            f"fxtools cannot differentiate {node.target} with {kind} tensors (called from "
            f"{user_line_of(node) or 'an unknown line'}): its VJP rule is written for {other} tensors only "
            "and PyTorch gives no decomposition or derivative formula for this call. Register a rule "
            "following autograd's convention for complex tensors with fxtools.register_vjp"
            + (", or differentiate a real formulation (torch.view_as_real)." if kind == "complex" else ".")
        )
    return rule


def _getitem_users(node) -> dict:
    return {u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}


class _Namer:
    """Names the traced nodes holding given tensors (``scores``, ``grad_scores``) once tracing ends,
    and the other nodes a rule makes after the value it belongs to and their op (``grad_scores_sum``)."""

    def __init__(self):
        self.names: dict[fx.Node, str] = {}
        self.owners: dict[fx.Node, str] = {}
        self.weak: set[fx.Node] = set()

    @contextlib.contextmanager
    def owner(self, name: str):
        """Nodes traced inside the block belong to ``name``."""
        mode = proxy_tensor.get_innermost_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        last = graph._root.prev if graph is not None else None
        try:
            with recording_rule_lines():
                yield
        finally:
            if graph is not None:
                node = last.next
                while node is not graph._root:
                    self.owners.setdefault(node, name)
                    node = node.next

    def __call__(self, tensor, name: str, weak: bool = False, owner: str | None = None) -> None:
        """Name the node holding ``tensor``; a ``weak`` name (an intermediate's) yields to a later one.
        With ``owner``, only a node traced for it (a rule returning its argument names nothing)."""
        mode = proxy_tensor.get_innermost_proxy_mode()
        if mode is None or not isinstance(tensor, torch.Tensor):
            return
        try:
            node = proxy_tensor.get_proxy_slot(tensor, mode.tracer).proxy.node
        except Exception:  # noqa: BLE001 - not a traced tensor: nothing to name
            return
        if owner is not None and self.owners.get(node) != owner:
            return
        if node.op == "call_function" and (node not in self.names or node in self.weak):
            self.names[node] = name
            if weak:
                self.weak.add(node)
            else:
                self.weak.discard(node)

    def apply(self, graph: fx.Graph) -> None:
        for node, name in self.names.items():
            node._rename(name)
        name_rule_steps(graph, set(self.names), self.owners)


@dataclass
class ReverseSpec:
    """What to differentiate: which captured placeholders, and how the output is seeded."""

    wrt: list[bool]  # per captured placeholder
    seed: str = "cotangent"  # "cotangent": one input per float output; "ones": scalar output


@dataclass
class ReverseResult:
    """The value-and-VJP graph of a captured graph.

    ``gm`` takes the captured tensor inputs followed by one cotangent per output leaf listed in
    ``ct_index`` (when seeded by cotangents), and returns the output leaves followed by one
    gradient per placeholder listed in ``grad_index`` (those with ``wrt`` set).
    """

    gm: fx.GraphModule
    ct_index: list[int]
    grad_index: list[int]


def reverse(captured: fx.GraphModule, spec: ReverseSpec) -> ReverseResult:
    """Build the value-and-VJP graph of ``captured`` (a flat, functional ATen graph)."""
    graph = captured.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output_node = next(n for n in graph.nodes if n.op == "output")
    out_nodes = list(output_node.args[0])
    wrt_nodes = {p for p, w in zip(placeholders, spec.wrt) if w and is_float(p.meta.get("val"))}
    need = differentiable_nodes(captured, wrt_nodes)
    # Only ops the outputs depend on carry cotangents; the rest (BatchNorm's running-statistics
    # updates, ``copy_`` into buffers) just run, and need no rule.
    reach = ancestors(out_nodes)
    need = {n for n in need if n in reach or n in wrt_nodes}
    ct_index = [i for i, o in enumerate(out_nodes) if isinstance(o, fx.Node) and o in need]
    if spec.seed == "ones" and len(ct_index) > 1:
        raise ValueError("grad needs a function with one scalar tensor output; use vjp for more")
    for node in need:
        if node.op == "call_function" and node.target is not operator.getitem:
            rule_for(node)  # fail before tracing, with the user's line
    namer = _Namer()
    current = [None]  # the node being differentiated, for error messages
    dynamic = set(dynamic_nodes(captured))  # data-dependent shapes (x[mask]): see graph/data_dependent.py

    def template(*flat):
        inputs, cts = flat[: len(placeholders)], flat[len(placeholders) :]
        env: dict[fx.Node, object] = dict(zip(placeholders, inputs))
        memo = Memo()  # repeated calls (identical layers) copy their first trace: see transforms/replay.py
        tape = []
        for node in graph.nodes:
            if node.op == "get_attr":
                env[node] = getattr(captured, node.target)
            elif node.op == "call_function":
                current[0] = node
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                if node.target is torch._C._set_grad_enabled:
                    continue
                # With ``fx.traceback.preserve_node_meta()`` on (fxtools.split), the traced nodes
                # inherit the op's stack trace and markers; otherwise this is a no-op.
                with fx_traceback.set_current_meta(node), namer.owner(node.name):
                    if node.target is operator.getitem or node not in need:
                        env[node] = memo.call(node.target, *args, **kwargs)
                    else:
                        rule = rule_for(node)
                        env[node], aux = memo.call(rule.fwd, *args, **kwargs)
                        tape.append((node, rule, aux))
                # a part of a multi-output op was traced with the op; any other value must be its rule's own
                owner = None if node.target is operator.getitem else node.name
                namer(env[node], node.name, weak=meta.INTERMEDIATE.on(node), owner=owner)
                if node in dynamic:
                    tie(env[node], node.meta["val"])
            elif node.op not in ("placeholder", "output"):
                raise NotImplementedError(f"fxtools cannot differentiate a graph with {node.op} nodes")

        ct: dict[fx.Node, torch.Tensor] = {}

        def add(node, c):
            if c is None or node not in need:
                return
            if isinstance(c, torch.Tensor) and c.dtype != node.meta["val"].dtype:
                # a complex cotangent reaching a real value keeps its real part, as in autograd
                c = memo.call(registry.cast_cotangent, c, node.meta["val"].dtype)
            ct[node] = c if node not in ct else memo.call(operator.add, ct[node], c)

        if spec.seed == "ones":
            for i in ct_index:
                add(out_nodes[i], torch.ones_like(env[out_nodes[i]]))
        else:
            for i, c in zip(ct_index, cts):
                add(out_nodes[i], c)

        for node, rule, aux in reversed(tape):
            current[0] = node
            if isinstance(node.meta.get("val"), (tuple, list)):
                items = _getitem_users(node)
                c = tuple(ct.get(items.get(i)) for i in range(len(node.meta["val"])))
                if all(x is None for x in c):
                    continue
                for item in items.values():  # the parts' cotangents: ``grad_q`` of ``q, k, v = ...``
                    namer(ct.get(item), f"grad_{item.name}")
            else:
                c = ct.get(node)
                if c is None:
                    continue
                namer(c, f"grad_{node.name}")
            with namer.owner(f"grad_{node.name}"):
                with fx_traceback.set_current_meta(node):
                    dargs = memo.call(rule.bwd, aux, c)
                if not isinstance(dargs, (tuple, list)) or (
                    len(node.args) == 1 and isinstance(node.args[0], (list, tuple)) and not isinstance(dargs, tuple)
                ):
                    dargs = (dargs,)
                for a, d in zip(node.args, dargs):
                    if isinstance(a, (list, tuple)):
                        for ai, di in zip(a, d if d is not None else [None] * len(a)):
                            if isinstance(ai, fx.Node):
                                add(ai, di)
                    elif isinstance(a, fx.Node):
                        add(a, d)

        outs = [env[o] if isinstance(o, fx.Node) else o for o in out_nodes]
        grads = []
        for p, w in zip(placeholders, spec.wrt):
            if not w:
                continue
            g = ct.get(p)
            if g is None and is_float(env[p]):
                g = torch.zeros_like(env[p])
            if g is not None:
                namer(g, f"grad_{p.name}")
            grads.append(g)
        return (*outs, *grads)

    ct_vals = [out_nodes[i].meta["val"] for i in ct_index] if spec.seed == "cotangent" else []
    mode = example_mode([p.meta["val"] for p in placeholders] + ct_vals)
    examples = [_example(p.meta["val"], mode, keep_strides=True) for p in placeholders]
    ct_examples = [_example(v, mode) for v in ct_vals]
    try:
        gm = trace_flat(template, [*examples, *ct_examples], record_stack_traces=False)
    except Exception as exc:
        if is_data_dependent(exc):
            raise data_dependent_error(exc, current[0]) from exc
        raise
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, p in zip(ph, placeholders):  # arguments first: values never take their names
        node._rename(p.name)
    for node, i in zip(ph[len(placeholders) :], ct_index):
        src = out_nodes[i]
        node._rename(f"grad_{src.name}" if len(ct_index) > 1 else single_cotangent_name(src))
    for node in gm.graph.nodes:  # the conjugated arguments of holomorphic rules (complex tensors)
        if node.target is aten._conj.default and node.name.startswith("_conj"):
            node._rename(f"{node.args[0].name}_conj")
    _copy_constants(captured, gm)
    namer.apply(gm.graph)
    grad_index = [i for i, w in enumerate(spec.wrt) if w]
    return ReverseResult(gm, ct_index, grad_index)


def single_cotangent_name(out: fx.Node) -> str:
    """The argument holding the cotangent of a function's one output: ``grad_out``, or ``grad_loss``
    when the user's code computes a scalar loss (its ``out`` may then be a value of its own)."""
    return "grad_loss" if isinstance(out, fx.Node) and out.name == "loss" else "grad_out"


def ancestors(nodes) -> set[fx.Node]:
    """``nodes`` and every node they depend on."""
    seen: set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def example_mode(vals):
    """The fake mode to re-trace in: the capture's when a value has a data-dependent or a
    symbolic size (its symbols live there), else a fresh one, as ``make_fx`` would make for real
    examples."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for val in vals:
        if isinstance(val, torch.Tensor) and is_dynamic(val):
            return val.fake_mode
    symbolic = symbolic_mode(vals)  # sizes marked dynamic: their symbols live in the capture's mode
    if symbolic is not None:
        return symbolic
    return FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)


def _example(val, mode, keep_strides=False):
    """A FakeTensor of ``mode`` standing in for ``val`` when re-tracing.

    Examples stay fake, so nothing is allocated however large the example (a 100000 x 100000
    argument on the ``meta`` device costs nothing), and the re-trace sees the value's own device.

    With ``keep_strides`` (the function's own arguments) it has the example argument's strides,
    so the re-traced graph knows which values are contiguous (simplify keeps ``.contiguous()``
    exactly where a later ``.view`` needs it). Cotangents are contiguous, as callers make them.
    """
    if not isinstance(val, torch.Tensor):
        return val
    if is_dynamic(val):
        return cotangent_example(val)  # a FakeTensor with the same data-dependent sizes
    with mode:
        if keep_strides:
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        return torch.empty(val.shape, dtype=val.dtype, device=val.device)


def _copy_constants(src: fx.GraphModule, dst: fx.GraphModule) -> None:
    """Keep the captured module's attribute names for constants the template re-traced."""
    by_id = {id(getattr(src, n.target)): n.target for n in src.graph.nodes if n.op == "get_attr"}
    renames = {}
    for node in dst.graph.nodes:
        if node.op == "get_attr" and node.target not in renames:
            name = by_id.get(id(getattr(dst, node.target)))
            if name and name != node.target and not hasattr(dst, name):
                setattr(dst, name, getattr(dst, node.target))
                renames[node.target] = name
    for node in dst.graph.nodes:
        if node.op == "get_attr" and node.target in renames:
            node.target = renames[node.target]
            node._rename(node.target)
    for old in renames:
        delattr(dst, old)
