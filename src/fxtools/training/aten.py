"""The ATen form of a split: the graphs compilers take (Inductor, XLA-style lowerings).

``to_aten(split)`` re-traces ``Split.forward`` and ``Split.backward`` (the readable graphs) with
``make_fx`` below autograd, functionalized, through an ``fx.Interpreter`` that makes each readable
node the current node (``torch.fx.traceback.set_current_meta``, as AOTAutograd does): every ATen
node it records carries its readable node's ``stack_trace`` (the user's line), ``nn_module_stack``
when the readable node has one, ``from_node``, and ``meta['val']``. ``decompositions`` lowers
further while tracing: ``"core"`` for PyTorch's Core ATen table
(``torch._decomp.core_aten_decompositions``), ``"inductor"`` for Inductor's, or a table.

The two graphs keep the readable ones' placeholders, in order and by name, and return flat tuples
(compilers want flat outputs):

- ``forward(*inputs, *buffers) -> (*outputs, *saved, *mutated buffers)``: the tensor leaves of the
  arguments, then the module's buffers the forward reads (lifted from ``get_attr``, by attribute
  name: a functional graph cannot update them in place); it returns the tensor leaves of ``f``'s
  result, the saved values, then the new values of the buffers it updates (BatchNorm's running
  statistics), which the caller copies back, as AOTAutograd's input mutations.
- ``backward(*saved, *cotangents, *buffers) -> grads``: one gradient per tensor leaf of the
  arguments (forward placeholder order), ``None`` where there is none. ``buffers`` are the tensors
  the readable backward holds (a causal mask it slices again, a BatchNorm's running statistics in
  evaluation), lifted as the forward's are: compilers trace with FakeTensors, which a real tensor
  held by the graph would meet.

Every placeholder has ``node.meta['desc']`` and the output node ``meta['desc']`` (one per output):
a ``Descriptor`` with ``kind`` (``"user_input"``, ``"parameter"``, ``"buffer"``, ``"saved"``,
``"cotangent"``, ``"output"``, ``"gradient"``, ``"mutated_buffer"``), the readable ``name``, the
pytree ``path`` in the arguments or the result, and ``target``: a parameter's or buffer's
qualified name, the forward node a saved value holds, the output a cotangent belongs to, the input
a gradient is for. ``Descriptor.aot()`` gives the nearest AOTAutograd descriptor
(``torch._functorch._aot_autograd.descriptors``).

The only nodes that are not ``OpOverload`` calls are ``operator.getitem`` of a multi-output op's
results, as in AOTAutograd's graphs. A ``print`` or other Python call inserted into a readable
graph runs once, while tracing; the ATen form holds only the ATen ops.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError
from ..graph.nodes import fake_mode_of
from ..rules.pointwise import gelu_tanh_gate, gelu_tanh_slope
from .partition import Split

__all__ = ["Descriptor", "AtenSplit", "to_aten", "decomposition_table", "KINDS"]

KINDS = ("user_input", "parameter", "buffer", "saved", "cotangent", "output", "gradient", "mutated_buffer")


@dataclass(frozen=True)
class Descriptor:
    """What one placeholder or output of an ATen graph is (see the module docstring)."""

    kind: str
    name: str
    path: str | None = None
    target: str | None = None

    def __str__(self):
        where = f" {self.path}" if self.path else ""
        of = f" ({self.target})" if self.target else ""
        return f"{self.kind} {self.name}{where}{of}"

    def aot(self, index: int = 0):
        """The nearest AOTAutograd descriptor; ``index`` is the position in the flat calling convention.

        Saved values have none in AOTAutograd (they are plain outputs of its forward): they get
        ``PlainAOTOutput`` / ``PlainAOTInput`` at their position.
        """
        from torch._functorch._aot_autograd import descriptors as d

        if self.kind == "parameter":
            return d.ParamAOTInput(self.target or self.name)
        if self.kind == "buffer":
            return d.BufferAOTInput(self.target or self.name)
        if self.kind == "mutated_buffer":
            return d.InputMutationAOTOutput(d.BufferAOTInput(self.target or self.name))
        if self.kind == "cotangent":
            return d.TangentAOTInput(d.PlainAOTOutput(index))
        if self.kind in ("output", "saved"):
            return d.PlainAOTOutput(index)
        if self.kind == "gradient":
            return d.GradAOTOutput(d.PlainAOTInput(index))
        return d.PlainAOTInput(index)


def decomposition_table(decompositions):
    """``None``, ``"core"`` (Core ATen), ``"inductor"`` (Inductor's table) or a table, as a dict.

    ``native_batch_norm`` is always decomposed: it updates the running statistics without saying
    so in its schema, so functionalization would miss the update; its decomposition makes it
    explicit (``_native_batch_norm_legit_functional`` and new values for the buffers).
    Inductor's table writes tanh-approximated GELU and its backward with the gate the readable
    rule uses (``_inductor_gelu``).
    """
    table = dict(torch._decomp.get_decompositions([torch.ops.aten.native_batch_norm]))
    if decompositions is None:
        return table
    if decompositions == "core":
        return {**table, **torch._decomp.core_aten_decompositions()}
    if decompositions == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return _inductor_gelu({**table, **select_decomp_table()})
    if isinstance(decompositions, dict):
        return {**table, **decompositions}
    raise ValueError(f'decompositions must be None, "core", "inductor" or a dict of decompositions, got {decompositions!r}')


def _inductor_gelu(table: dict) -> dict:
    """Inductor's CPU ``tanh`` costs about four ``exp``: tanh-approximated GELU as ``x * sigmoid(..)``
    (the same function), written as the readable rule writes its slope, so a forward computing the
    value and a JVP's slope (or a backward recomputing the value) evaluates one ``exp`` for both.
    Other GELUs keep ``table``'s decompositions."""
    gelu, gelu_backward = torch.ops.aten.gelu.default, torch.ops.aten.gelu_backward.default

    def value(x, approximate="none"):
        return x * gelu_tanh_gate(x) if approximate == "tanh" else table[gelu](x, approximate=approximate)

    def backward(grad, x, approximate="none"):
        if approximate == "tanh":
            return grad * gelu_tanh_slope(x)
        return table[gelu_backward](grad, x, approximate=approximate)

    return {**table, gelu: value, gelu_backward: backward}


class _CurrentNode(fx.Interpreter):
    """Runs a readable graph with each node as the current node (its meta goes to the ATen nodes
    it becomes); ``get_attr`` of a lifted buffer reads the traced input instead."""

    def __init__(self, gm, lifted):
        super().__init__(gm)
        self.lifted = lifted

    def run_node(self, n):
        with fx_traceback.set_current_meta(n):
            return super().run_node(n)

    def get_attr(self, target, args, kwargs):
        if target in self.lifted:
            return self.lifted[target]
        return super().get_attr(target, args, kwargs)


def _retrace(gm: fx.GraphModule, vals, names, lifted_names, table, flatten) -> fx.GraphModule:
    """``gm`` traced again to functional ATen on ``vals`` (its placeholders' values, then the
    lifted buffers'), with ``names`` for the placeholders."""
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    n_args = len(vals) - len(lifted_names)

    def run(*args):
        interp = _CurrentNode(gm, dict(zip(lifted_names, args[n_args:])))
        return flatten(interp.run(*args[:n_args]))

    mode = fake_mode_of(vals, create=True)
    with fx_traceback.preserve_node_meta(), mode:
        traced = make_fx(functionalize(run, remove="mutations"), decomposition_table=table, tracing_mode="real")(*vals)
    return _renamed(traced, names)


def _renamed(traced: fx.GraphModule, names) -> fx.GraphModule:
    """A copy of ``traced`` whose placeholders are named ``names`` (other nodes yield the name)."""
    graph = fx.Graph()
    env = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for p, name in zip(placeholders, names):
        env[p] = graph.placeholder(name)
        env[p].meta = dict(p.meta)
    for n in traced.graph.nodes:
        if n.op != "placeholder":
            env[n] = graph.node_copy(n, env.__getitem__)
    return fx.GraphModule(traced, graph, class_name=traced.__class__.__name__)


def _input_mutations(gm: fx.GraphModule) -> list[tuple[int, fx.Node]]:
    """Remove the ``copy_`` of new values into inputs that functionalization leaves at the end:
    ``(input position, new value)`` for each."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = []
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in placeholders:
            found.append((placeholders.index(n.args[0]), n.args[1]))
            n.replace_all_uses_with(n.args[1])
            gm.graph.erase_node(n)
    return found


def _is_size_arithmetic(n: fx.Node) -> bool:
    """Python arithmetic on symbolic sizes (``operator.mul`` of two ``sym_size``: a flatten's
    size), which make_fx records with symbolic sizes and compilers take, as in AOTAutograd's graphs."""
    return isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)) and not isinstance(
        n.target, torch._ops.OpOverload
    )


