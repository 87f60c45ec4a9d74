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

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree

from .. import registry
from ..capture.functionalize import is_mutating
from ..errors import MissingRuleError, RuleRefusal, user_line_of
from ..graph import meta
from ..graph.data_dependent import dynamic_nodes, tie
from ..graph.nodes import ancestors, calls_with_grad_mode, is_float, reads_tracked_tensor
from ..registry import differentiable_nodes
from .replay import Memo
from .retrace import Namer, Retracer, copy_constants

aten = torch.ops.aten


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
    transposer = _Transposer(captured, spec)
    gm = transposer.trace(transposer.cotangent_examples())
    transposer.name_results(gm)
    grad_index = [i for i, w in enumerate(spec.wrt) if w]
    return ReverseResult(gm, transposer.ct_index, grad_index)


def _carrying_cotangents(captured: fx.GraphModule, placeholders, out_nodes, wrt) -> set[fx.Node]:
    """The nodes a cotangent flows through: those depending on a differentiated input that the
    outputs depend on. The rest (BatchNorm's running-statistics updates, ``copy_`` into
    buffers) just run, and need no rule."""
    wrt_nodes = {p for p, w in zip(placeholders, wrt) if w and is_float(p.meta.get("val"))}
    need = differentiable_nodes(captured, wrt_nodes)
    reach = ancestors(out_nodes)
    writes = [n for n in need if meta.READ_AFTER_WRITE.on(n)]  # kept in-place writes into inputs
    while True:  # a write reaches what reads its memory later
        more = [n for n in writes if n not in reach and any(r in reach for r in meta.READ_AFTER_WRITE.get(n))]
        if not more:
            break
        reach |= ancestors(more)
    return {n for n in need if n in reach or n in wrt_nodes}


def _no_grad_values(captured: fx.GraphModule) -> tuple[set[fx.Node], set[fx.Node]]:
    """``(cut, tracked)``: how ``torch.no_grad()`` regions show in code that has none.

    ``tracked``: the floating values autograd may track when the generated code runs: its
    floating inputs, the tensors it closes over that require grad (a module's parameters), and
    what differentiable ops outside ``no_grad`` compute from them. ``cut``: the floating values an
    op inside a ``no_grad`` region computes from tracked or cut values. An op outside the region
    and an in-place write read a cut value detached, and a write inside the region a tracked one
    too (an ``out=`` call or a parameter clipped in place), so that the code's own derivative
    (``fxtools.hvp``, ``hessian``, autograd run over it, to a differentiated input or a closed-over
    parameter) sees constants there, as PyTorch does at every order."""
    tracked: set[fx.Node] = set()
    for node in captured.graph.nodes:
        if node.op == "placeholder" and is_float(node.meta.get("val")):
            tracked.add(node)
        elif reads_tracked_tensor(node, captured):
            tracked.add(node)
    cut: set[fx.Node] = set()
    for node, grad_enabled in calls_with_grad_mode(captured.graph):
        if not any(is_float(v) for v in pytree.tree_leaves(node.meta.get("val"))):
            continue
        inputs = node.all_input_nodes
        if grad_enabled:
            if not registry.is_nondifferentiable(node.target) and any(a in tracked for a in inputs):
                tracked.add(node)
        elif not is_mutating(node) and any(a in tracked or a in cut for a in inputs):
            cut.add(node)
    return cut, tracked


