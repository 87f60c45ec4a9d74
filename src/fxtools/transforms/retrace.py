"""The re-trace engine every transform that rewrites a captured graph shares.

A transform re-runs the captured graph node by node on FakeTensors under ``make_fx``, calling
its own rules instead of the ops (reverse mode's tape, Taylor mode's series, control flow's
subgraphs); what the rules call is what the new graph contains. This module holds what those
re-traces have in common:

- ``Retracer``: the template interpreter, one method per opcode in the manner of
  ``torch.fx.Interpreter``; a transform subclasses it and writes ``call_function`` and ``template``.
- ``example_mode`` / ``fake_example`` / ``retrace``: the fake examples a re-trace runs on.
- ``Namer``: names the traced nodes after the captured values (``scores``, ``grad_scores``).
- ``NodeNamer``: keeps a generated module's names when it is traced again below ``vmap``.
- ``copy_constants``: the re-traced graph's constants keep the captured module's attribute names.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from typing import Any, cast

import torch
import torch.fx as fx
from torch._dispatch.python import no_python_dispatcher
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import in_kernel_invocation_manager
from torch.fx.experimental import proxy_tensor

from ..capture.names import name_rule_steps, recording_rule_lines
from ..capture.trace import data_dependent_error, is_data_dependent, trace_flat
from ..graph.data_dependent import cotangent_example, is_dynamic, symbolic_mode
from ..graph.fakes import wrapper
from ..signature.naming import short_op

__all__ = ["Retracer", "Namer", "NodeNamer", "example_mode", "fake_example", "retrace", "copy_constants"]


class Retracer:
    """A template that re-runs ``captured``'s graph one node at a time while ``make_fx`` traces it.

    ``run_nodes`` calls the method named after each node's opcode (``placeholder``,
    ``get_attr``, ``call_function``, ``output``), as ``torch.fx.Interpreter`` does, with the
    traced values in ``env``; a subclass writes ``call_function`` (what the transform does with
    an op) and ``template`` (the traced function: bind the inputs, ``run_nodes``, return the
    results). ``trace`` traces ``template`` on fake examples like the captured inputs.
    """

    verb = "transform"  # in the message for a graph with an opcode the transform does not handle
    pre_dispatch = True  # False: traced below torch.func transforms (rules that call them)

    def __init__(self, captured: fx.GraphModule):
        self.captured = captured
        self.placeholders = [n for n in captured.graph.nodes if n.op == "placeholder"]
        self.out_nodes = list(next(n for n in captured.graph.nodes if n.op == "output").args[0])
        self.env: dict[fx.Node, Any] = {}  # each captured node's traced value
        self.current: fx.Node | None = None  # the node being run, for error messages

    def template(self, *flat):
        raise NotImplementedError

    def run_nodes(self) -> None:
        """Run the captured nodes in order. Its ``torch._C._set_grad_enabled`` nodes switch grad
        mode as they did when the program ran, unrecorded (the transform writes what a ``no_grad``
        region means itself), so that the ops in the region see what they saw in eager (an
        ``out=`` call, a parameter written in place); the mode is restored after the last node."""
        enabled = torch.is_grad_enabled()
        try:
            for node in self.captured.graph.nodes:
                if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
                    _set_grad_enabled_unrecorded(bool(node.args[0]))
                getattr(self, node.op, self.unsupported)(node)
        finally:
            _set_grad_enabled_unrecorded(enabled)

    def placeholder(self, node: fx.Node) -> None:
        pass  # bound to the template's inputs

    def output(self, node: fx.Node) -> None:
        pass  # read by the template's results

    def get_attr(self, node: fx.Node) -> None:
        self.env[node] = getattr(self.captured, str(node.target))

    def call_function(self, node: fx.Node) -> None:
        raise NotImplementedError

    def unsupported(self, node: fx.Node) -> None:
        raise NotImplementedError(f"fxtools cannot {self.verb} a graph with {node.op} nodes")

    def trace(self, extra_vals=()) -> fx.GraphModule:
        """``template`` traced on FakeTensors like the captured inputs (with their strides), then
        ``extra_vals`` (contiguous); a data-dependent failure names the node being run."""
        vals = [p.meta["val"] for p in self.placeholders]
        mode = example_mode(vals + list(extra_vals))
        examples = [fake_example(v, mode, keep_strides=True) for v in vals]
        examples += [fake_example(v, mode) for v in extra_vals]
        try:
            return trace_flat(self.template, examples, record_stack_traces=False, pre_dispatch=self.pre_dispatch)
        except Exception as exc:
            if is_data_dependent(exc):
                raise data_dependent_error(exc, self.current) from exc
            raise


def _set_grad_enabled_unrecorded(mode: bool) -> None:
    with torch._C.DisableTorchFunction():  # make_fx's pre-dispatch mode records the call otherwise
        torch._C._set_grad_enabled(mode)


def example_mode(vals):
    """The fake mode to re-trace in: the capture's when a value has a data-dependent or a
    symbolic size (its symbols live there), else a fresh one, as ``make_fx`` would make for real
    examples."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for val in vals:
        if isinstance(val, torch.Tensor) and is_dynamic(val):
            return cast(FakeTensor, val).fake_mode  # a symbolic size lives on a FakeTensor
    symbolic = symbolic_mode(vals)  # sizes marked dynamic: their symbols live in the capture's mode
    if symbolic is not None:
        return symbolic
    return FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)