def _check_functional(gm: fx.GraphModule, which: str) -> None:
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is operator.getitem or _is_size_arithmetic(n):
            continue
        if not isinstance(n.target, torch._ops.OpOverload):
            raise FxtoolsError(f"the ATen {which} holds {n.target} ({n.format_node()}), which is not an ATen op")
        if n.target._schema.is_mutable:
            raise FxtoolsError(f"the ATen {which} still mutates a value: {n.format_node()}")


def _set_output(gm: fx.GraphModule, values: list, descs: list) -> None:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    output.args = (tuple(values),)
    output.meta["desc"] = list(descs)


class AtenSplit:
    """The ATen forward and backward of a ``Split`` (see the module docstring).

    ``inputs`` / ``outputs`` of each graph: ``forward_inputs``, ``forward_outputs``,
    ``backward_inputs``, ``backward_outputs`` (lists of ``Descriptor``, as in ``meta['desc']``).
    ``buffers``: the tensors the forward takes after the inputs (read from the split's forward
    module at call time); ``mutated``: for each buffer the forward updates, its position in
    ``buffers``; ``backward_buffers``: the tensors the backward takes after the cotangents;
    ``n_outputs`` / ``n_saved``: how the forward's result divides.
    """

    def __init__(self, forward, backward, buffer_names, buffers, mutated, n_outputs, n_saved, backward_buffers=()):
        self.forward: fx.GraphModule = forward
        self.backward_buffers: list[torch.Tensor] = list(backward_buffers)
        self.backward: fx.GraphModule = backward
        self.buffer_names: list[str] = buffer_names
        self.buffers: list[torch.Tensor] = buffers
        self.mutated: list[int] = mutated
        self.n_outputs = n_outputs
        self.n_saved = n_saved

    @staticmethod
    def _descs(gm):
        return [n.meta["desc"] for n in gm.graph.nodes if n.op == "placeholder"]

    @property
    def forward_inputs(self) -> list[Descriptor]:
        return self._descs(self.forward)

    @property
    def backward_inputs(self) -> list[Descriptor]:
        return self._descs(self.backward)

    @property
    def forward_outputs(self) -> list[Descriptor]:
        return next(n for n in self.forward.graph.nodes if n.op == "output").meta["desc"]

    @property
    def backward_outputs(self) -> list[Descriptor]:
        return next(n for n in self.backward.graph.nodes if n.op == "output").meta["desc"]

    def donated(self) -> list[int]:
        """Positions of the saved values (the backward's first inputs) whose memory nothing else
        shares: not an input, output or updated buffer of the forward, nor another saved value,
        nor a gradient the backward returns. Once the backward starts it holds the only reference
        (``training/saved.py`` lets go of the rest), so a compiler may reuse that memory after the
        value's last use, as Inductor does with AOTAutograd's donated buffers (``bw_donated_idxs``)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        def storage(v):
            ok = isinstance(v, torch.Tensor) and v.layout == torch.strided
            return StorageWeakRef(v.untyped_storage()) if ok else None

        fw_vals = [n.meta.get("val") for n in self.forward.graph.find_nodes(op="placeholder")]
        fw_vals += [getattr(o, "meta", {}).get("val") for o in _output_values(self.forward)]
        saved = fw_vals[len(fw_vals) - len(_output_values(self.forward)) :][self.n_outputs : self.n_outputs + self.n_saved]
        count: dict = {}
        for v in fw_vals:
            count[storage(v)] = count.get(storage(v), 0) + 1
        bw_in = [n.meta.get("val") for n in self.backward.graph.find_nodes(op="placeholder")]
        bw_out = {storage(getattr(o, "meta", {}).get("val")) for o in _output_values(self.backward)}
        return [
            i
            for i, v in enumerate(saved)
            if storage(v) is not None and count[storage(v)] == 1 and storage(bw_in[i]) not in bw_out
        ]

    def __repr__(self):
        fw = sum(n.op == "call_function" for n in self.forward.graph.nodes)
        bw = sum(n.op == "call_function" for n in self.backward.graph.nodes)
        return f"AtenSplit(forward: {fw} ops, backward: {bw} ops, {len(self.buffers)} buffers, {len(self.mutated)} updated)"


def _output_values(gm: fx.GraphModule) -> list:
    return list(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])


def _input_descs(sp: Split) -> list[Descriptor]:
    descs = []
    kinds = getattr(sp.captured.f, "__fxtools_input_kinds__", None)  # a Dynamo graph's: parameters by position
    for info, path in zip(sp.signature, sp.leaf_paths):
        if kinds is not None and len(path) == 1 and kinds[path[0].idx][0] == "parameter":
            descs.append(Descriptor("parameter", info.name, info.path, kinds[path[0].idx][1]))
        elif sp.from_module and path and path[0].idx == 0 and len(path) == 2 and isinstance(path[1], pytree.MappingKey):
            descs.append(Descriptor("parameter", info.name, info.path, str(path[1].key)))
        else:
            descs.append(Descriptor("user_input", info.name, info.path))
    return descs


def to_aten(sp: Split, decompositions=None) -> AtenSplit:
    """The ATen forward and backward of ``sp`` (see the module docstring), made once per table."""
    key = decompositions if isinstance(decompositions, (str, type(None))) else id(decompositions)
    if key not in sp.aten:
        sp.aten[key] = _to_aten(sp, decomposition_table(decompositions))
    return sp.aten[key]


def _to_aten(sp: Split, table) -> AtenSplit:
    module = getattr(sp.captured.f, "__fxtools_module__", None)
    fqn = {id(b): name for name, b in module.named_buffers()} if module is not None else {}
    in_descs = _input_descs(sp)
    forward, lifted, buffers, mutated = _aten_forward(sp, table, fqn, in_descs)
    backward, bw_buffers = _aten_backward(sp, table, fqn, in_descs)
    return AtenSplit(forward, backward, lifted, buffers, mutated, len(sp.out_tensor_paths), len(sp.saved), bw_buffers)


def _lifted(gm: fx.GraphModule, fqn: dict):
    """The tensors ``gm`` holds (``_tensor_attributes``): targets, tensors, placeholder names,
    FakeTensors of its placeholders' mode, and buffer descriptors (qualified names where known)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    targets = _tensor_attributes(gm)
    tensors = [getattr(gm, t) for t in targets]
    names = [_buffer_name(t, placeholders) for t in targets]
    mode = fake_mode_of([p.meta.get("val") for p in placeholders], create=True)
    fakes = [mode.from_tensor(b, static_shapes=True) for b in tensors]
    descs = [Descriptor("buffer", n, None, fqn.get(id(b), t)) for n, b, t in zip(names, tensors, targets)]
    return targets, tensors, names, fakes, descs