class _Transposer(Retracer):
    """The template ``reverse`` traces: ``(*inputs, *cotangents) -> (*outputs, *gradients)``.

    Runs the captured graph forward one node at a time (``Retracer``: one method per opcode, as
    ``torch.fx.Interpreter``), recording on a tape the rule of each node a cotangent flows
    through; then seeds the outputs' cotangents and walks the tape backward, adding each rule's
    cotangents into its arguments' (as autodidax's ``eval_jaxpr_transposed``).
    """

    verb = "differentiate"

    def __init__(self, captured: fx.GraphModule, spec: ReverseSpec):
        super().__init__(captured)
        self.spec = spec
        self.need = _carrying_cotangents(captured, self.placeholders, self.out_nodes, spec.wrt)
        self.cut, self.tracked = _no_grad_values(captured)
        self.no_grad = {n for n, grad_enabled in calls_with_grad_mode(captured.graph) if not grad_enabled}
        self.ct_index = [i for i, o in enumerate(self.out_nodes) if isinstance(o, fx.Node) and o in self.need]
        if spec.seed == "ones" and len(self.ct_index) > 1:
            raise ValueError("grad needs a function with one scalar tensor output; use vjp for more")
        self.rules = {  # found before tracing: a missing one fails first, with the user's line
            node: rule_for(node) for node in self.need if node.op == "call_function" and node.target is not operator.getitem
        }
        self.namer = Namer()
        self.dynamic = set(dynamic_nodes(captured))  # data-dependent shapes (x[mask]): see graph/data_dependent.py
        self.memo = Memo()
        self.tape: list = []  # (node, rule, aux) for each node run through its rule, in order
        self.ct: dict[fx.Node, Any] = {}  # each node's cotangent so far

    def cotangent_examples(self) -> list:
        """The values whose cotangents the template takes (none for a scalar loss seeded with ones)."""
        return [self.out_nodes[i].meta["val"] for i in self.ct_index] if self.spec.seed == "cotangent" else []

    def name_results(self, gm: fx.GraphModule) -> None:
        """Name the traced graph's arguments, constants and values after the captured graph's."""
        _name_arguments(gm, self.placeholders, self.out_nodes, self.ct_index)
        copy_constants(self.captured, gm)
        self.namer.apply(gm.graph)

    def template(self, *flat):
        """``(*inputs, *cotangents) -> (*outputs, *gradients)``: the forward, then the tape backward."""
        inputs, cts = flat[: len(self.placeholders)], flat[len(self.placeholders) :]
        self.env = dict(zip(self.placeholders, inputs))
        self.memo = Memo()  # repeated calls (identical layers) copy their first trace: see transforms/replay.py
        self.tape, self.ct = [], {}
        self.run_nodes()
        self.seed(cts)
        for node, rule, aux in reversed(self.tape):
            self.transpose(node, rule, aux)
        return (*self.outputs(), *self.gradients())

    # -- forward: ``Retracer`` binds placeholders and constants

    def call_function(self, node: fx.Node) -> None:
        """Run ``node``: through its rule's forward (pushed on the tape) if a cotangent flows through it."""
        self.current = node
        if node.target is torch._C._set_grad_enabled:
            return
        value: Callable[[fx.Node], Any] = self.env.__getitem__
        if node not in self.no_grad or is_mutating(node):
            value = self.untracked_in_place if node in self.no_grad else self.constant_for_gradients
        read: dict[int, Any] = {}  # the tensor passed -> the value it stands for

        def reading(a: fx.Node):
            passed = value(a)
            read[id(passed)] = self.env[a]
            return passed

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), reading)
        # With ``fx.traceback.preserve_node_meta()`` on (fxtools.split), the traced nodes
        # inherit the op's stack trace and markers; otherwise this is a no-op.
        with fx_traceback.set_current_meta(node), _value_owner(self.namer, node):
            if node.target is operator.getitem or node not in self.need:
                self.env[node] = self.memo.call(node.target, *args, **kwargs)
            else:
                rule = self.rules[node]
                self.env[node], aux = self.memo.call(rule.fwd, *args, **kwargs)
                self.tape.append((node, rule, aux))
        if is_mutating(node):  # it returns the tensor it wrote: later reads see the one not detached
            self.env[node] = read.get(id(self.env[node]), self.env[node])
        _name_value(self.namer, self.env[node], node)
        if node in self.dynamic:
            tie(self.env[node], node.meta["val"])

    def constant_for_gradients(self, node: fx.Node):
        """``node``'s value, detached if a ``no_grad`` region cut it off the gradient (``_no_grad_values``)."""
        return self.detached(node) if node in self.cut else self.env[node]

    def untracked_in_place(self, node: fx.Node):
        """``node``'s value as an in-place write under ``no_grad`` reads it: detached if autograd may
        track it (``out=`` refuses such arguments, a parameter refuses an in-place write)."""
        return self.detached(node) if node in self.cut or node in self.tracked else self.env[node]

    def detached(self, node: fx.Node):
        value = self.env[node]
        if not isinstance(value, torch.Tensor) or node.target is aten.detach.default:
            return value
        detached = self.memo.call(aten.detach.default, value)
        if node.op == "get_attr":  # a parameter keeps its own name: ``w_detach``
            self.namer(detached, f"{node.name}_detach")
        else:
            self.namer.hand_over(value, detached)
        return detached

    # -- backward

    def add(self, node: fx.Node, c) -> None:
        """Add cotangent ``c`` into ``node``'s (``None`` adds nothing)."""
        if c is None or node not in self.need:
            return
        if isinstance(c, torch.Tensor) and _dtype(c) != _dtype(node.meta["val"]):
            # a complex cotangent reaching a real value keeps its real part, as in autograd
            c = self.memo.call(registry.cast_cotangent, c, node.meta["val"].dtype)
        self.ct[node] = c if node not in self.ct else self.memo.call(operator.add, self.ct[node], c)

    def seed(self, cts) -> None:
        """The outputs' cotangents: the template's inputs, or ones for a scalar loss."""
        if self.spec.seed == "ones":
            for i in self.ct_index:
                self.add(self.out_nodes[i], torch.ones_like(self.env[self.out_nodes[i]]))
        else:
            for i, c in zip(self.ct_index, cts):
                self.add(self.out_nodes[i], c)

    def cotangent(self, node: fx.Node):
        """``node``'s cotangent (a tuple for a multi-output op), or None if none reached it."""
        if isinstance(node.meta.get("val"), (tuple, list)):
            items = _getitem_users(node)
            cs = tuple(self.ct.get(items[i]) if i in items else None for i in range(len(node.meta["val"])))
            if all(x is None for x in cs):
                return None
            for item in items.values():  # the parts' cotangents: ``grad_q`` of ``q, k, v = ...``
                self.namer(self.ct.get(item), f"grad_{item.name}")
            return cs
        c = self.ct.get(node)
        if c is not None:
            _name_cotangent(self.namer, c, node)
        return c

    def transpose(self, node: fx.Node, rule, aux) -> None:
        """Call ``node``'s rule backward and add the cotangents it returns into its arguments'."""
        self.current = node
        c = self.cotangent(node)
        if c is None:
            return
        with _cotangent_owner(self.namer, node):
            with fx_traceback.set_current_meta(node):
                try:
                    dargs = self.memo.call(rule.bwd, aux, c)
                except RuleRefusal as exc:
                    raise RuleRefusal(f"{exc} (at {user_line_of(node) or 'an unknown line'})") from None
            if not isinstance(dargs, (tuple, list)) or (
                len(node.args) == 1 and isinstance(node.args[0], (list, tuple)) and not isinstance(dargs, tuple)
            ):
                dargs = (dargs,)
            for a, d in zip(node.args, dargs):
                if isinstance(a, (list, tuple)):
                    for ai, di in zip(a, d if d is not None else [None] * len(a)):
                        if isinstance(ai, fx.Node):
                            self.add(ai, di)
                elif isinstance(a, fx.Node):
                    self.add(a, d)

    # -- results

    def outputs(self) -> list:
        return [self.constant_for_gradients(o) if isinstance(o, fx.Node) else o for o in self.out_nodes]

    def gradients(self) -> list:
        """One gradient per differentiated input: zeros for a floating-point one no cotangent reached."""
        grads = []
        for p, w in zip(self.placeholders, self.spec.wrt):
            if not w:
                continue
            g = self.ct.get(p)
            if g is None and is_float(self.env[p]):
                g = torch.zeros_like(self.env[p])
            if g is not None:
                _name_gradient(self.namer, g, p)
            grads.append(g)
        return grads