def fake_example(val, mode, keep_strides=False):
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
    if mode.static_shapes and all(type(s) is int for s in (*val.shape, *val.stride())):
        stride = val.stride() if keep_strides else make_contiguous_strides_for(val.shape)
        return _static_example(mode, tuple(val.shape), tuple(stride), val.dtype, val.device)
    with mode:
        if keep_strides:
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        return torch.empty(val.shape, dtype=val.dtype, device=val.device)


def _static_example(mode, shape, stride, dtype, device):
    """``torch.empty_strided`` under ``mode``, made as FakeTensorMode makes its own (a meta tensor
    wrapped, without a trip through the modes), and known to ``mode`` as itself: ``make_fx``
    converts its inputs with ``mode.from_tensor``, which would otherwise copy every example's
    metadata into a new FakeTensor (a tenth of ``fxtools.split``'s time on a GPT's 150 parameters)."""
    with no_python_dispatcher(), in_kernel_invocation_manager(mode):
        meta = torch.ops.aten.empty_strided.default(shape, stride, dtype=dtype, device="meta")
    fake = wrapper(mode, device).wrap(meta)
    mode.fake_tensor_converter.set_tensor_memo(fake, fake)
    return fake


def retrace(fn, vals) -> fx.GraphModule:
    """``fn`` traced on contiguous FakeTensors like ``vals`` (a function fxtools writes)."""
    mode = example_mode(vals)
    return trace_flat(fn, [fake_example(v, mode) for v in vals], record_stack_traces=False)


def copy_constants(src: fx.GraphModule, dst: fx.GraphModule) -> None:
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


class Namer:
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

    def hand_over(self, tensor, to) -> None:
        """``to`` (a copy standing in for ``tensor``, as a detached value) takes ``tensor``'s name."""
        mode = proxy_tensor.get_innermost_proxy_mode()
        if mode is None:
            return
        try:
            node = proxy_tensor.get_proxy_slot(tensor, mode.tracer).proxy.node
        except Exception:  # noqa: BLE001 - not a traced tensor: nothing to hand over
            return
        name = self.names.pop(node, None)
        self.weak.discard(node)
        if name is not None:
            self(to, name)

    def apply(self, graph: fx.Graph) -> None:
        for node, name in self.names.items():
            node._rename(name)
        name_rule_steps(graph, set(self.names), self.owners)


class NodeNamer(fx.Interpreter):
    """Runs a generated GraphModule op by op, noting which traced node computed each of its values.

    Batching traces below vmap, where names would otherwise come from ATen ops (``mul_4``); the
    batched code of a generated module keeps its names (``grad_linear``) instead: each of its
    values names the last node traced while computing it.
    """

    def __init__(self, gm, guards=None):
        super().__init__(gm)
        self.names: dict[fx.Node, str] = {}
        self.traces: dict[fx.Node, str] = {}  # the user line of the generated node, where it kept one
        self.current: fx.Node | None = None  # the node being run, for error messages
        self.guards = guards  # of the module batched: each example must be what it was made for
        self.__signature__ = inspect.signature(gm.forward)  # argument names for the batched code

    def __call__(self, *args):
        if self.guards is not None:
            self.guards.check(args, layout=False)  # vmappable's code reshapes rather than views
        return self.run(*args)

    def run_node(self, n):
        mode = proxy_tensor.get_innermost_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        last = graph._root.prev if graph is not None else None
        self.current = n
        out = super().run_node(n)
        if graph is not None and n.op in ("call_function", "call_method") and graph._root.prev is not last:
            self.names[graph._root.prev] = n.name
            made = last.next
            while made is not graph._root.prev:  # the batched op's helpers: after it and their op
                self.names.setdefault(made, f"{n.name}_{short_op(made)}")
                made = made.next
            trace = n.meta.get("stack_trace")
            if trace:
                made = last.next
                while made is not graph._root:
                    self.traces.setdefault(made, trace)
                    made = made.next
        return out

    def apply(self, gm: fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            trace = self.traces.get(node)
            if trace and not node.meta.get("stack_trace"):
                node.meta["stack_trace"] = trace  # for an error of the next transform to name the line
            name = self.names.get(node)
            if name is not None and node.op == "call_function" and node.target is not operator.getitem:
                node._rename(name)