def _aten_forward(sp: Split, table, fqn: dict, in_descs: list):
    """The ATen forward, the targets and tensors of the buffers it takes, and which it updates."""
    fw = sp.forward
    fw_ph = [n for n in fw.graph.nodes if n.op == "placeholder"]
    lifted, buffers, buffer_names, fake_buffers, buffer_descs = _lifted(fw, fqn)
    out_is_tensor = sp.out_is_tensor

    def flatten_forward(result):
        out, saved = result
        return [o for o, t in zip(pytree.tree_leaves(out), out_is_tensor) if t] + list(saved)

    fw_names = [p.name for p in fw_ph] + buffer_names
    forward = _retrace(fw, [p.meta["val"] for p in fw_ph] + fake_buffers, fw_names, lifted, table, flatten_forward)
    mutations = _input_mutations(forward)
    n_in = len(fw_ph)
    if any(i < n_in for i, _ in mutations):
        names = ", ".join(fw_names[i] for i, _ in mutations if i < n_in)
        raise FxtoolsError(f"the forward updates its input(s) {names} in place, which the ATen form cannot express")
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    out_paths = sp.out_tensor_paths
    fw_descs = [Descriptor("output", getattr(o, "name", "None"), p) for o, p in zip(outs[: len(out_paths)], out_paths)]
    fw_descs += [Descriptor("saved", s.name, None, s.name) for s in sp.saved]
    fw_descs += [Descriptor("mutated_buffer", fw_names[i], None, buffer_descs[i - n_in].target) for i, _ in mutations]
    _set_output(forward, outs + [v for _, v in mutations], fw_descs)
    for p, desc in zip((n for n in forward.graph.nodes if n.op == "placeholder"), [*in_descs, *buffer_descs]):
        p.meta["desc"] = desc
    _finish(forward, "forward")
    return forward, lifted, buffers, [i - n_in for i, _ in mutations]