def _dtype(t: torch.Tensor) -> torch.dtype:
    """``t.dtype``, read without a trip through make_fx's torch-function modes (a dispatch per read)."""
    with torch._C.DisableTorchFunction():
        return t.dtype


# -- names: values after the captured nodes, cotangents ``grad_<value>``


def _value_owner(namer: Namer, node: fx.Node):
    """Nodes traced while running ``node`` forward belong to its value."""
    return namer.owner(node.name)


def _cotangent_owner(namer: Namer, node: fx.Node):
    """Nodes traced while running ``node``'s rule backward belong to its cotangent."""
    return namer.owner(f"grad_{node.name}")


def _name_value(namer: Namer, value, node: fx.Node) -> None:
    # a part of a multi-output op was traced with the op; any other value must be its rule's own
    owner = None if node.target is operator.getitem else node.name
    namer(value, node.name, weak=meta.INTERMEDIATE.on(node), owner=owner)


def _name_cotangent(namer: Namer, c, node: fx.Node) -> None:
    namer(c, f"grad_{node.name}")


def _name_gradient(namer: Namer, g, placeholder: fx.Node) -> None:
    namer(g, f"grad_{placeholder.name}")


def _name_arguments(gm: fx.GraphModule, placeholders, out_nodes, ct_index) -> None:
    """The template's arguments take the captured inputs' names and ``grad_<output>``."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, p in zip(ph, placeholders):  # arguments first: values never take their names
        node._rename(p.name)
    for node, i in zip(ph[len(placeholders) :], ct_index):
        src = out_nodes[i]
        node._rename(f"grad_{src.name}" if len(ct_index) > 1 else single_cotangent_name(src))
    for node in gm.graph.nodes:  # the conjugated arguments of holomorphic rules (complex tensors)
        if node.target is aten._conj.default and node.name.startswith("_conj"):
            node._rename(f"{node.args[0].name}_conj")


def single_cotangent_name(out: fx.Node) -> str:
    """The argument holding the cotangent of a function's one output: ``grad_out``, or ``grad_loss``
    when the user's code computes a scalar loss (its ``out`` may then be a value of its own)."""
    return "grad_loss" if isinstance(out, fx.Node) and out.name == "loss" else "grad_out"