def _aten_backward(sp: Split, table, fqn: dict, in_descs: list):
    """The ATen backward and the tensors it takes after the cotangents."""
    bw = sp.backward
    bw_ph = [n for n in bw.graph.nodes if n.op == "placeholder"]
    lifted, buffers, buffer_names, fake_buffers, buffer_descs = _lifted(bw, fqn)
    names = [p.name for p in bw_ph] + buffer_names
    backward = _retrace(bw, [p.meta["val"] for p in bw_ph] + fake_buffers, names, lifted, table, sp.flat_grads)
    bw_in = [Descriptor("saved", s.name, None, s.name) for s in sp.saved]
    bw_in += [Descriptor("cotangent", c.name, c.path, c.path) for c in sp.cotangents]
    for p, desc in zip((n for n in backward.graph.nodes if n.op == "placeholder"), bw_in + buffer_descs):
        p.meta["desc"] = desc
    output = next(n for n in reversed(backward.graph.nodes) if n.op == "output")
    grads = list(output.args[0])
    descs = [Descriptor("gradient", getattr(g, "name", "None"), d.path, d.name) for g, d in zip(grads, in_descs)]
    _set_output(backward, grads, descs)
    _finish(backward, "backward")
    return backward, buffers


def _tensor_attributes(gm: fx.GraphModule) -> list[str]:
    """The targets of ``gm``'s ``get_attr`` nodes that hold tensors (buffers, constants), once each.

    The ATen graphs take them as inputs: a compiler traces its graph with FakeTensors, and a real
    tensor held by the graph would meet them in the first op that reads it."""
    targets = [n.target for n in gm.graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor)]
    return list(dict.fromkeys(targets))


def _buffer_name(target: str, placeholders) -> str:
    taken = {p.name for p in placeholders}
    name, i = target.replace(".", "_"), 1
    while name in taken:
        name, i = f"{target.replace('.', '_')}_{i}", i + 1
    return name


def _out_of_place_views(gm: fx.GraphModule) -> None:
    """Replace in-place view ops (``squeeze_``, ``unsqueeze_``, ``t_``, ...) that decompositions emit
    on intermediates (``matmul`` of a vector is ``mm(x.unsqueeze(0), w).squeeze_(0)``) by their
    view form, where nothing reads the intermediate after it: the same value without a mutation."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or torch.Tag.inplace_view not in op.tags:
            continue
        base = n.args[0]
        view = getattr(getattr(torch.ops.aten, op.overloadpacket.__name__.rstrip("_"), None), op._overloadname, None)
        if view is None or base.op == "placeholder" or any(order[u] > order[n] for u in base.users if u is not n):
            continue
        n.target = view


def _out_of_place_writes(gm: fx.GraphModule) -> None:
    """Replace in-place arithmetic that a composite op's own kernel does on a temporary it made
    (``rms_norm``: ``rsqrt(x.pow(2).mean(-1, True).add_(eps))``), which functionalization does
    not see when the op is decomposed below it, by its out-of-place form: where the temporary is
    no view (no other value shares its memory), nothing reads it after the write, and the
    out-of-place op gives the same dtype and shape."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable:
            continue
        name = op.overloadpacket.__name__
        pure = getattr(getattr(torch.ops.aten, name[:-1], None), op._overloadname, None) if name.endswith("_") else None
        base = n.args[0] if n.args else None
        if pure is None or pure._schema.is_mutable or not isinstance(base, fx.Node) or base.op != "call_function":
            continue
        made = base.target
        if not isinstance(made, torch._ops.OpOverload) or made._schema.is_mutable or _aliases(made):
            continue
        if any(order[u] > order[n] for u in base.users if u is not n):
            continue
        want = n.meta.get("val")
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
        mode = fake_mode_of(pytree.tree_leaves((args, kwargs)))
        if mode is None or not isinstance(want, torch.Tensor):
            continue
        with mode:
            got = pure(*args, **kwargs)
        if isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape:
            n.target = pure


def _aliases(op: torch._ops.OpOverload) -> bool:
    """Whether ``op``'s results may share memory with its arguments (a view)."""
    return any(r.alias_info is not None for r in op._schema.returns)


def _finish(gm: fx.GraphModule, which: str) -> None:
    gm.graph.eliminate_dead_code()
    _out_of_place_views(gm)
    _out_of_place_writes(gm)
    _check_functional(gm, which)
    gm.graph.lint()
    gm.recompile()
