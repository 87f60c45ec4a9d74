"""``fxtools.split``: a forward graph and a backward graph with a stable, documented signature.

``split(f, *args, policy=...)`` differentiates ``f`` at the example ``args`` (one joint graph from
``reverse``) and cuts the joint graph in two:

- ``Split.forward`` takes one placeholder per **tensor leaf** of ``args``, in the order of
  ``torch.utils._pytree.tree_flatten(args)`` (dicts in key-insertion order, lists and tuples in
  order), each named after its argument name and pytree path (``carry['a']`` -> ``a``,
  ``params['fc1.weight']`` -> ``fc1_weight``). Non-tensor leaves (ints, floats, flags) are
  specialised, as everywhere in fxtools. It returns ``(out, saved)``: ``out`` with the structure
  of ``f``'s result, ``saved`` a tuple of tensors, each named after the forward value it holds.
- ``Split.backward`` takes ``(*saved, *cotangents)``: the saved tensors, then one cotangent per
  floating-point tensor leaf of the output (in flattening order, see ``Split.cotangents``), and
  returns the gradients with the structure ``fxtools.vjp`` gives them: one entry per positional
  argument, with that argument's pytree structure, ``None`` at leaves that are not
  floating-point tensors.
- ``Split.backward_boxed`` is the same graph called as ``backward_boxed([*saved, *cotangents])``:
  it empties the list on entry, so each saved tensor is freed right after its last use.

A program writing a value computed from a differentiated input into one of its tensor
arguments in place (``y[:, 1:].mul_(w[1:])``) is split as AOTAutograd splits it
(``training/written.py``): the new value is computed out of place, the forward writes no such
argument and returns ``((out, written), saved)``, ``written`` the tuple of the new values in
argument order (``Split.written`` describes them), and the backward takes their cotangents after
``out``'s. ``fxtools.compile`` writes them into the arguments with autograd recording.

``Split.signature``, ``Split.saved`` and ``Split.cotangents`` list every input, saved value and
cotangent with its name, shape, dtype, bytes and the user line that produced it;
``Split.report()`` prints what is saved and how many bytes. Outputs that alias inputs or each
other (``return x * w, w``) and inputs passed twice are handled inside the graphs: the backward
alone computes the whole vector-Jacobian product.

Each of the three graphs checks its arguments when called (``fxtools.signature.guards``: shapes, dtypes,
device types, layouts where the code relies on them; cotangents as the outputs they belong to);
``Split.guards`` describes the original arguments, Python values included, and ``Split.flatten``
/ ``Split.vjp`` (and ``fxtools.compile``, which picks its splits with them) check those.

For an ``nn.Module``, ``split(model, *inputs)`` splits ``fxtools.functional(model)`` at
``(dict(model.named_parameters()), *inputs)``: parameters come first, by name.

The policy decides what is saved and what the backward recomputes (see ``fxtools.policies``).
Regions of ``torch.utils.checkpoint`` in user code are recomputed in the backward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from .. import registry
from ..capture.checkpoint import checkpoint_regions
from ..capture.functionalize import InplaceError
from ..capture.trace import Captured
from ..codegen.assemble import returnable
from ..codegen.inplace import in_place_body
from ..errors import FxtoolsError, user_line_of
from ..functional import functional
from ..graph import meta
from ..graph.nodes import ancestors, fake_mode_of, node_copy, written_args
from ..passes.accumulate import accumulate_into_scatters
from ..passes.simplify import simplify
from ..signature import closures, sizes
from ..signature.guards import GuardedGraphModule, Guards, Node, build, guard_sharing, stride_sensitive_paths
from ..signature.naming import part_name
from ..transforms.pipeline import Transform, differentiated, emit, front, uses_pipeline
from ..transforms.reverse import ReverseSpec, reverse
from ..transforms.vjp import grads_structure
from . import policies
from .cuts import INF, backward_nodes, forward_nodes, max_flow_min_cut, nbytes, storage_root
from .distributed import communicated_bytes
from .finite import checked_split
from .written import WrittenInputs, differentiable_writes, written_by

# --------------------------------------------------------------------------------------------
# Descriptions of inputs, saved values and cotangents
# --------------------------------------------------------------------------------------------


@dataclass
class TensorInfo:
    """One input, saved value or cotangent of a split."""

    name: str  # the placeholder's name in the graph that takes it
    shape: tuple
    dtype: torch.dtype
    bytes: int
    kind: str  # "input", "cotangent", or for saved values "input" / "activation" / "output"
    path: str | None = None  # pytree path in the arguments or the output (inputs, cotangents)
    line: str | None = None  # "file:line: code" of the user call that produced it (saved values)
    storage: str | None = None  # saved values: the saved value or input whose memory it is
    note: str | None = None  # saved values: what it holds when not obvious (a scan's value at every step)
    offload: bool = False  # saved values: the policy asked to keep it in CPU memory until the backward

    def __str__(self):
        dt = str(self.dtype).replace("torch.", "")
        where = f"  {self.path}" if self.path else ""
        line = f"  <- {self.line}" if self.line else ""
        off = ", offload" if self.offload else ""
        return f"{self.name}: {dt}{list(self.shape)} ({self.bytes} B, {self.kind}{off}){where}{line}"


def _info(node: fx.Node, kind: str, path=None, line=None, storage=None) -> TensorInfo:
    val = node.meta.get("val")
    return TensorInfo(node.name, tuple(val.shape), val.dtype, nbytes(val), kind, path, line, storage)


# --------------------------------------------------------------------------------------------
# Deciding what to save
# --------------------------------------------------------------------------------------------


class _Partition:
    """Which joint-graph values the forward saves and which the backward recomputes."""

    def __init__(self, joint: fx.GraphModule, n_in: int, n_out: int, policy):
        self.nodes = list(joint.graph.nodes)
        ph = [n for n in self.nodes if n.op == "placeholder"]
        self.primals, self.cts = ph[:n_in], ph[n_in:]
        output = self.nodes[-1]
        outs = list(output.args[0])
        self.fw_outs, self.grads = outs[:n_out], outs[n_out:]
        bw = set(self.cts)
        for n in self.nodes:
            if n.op == "call_function" and any(a in bw for a in n.all_input_nodes):
                bw.add(n)
        self.bw = bw
        # Forward values the rules' backwards compute (``cos(x)`` for ``sin``) come after the first
        # cotangent use in the trace; autograd computes those in the backward too.
        in_backward = False
        for n in self.nodes:
            in_backward = in_backward or (n in bw and n.op == "call_function")
            if n.op == "call_function":
                meta.PHASE.set(n, "backward" if in_backward else "forward")
        needed, seen = [], set()

        def need(v):
            if isinstance(v, fx.Node) and v not in bw and v not in seen:
                seen.add(v)
                needed.append(v)

        for n in self.nodes:
            if n in bw and n.op == "call_function":
                for a in n.all_input_nodes:
                    need(a)
        for g in self.grads:
            need(g)
        self.needed = needed
        self.region_outputs = self._region_outputs()
        self.read_before_write = _read_before_written(self.nodes, bw)
        self.offload: set = set()
        self.forget: dict = {}  # recomputed values the backward recomputes again (``budget.refresh``)
        self.choice = None  # what a budget chose (``budget.Choice``)
        self.fused = isinstance(policy, policies.Budget) and policy.fused  # planned for a fusing compiler
        fn, min_cut = policies.resolve(policy)
        if isinstance(policy, policies.Budget):
            self.saved, self.recomputed = self._by_budget(policy)
        elif min_cut:
            self.saved, self.recomputed = self._min_cut()
        else:
            self.saved, self.recomputed = self._by_rule(fn)
        order = {n: i for i, n in enumerate(self.nodes)}
        self.saved = sorted(self.saved, key=order.__getitem__)

    # -- constraints shared by every policy --------------------------------------------------

    def _region_outputs(self) -> set:
        """Values of a checkpoint region used outside it: the region's boundary."""
        outs = set()
        fw_outs = {o for o in self.fw_outs if isinstance(o, fx.Node)}
        for n in self.nodes:
            r = policies.checkpoint_region(n) if n.op == "call_function" else None
            if r is None or n in self.bw:
                continue
            if n in fw_outs or any(
                u.op == "call_function"
                and meta.PHASE.get(u) == "forward"
                and u not in self.bw
                and policies.checkpoint_region(u) != r
                for u in n.users
            ):
                outs.add(n)
        return outs

    def _forced(self, node: fx.Node):
        """'save' / 'recompute' when the choice is not the policy's to make, else None."""
        if node.op == "placeholder":
            return policies.SAVE
        if node.op == "get_attr":
            return policies.RECOMPUTE
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            return self._forced(node.args[0])
        if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)) and policies.can_recompute(node):
            return policies.RECOMPUTE  # a size (``x.size(0)``): read again from a saved tensor
        if not policies.can_recompute(node) or node in self.read_before_write:
            return policies.SAVE
        if policies.checkpoint_region(node) is not None and node not in self.region_outputs:
            return policies.RECOMPUTE
        return None

    def _by_rule(self, fn):
        saved, recomputed = set(), set()
        stack, visited = list(self.needed), set()
        cache = {}

        def choice(node):
            """The policy's answer; an item of a tuple of results (``native_layer_norm``) gets its op's."""
            if node not in cache:
                forced = self._forced(node)
                if forced is not None:
                    cache[node] = forced
                elif node.target is operator.getitem and isinstance(node.args[0], fx.Node):
                    cache[node] = choice(node.args[0])
                else:
                    c = fn(node)
                    if c not in (policies.SAVE, policies.RECOMPUTE, policies.OFFLOAD):
                        raise ValueError(f"a split policy must return 'save' or 'recompute' (or 'offload'), got {c!r} for {node}")
                    cache[node] = c
            return cache[node]

        while stack:
            v = stack.pop()
            if v in visited:
                continue
            visited.add(v)
            c = choice(v)
            if not isinstance(v.meta.get("val"), torch.Tensor) and v.op != "placeholder":
                c = policies.RECOMPUTE  # a tuple of results is reached only through an item recomputed
            if c in (policies.SAVE, policies.OFFLOAD):
                saved.add(v)
                if c == policies.OFFLOAD and v.op != "placeholder":
                    self.offload.add(v)
            else:
                recomputed.add(v)
                stack.extend(a for a in v.all_input_nodes if a not in self.bw)
        return saved, recomputed

    def _by_budget(self, spec):
        """The least estimated recompute within a byte or peak budget (``fxtools.training.budget``)."""
        from . import budget

        problem = budget.problem_of(self, fused=spec.fused)
        points = problem.frontier()
        save_all_saved, _ = self._by_rule(policies.save_all)
        save_all_bytes = problem.saved_bytes(save_all_saved)
        if spec.peak is not None:
            lowered = problem.peak_candidates()
            candidates, peaks = [p for p, _ in lowered], [pk for _, pk in lowered]
            point, lower, limit = budget.choose_peak(candidates, peaks, spec.peak), None, None
        else:
            limit = budget.limit_bytes(spec.limit, save_all_bytes)
            hull = problem.hull() if problem.method == "hull" else None
            _, lower = budget.choose_bytes(points, hull, limit, save_all_bytes)
            point, _ = problem.byte_choice(limit)
        self.choice = budget.Choice(limit, spec.peak, point, lower, save_all_bytes, points, problem.method)
        self.forget = dict(point.forget)
        return set(point.saved), set(point.recomputed)

    def _min_cut(self):
        # candidates: forward-side ancestors of what the backward needs
        reach = ancestors(self.needed, lambda v: v not in self.bw and v.op != "get_attr")
        cand = [n for n in self.nodes if n in reach]
        index = {n: i for i, n in enumerate(cand)}
        source, sink = 2 * len(cand), 2 * len(cand) + 1
        edges = []
        for n, i in index.items():
            forced = self._forced(n)
            val = n.meta.get("val")
            tensor = isinstance(val, torch.Tensor)
            if (
                forced is None
                and n.target is not operator.getitem
                and not policies.is_cheap(n)
                and meta.PHASE.get(n) != "backward"
            ):
                forced = policies.SAVE
            if n.op == "placeholder":
                weight = 0
            elif forced == policies.RECOMPUTE or not tensor:
                weight = INF
            else:
                weight = max(nbytes(val), 1)
            edges.append((2 * i, 2 * i + 1, weight))
            if forced == policies.SAVE and n.target is not operator.getitem:
                edges.append((source, 2 * i, INF))
            for a in n.all_input_nodes:
                if a in index:
                    edges.append((2 * index[a] + 1, 2 * i, INF))
        for n in self.needed:
            if n in index:
                edges.append((2 * index[n] + 1, sink, INF))
        reach = max_flow_min_cut(2 * len(cand) + 2, edges, source, sink)
        saved = {n for n, i in index.items() if 2 * i not in reach and 2 * i + 1 in reach}
        recomputed = {n for n, i in index.items() if 2 * i in reach}
        recomputed |= {a for n in recomputed for a in n.all_input_nodes if a.op == "get_attr"}
        recomputed |= {n for n in self.needed if n.op == "get_attr"}
        return saved, recomputed


def _storage(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass)
        return None


def _read_before_written(nodes: list, bw: set) -> set:
    """Forward nodes that read memory a later forward node writes in place (an input, or a buffer,
    updated after the program read it: ``y = x * n`` then ``n.add_(1)``). Recomputed in the
    backward they would read the written value, where the forward read the one before: they are
    saved (eager refuses their backward, a tensor it saved having been modified; fxtools gives
    the derivative of what the forward computed)."""
    last_write: dict = {}
    for i, n in enumerate(nodes):
        if n.op == "call_function" and n not in bw and isinstance(n.target, torch._ops.OpOverload):
            for w in written_args(n.target, n.args, n.kwargs):
                s = _storage(w)
                if s is not None:
                    last_write[s] = i
    if not last_write:
        return set()
    return {
        n
        for i, n in enumerate(nodes)
        if n.op == "call_function" and n not in bw and any(last_write.get(_storage(a), -1) > i for a in n.all_input_nodes)
    }


# --------------------------------------------------------------------------------------------
# Building the two graphs
# --------------------------------------------------------------------------------------------


def _name_items(gm: fx.GraphModule) -> None:
    """``getitem_7 = native_layer_norm_1[2]`` becomes ``native_layer_norm_1_rstd``; ``split[0]``, ``split_0``."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem or not node.name.startswith("getitem"):
            continue
        parent, i = node.args
        if not isinstance(parent, fx.Node) or parent.op != "call_function" or not isinstance(i, int):
            continue
        node._rename(f"{parent.name}_{part_name(parent.target, i)}")


class _BoxedCodeGen(fx.graph.CodeGen):
    """``def forward(self, args)``: unpack the list, empty it, then run (each value is dropped after
    its last use; scatters into fresh tensors in place, ``codegen/inplace.py``)."""

    def _gen_python_code(self, nodes, root_module, namespace, **kwargs):
        node_list = list(nodes)
        self._body_transformer = lambda body: in_place_body(body, node_list)
        try:
            return super()._gen_python_code(node_list, root_module, namespace, **kwargs)
        finally:
            self._body_transformer = None

    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def=False):
        names = [v.split(":")[0].strip() for v in free_vars]
        names = [n for n in names if n != "self"]
        unpack = f"\n    {', '.join(names)}{',' if len(names) == 1 else ''} = args" if names else ""
        return f"def {self._func_name}(self, args){maybe_return_annotation}:{unpack}\n    args.clear()"


def _copy_meta(new: fx.Node, old: fx.Node) -> fx.Node:
    new.meta = dict(old.meta)
    return new


def _layouts(forward, backward, part, signature) -> tuple[set, set]:
    """The argument paths whose strides the forward relies on, and the saved values' and
    cotangents' names whose strides the backward relies on (``stride_sensitive_paths``): read once,
    for the graphs' guards and the original arguments'."""
    fw = stride_sensitive_paths(forward, [i.path or i.name for i in signature])
    return fw, stride_sensitive_paths(backward, [s.name for s in part.saved] + [c.name for c in part.cts])


def _install_guards(forward, backward, backward_boxed, part, signature, cotangents, cap=None, layouts=None) -> None:
    """Guards (``fxtools.signature.guards``) of the three graphs: inputs by their paths in the arguments,
    saved values by name (any layout: they come from the forward), cotangents as the outputs.
    ``layouts``: ``_layouts`` of these graphs, if already read."""
    leaves = [p.meta["val"] for p in part.primals]
    saved_vals, ct_vals = [s.meta["val"] for s in part.saved], [c.meta["val"] for c in part.cts]
    names = [i.path or i.name for i in signature]
    symbolic = cap.symbolic if cap is not None else None
    fw_layout, bw_layout = _layouts(forward, backward, part, signature) if layouts is None else layouts
    forward.guards = build("fxtools.split forward", names, sizes.concrete(symbolic, leaves), layout=fw_layout)
    guard_sharing(forward, leaves)
    saved = build("fxtools.split backward", [s.name for s in part.saved], sizes.concrete(symbolic, saved_vals))
    cts = build(
        "fxtools.split backward",
        [c.name for c in part.cts],
        sizes.concrete(symbolic, ct_vals),
        layout=bw_layout,
        roles={i: (lambda path, what=info.path: f"the cotangent of {what}") for i, info in enumerate(cotangents)},
    )
    if cap is not None:  # symbolic sizes and layout reads (signature/sizes.py)
        traced = cap.traced_sizes()
        sizes.guard_symbolic(forward.guards, traced, leaves)
        sizes.guard_symbolic(saved, traced, saved_vals)
        sizes.guard_symbolic(cts, traced, ct_vals)
    backward.guards = Guards("fxtools.split backward", saved.names + cts.names, saved.args + cts.args)
    backward_boxed.guards = _boxed_guards(backward.guards)


class _FakeRun(fx.Interpreter):
    """Runs a graph in fake mode, its tensor attributes (buffers) as fakes: an in-place update of a
    buffer (BatchNorm's batch count) must not touch the real one."""

    def __init__(self, gm, mode):
        super().__init__(gm)
        self.mode = mode

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        return self.mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value


def _same_structure(what: str, got, want) -> None:
    """Raise ``FxtoolsError`` unless ``got`` has ``want``'s pytree structure, tensor shapes and dtypes."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    if got_spec != want_spec:
        raise FxtoolsError(f"{what} has structure {got_spec}; the split's has {want_spec}")
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(want)[0]]
    for path, g, w in zip(paths, got_leaves, want_leaves):
        if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
            raise FxtoolsError(f"{what}{path} is {type(g).__name__}; the split's is {type(w).__name__}")
        if isinstance(w, torch.Tensor) and (tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype):
            raise FxtoolsError(f"{what}{path} is {g.dtype}{list(g.shape)}; the split's is {w.dtype}{list(w.shape)}")


def _as_guarded(gm: fx.GraphModule, class_name: str) -> GuardedGraphModule:
    """``gm`` (an edited graph) as a new GuardedGraphModule: its code is generated afresh."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    new = GuardedGraphModule(gm, graph, class_name=class_name)
    new.graph.set_codegen(gm.graph._codegen)
    new.recompile()
    return new


def _keystr(path) -> str:
    return pytree.keystr(path) if path else ""


class Report(str):
    """Text shown as itself at a prompt (its repr is the text, not a quoted string)."""

    def __repr__(self) -> str:
        return str(self)


def _check_edited_forward(sp: Split, forward: fx.GraphModule, mode, vals: list):
    """Run the edited forward in fake mode: it must take the split's inputs and return
    ``(out, (saved node, ...))`` with ``out`` as before. The saved values, before and after, and
    the edited forward's saved nodes."""
    fw_ph = [n for n in forward.graph.nodes if n.op == "placeholder"]
    if len(fw_ph) != len(sp.signature):
        raise FxtoolsError(
            f"the edited forward takes {len(fw_ph)} arguments; the split's forward takes {len(sp.signature)}: "
            f"{', '.join(i.name for i in sp.signature)}. Keep one placeholder per input."
        )
    with mode:
        want_out, want_saved = _FakeRun(sp.forward, mode).run(*vals)
        got = _FakeRun(forward, mode).run(*vals)
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[1], (tuple, list))):
        raise FxtoolsError("the edited forward must return (out, saved) with saved a tuple of tensors")
    out, saved = got
    _same_structure("the edited forward's out", out, want_out)
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    saved_nodes = output.args[0][1] if isinstance(output.args[0], (tuple, list)) and len(output.args[0]) == 2 else None
    if saved_nodes is None or len(saved_nodes) != len(saved) or not all(isinstance(n, fx.Node) for n in saved_nodes):
        raise FxtoolsError(
            "the edited forward's output must be (out, (saved node, ...)): return the saved values as a tuple of graph values"
        )
    if not all(isinstance(v, torch.Tensor) for v in saved):
        raise FxtoolsError("every saved value of the edited forward must be a tensor")
    return want_saved, saved, saved_nodes


def _check_edited_backward(sp: Split, backward: fx.GraphModule, mode, want_saved, saved) -> list:
    """Run the edited backward in fake mode on ``(*saved, *cotangents)``: its gradients must have
    the split's structure, shapes and dtypes. The cotangents' examples."""
    bw_ph = [n for n in backward.graph.nodes if n.op == "placeholder"]
    if len(bw_ph) != len(saved) + len(sp.cotangents):
        raise FxtoolsError(
            f"the edited backward takes {len(bw_ph)} arguments; the forward saves {len(saved)} values and there are "
            f"{len(sp.cotangents)} cotangents ({', '.join(c.name for c in sp.cotangents)}): it must take (*saved, *cotangents)"
        )
    cts = [c.meta["val"] for c in [n for n in sp.backward.graph.nodes if n.op == "placeholder"][len(sp.saved) :]]
    with mode:
        want_grads = _FakeRun(sp.backward, mode).run(*want_saved, *cts)
        grads = _FakeRun(backward, mode).run(*saved, *cts)
    _same_structure("the edited backward's gradients", grads, want_grads)
    return cts


def _edited(sp: Split, forward, backward, saved_nodes, saved: list, cts: list) -> Split:
    """``sp`` with the (checked) edited graphs: saved values described anew, guards rebuilt."""
    fw_set = {n for n in forward.graph.nodes if n.op == "placeholder"}
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    out_nodes = {n for n in pytree.tree_leaves(output.args[0][0]) if isinstance(n, fx.Node)}
    bw_ph = [n for n in backward.graph.nodes if n.op == "placeholder"]
    infos, storage_bytes = [], {}
    for node, p, v in zip(saved_nodes, bw_ph, saved):
        root = storage_root(node)
        kind = "input" if root in fw_set else "output" if node in out_nodes else "activation"
        storage_bytes[p.name] = nbytes(v)
        infos.append(TensorInfo(p.name, tuple(v.shape), v.dtype, nbytes(v), kind, None, user_line_of(node), p.name))
    forward, backward = _as_guarded(forward, "SplitForward"), _as_guarded(backward, "SplitBackward")
    backward_boxed = _boxed(backward)
    forward.guards = sp.forward.guards
    saved_guards = build("fxtools.split backward", [i.name for i in infos], sizes.concrete(sp.captured.symbolic, list(saved)))
    ct_guards = build("fxtools.split backward", [c.name for c in sp.cotangents], sizes.concrete(sp.captured.symbolic, cts))
    backward.guards = Guards("fxtools.split backward", saved_guards.names + ct_guards.names, saved_guards.args + ct_guards.args)
    backward_boxed.guards = _boxed_guards(backward.guards)
    return replace(
        sp,
        forward=forward,
        backward=backward,
        backward_boxed=backward_boxed,
        saved=infos,
        storage_bytes=storage_bytes,
        _partition=None,
        aten={},
    )


def _boxed(backward: fx.GraphModule) -> GuardedGraphModule:
    """``backward`` called as ``backward_boxed([*saved, *cotangents])`` (the list is emptied on entry)."""
    graph = fx.Graph()
    env: dict = {}
    for n in backward.graph.nodes:
        if n.op == "output":
            graph.output(fx.node.map_arg(n.args[0], env.__getitem__))
            break
        env[n] = node_copy(graph, n, env)
    graph.set_codegen(_BoxedCodeGen())
    boxed = _BoxedModule(backward, graph, class_name="SplitBackwardBoxed", generate_code=False)
    meta.BUILT_BY.set(boxed, meta.BUILT_BY.get(backward))
    return boxed


class _BoxedModule(GuardedGraphModule):
    """``Split.backward_boxed``, whose code is generated on first use (a call, ``forward``, ``code``),
    as ``torch.fx``'s ``_LazyGraphModule`` does: a caller running ``backward`` never pays for
    generating and compiling the same backward's code a second time (a tenth of a GPT's split)."""

    def _generate(self) -> None:
        if "forward" not in vars(type(self)):  # fx's recompile sets it on the module's own class
            self.recompile()

    def _pending_forward(self, *args, **kwargs):
        self._generate()
        return type(self).forward(self, *args, **kwargs)

    forward = _pending_forward

    @property
    def code(self) -> str:
        self._generate()
        return super().code

    def __str__(self) -> str:
        self._generate()
        return super().__str__()


def _boxed_guards(guards: Guards) -> Guards:
    return Guards(
        "fxtools.split backward_boxed", ("args",), (Node("args", "list", "list", tuple(range(len(guards.args))), guards.args),)
    )


@dataclass(eq=False)
class Split:
    """A forward graph and a backward graph (see the module docstring for the calling conventions)."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    backward_boxed: fx.GraphModule
    signature: list[TensorInfo]  # the forward's inputs
    saved: list[TensorInfo]  # what the forward saves for the backward
    cotangents: list[TensorInfo]  # the backward's cotangent inputs
    policy: Any
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    guards: Guards  # of the original arguments, Python values included (``flatten``, ``vjp``)
    captured: Captured  # the program as the shared front captured it (training/saved.py replays it)
    ct_index: list[int]  # the output leaf each cotangent belongs to
    from_module: bool  # made from an nn.Module: the first argument holds its parameters
    leaf_paths: list  # pytree path of each tensor leaf of the arguments
    out_is_tensor: list[bool]  # for each leaf of f's result
    out_tensor_paths: list[str]  # "out[0]", ... for each tensor leaf of the result
    storage_bytes: dict  # bytes of each storage a saved value lives in
    _partition: _Partition | None = None  # the joint graph's partition (None for an edited split)
    # the tensor arguments the program writes in place with a differentiable value (``training/written.py``):
    # the forward returns ``((out, (new value, ...)), saved)`` and writes none of them
    written: list[TensorInfo] = field(default_factory=list)
    write_back: WrittenInputs | None = None
    aten: dict = field(default_factory=dict)  # to_aten's results, by decomposition table (training/aten.py)

    # -- calling helpers ---------------------------------------------------------------------

    def flatten(self, *args) -> list[torch.Tensor]:
        """The tensor leaves of ``args`` in the forward's placeholder order, after checking that
        ``args`` are what the split was made for (``self.guards``, with the Python values the
        forward's flat signature does not take)."""
        return self.guards.check(args)

    def flatten_cotangent(self, grad_out) -> list[torch.Tensor]:
        """The cotangent leaves the backward takes, from ``grad_out`` shaped like ``f``'s output."""
        leaves = pytree.tree_leaves(grad_out)
        if len(leaves) == len(self.captured.out_leaves):
            return [leaves[i] for i in self.ct_index]
        if len(leaves) == len(self.ct_index):
            return leaves
        raise ValueError(f"grad_out has {len(leaves)} leaves; expected {len(self.ct_index)} cotangents")

    def flat_grads(self, grads) -> list:
        """The backward's gradients as one entry per tensor leaf of the arguments (forward order)."""
        leaves = pytree.tree_leaves(grads)  # None is a leaf
        if len(leaves) == len(self.captured.tensor_leaf):
            return [g for g, t in zip(leaves, self.captured.tensor_leaf) if t]
        return [pytree.key_get(grads, path) for path in self.leaf_paths]  # a registered dataclass leaves out None fields

    def vjp(self, *args, grad_out=None):
        """Run forward then backward: ``(out, grads)``; ``grad_out`` defaults to ones. The new
        value of each argument in ``written`` is written into it (outside autograd)."""
        leaves = self.flatten(*args)
        out, saved = self.forward(*leaves)
        if self.write_back is not None:
            with torch.no_grad():
                for i, new in zip(self.write_back.positions, out[1]):
                    leaves[i].copy_(new)
        if grad_out is None:
            cts = [torch.ones_like(o) for o in (pytree.tree_leaves(out)[i] for i in self.ct_index)]
        else:
            cts = self.flatten_cotangent(grad_out)
        return out, self.backward_boxed([*saved, *cts])

    # -- edited graphs -----------------------------------------------------------------------

    def edit(self, forward: fx.GraphModule | None = None, backward: fx.GraphModule | None = None) -> Split:
        """A split running edited graphs (``forward`` / ``backward``; ``None`` keeps this split's).

        Within the documented signature anything may change: the ops, what is saved (how many
        values, which), prints. The edited pair is checked on this split's example values, in fake
        mode (a ``print`` in it runs once there): the forward takes one argument per input and
        returns ``(out, saved)`` with ``out`` shaped as before and ``saved`` a tuple of tensors;
        the backward takes ``(*saved, *cotangents)`` and returns gradients with the structure,
        shapes and dtypes of before. Anything else raises ``FxtoolsError`` saying what differs.
        Run it with ``fxtools.compile(model_or_fn, split=edited)``.
        """
        forward = self.forward if forward is None else forward
        backward = self.backward if backward is None else backward
        vals = [n.meta["val"] for n in self.forward.graph.nodes if n.op == "placeholder"]
        mode = fake_mode_of(vals, create=True)
        want_saved, saved, saved_nodes = _check_edited_forward(self, forward, mode, vals)
        cts = _check_edited_backward(self, backward, mode, want_saved, saved)
        return _edited(self, forward, backward, saved_nodes, saved, cts)

    # -- reporting ---------------------------------------------------------------------------

    @property
    def saved_bytes(self) -> int:
        """Bytes the forward keeps alive for the backward beyond the inputs (each storage once)."""
        seen, total = set(), 0
        for s in self.saved:
            if s.kind != "input" and s.storage not in seen:
                seen.add(s.storage)
                total += self.storage_bytes[s.storage]
        return total

    @property
    def communicated_bytes(self) -> dict[str, int]:
        """Bytes the collectives of the forward and of the backward move per step on one rank
        (tensor parallel: ``training/distributed.py``)."""
        return {"forward": communicated_bytes(self.forward), "backward": communicated_bytes(self.backward)}

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the saved values the policy marked ``"offload"`` (each storage once)."""
        storages = {s.storage for s in self.saved if s.offload and s.kind != "input"}
        return sum(self.storage_bytes[k] for k in storages)

    def _joint(self) -> _Partition:
        if self._partition is None:
            raise FxtoolsError(
                "an edited split has no joint graph: costs, peaks and frontiers are those of the split it came from"
            )
        return self._partition

    @property
    def budget_choice(self):
        """What ``policies.budget`` chose (``fxtools.training.budget.Choice``), or None for other policies."""
        return self._partition.choice if self._partition is not None else None

    @property
    def recompute_cost(self) -> int:
        """Estimated cost of what the backward recomputes (``fxtools.training.budget.recompute_cost``)."""
        from . import budget

        part = self._joint()
        return sum(
            budget.recompute_cost(n) for n in backward_nodes(part, part.saved, part.recomputed, part.forget) if n not in part.bw
        )

    @property
    def predicted_peak(self) -> int:
        """Predicted peak bytes of the forward then ``backward_boxed`` (inputs included; liveness)."""
        from . import budget

        part = self._joint()
        return budget.predicted_peak(part, part.saved, part.recomputed, forget=part.forget)

    def frontier(self, budgets=None, path=None) -> list[tuple[int, int, int]]:
        """``(budget bytes, saved bytes, recompute cost)`` of ``policies.budget(b)`` for each ``b``
        in ``budgets`` (default: 20 fractions of ``save_all``'s bytes, 0.05 to 1); budgets below
        the least possible are left out. With ``path`` (``.svg``, or ``.png`` with matplotlib),
        draws the points and the convex hull the solver walks."""
        from . import budget

        part = self._joint()
        problem = budget.problem_of(part, fused=part.fused)
        points = problem.frontier()
        save_all_bytes = problem.saved_bytes(part._by_rule(policies.save_all)[0])
        budgets = [k / 20 for k in range(1, 21)] if budgets is None else budgets
        rows = []
        for b in budgets:
            limit = budget.limit_bytes(b, save_all_bytes)
            if limit >= points[0].bytes:
                point, _ = problem.byte_choice(limit)
                rows.append((limit, point.bytes, point.cost))
        if path is not None:
            budget.draw_frontier(rows, points, path, title=f"saved bytes against recompute ({len(rows)} budgets)")
        return rows

    def report(self, file=None) -> Report:
        """What the forward saves for the backward, like JAX's print_saved_residuals, with the
        estimated recompute cost, the predicted peak memory and, for a budget, what it chose.

        Returns the text as a ``Report``, a ``str`` whose repr is the text itself: at a prompt
        ``sp.report()`` shows it once, readably; in a script, ``print(sp.report())``. With
        ``file`` (an open text file, ``sys.stdout``) it is also written there.
        """
        lines = [
            f"fxtools.split (policy {policies.describe(self.policy)}): "
            f"{len(self.saved)} saved values, {self.saved_bytes:,} bytes beyond the inputs"
            + (f" ({self.offloaded_bytes:,} offloaded)" if any(s.offload for s in self.saved) else "")
        ]
        moved = self.communicated_bytes
        if any(moved.values()):
            lines.append(
                f"  collectives move {moved['forward']:,} B in the forward, {moved['backward']:,} B in the backward (per rank)"
            )
        if self._partition is not None:
            lines.append(
                f"  estimated recompute cost {self.recompute_cost:,} (FLOPs + elements); "
                f"predicted peak {self.predicted_peak:,} bytes (forward + backward, inputs included)"
            )
        choice = self.budget_choice
        if choice is not None:
            target = f"peak <= {choice.peak_limit:,} B" if choice.limit is None else f"saved <= {choice.limit:,} B"
            bound = (
                ""
                if choice.lower_bound is None
                else f", no split within the budget recomputes less than {choice.lower_bound:,.0f}"
            )
            lines.append(
                f"  budget: {target} (save_all saves {choice.save_all_bytes:,} B); chose {choice.point.bytes:,} B, "
                f"recompute {choice.point.cost:,}{bound}; {choice.method} frontier of {len(choice.frontier)} points (Split.frontier draws it)"
            )
        for w in self.written:
            lines.append(
                f"  writes {w.path or w.name} in place (the forward returns its new value)" + (f"  {w.line}" if w.line else "")
            )
        width = max((len(s.name) for s in self.saved), default=0)
        types = [str(s.dtype).replace("torch.", "") + str(list(s.shape)) for s in self.saved]
        twidth = max(map(len, types), default=0)
        for s, ty in zip(self.saved, types):
            share = f" (memory of {s.storage})" if s.storage != s.name else ""
            share += " (offload)" if s.offload else ""
            lines.append(
                f"  {s.kind:<10} {s.name:<{width}}  {ty:<{twidth}} {s.bytes:>12,} B{share}" + (f"  {s.line}" if s.line else "")
            )
            if s.note:
                lines.append(f"  {'':<10} {'':<{width}}  {s.note}")
        text = Report("\n".join(lines))
        if file is not None:
            print(text, file=file)
        return text

    def __repr__(self):
        return (
            f"Split({len(self.signature)} inputs, {len(self.saved)} saved ({self.saved_bytes:,} B), "
            f"{len(self.cotangents)} cotangents, policy={policies.describe(self.policy)})"
        )


SPLIT = Transform(
    "fxtools.split",
    returns="out, saved",
    keywords=False,
)


@uses_pipeline(SPLIT)
def split(f, *args, policy="recompute_cheap", grad_leaves=None, rules=None, dynamic_shapes=None, check_finite=False) -> Split:
    """Forward and backward graphs of ``f`` at ``args`` (see the module docstring).

    ``policy``: ``"recompute_cheap"`` (default), ``"save_all"``, ``"dots_saveable"`` or a function
    ``node -> "save" | "recompute"`` (see ``fxtools.policies``). ``grad_leaves``: one bool per
    tensor leaf (forward placeholder order) saying which get a gradient (default: all); the
    backward returns ``None`` for the others and saves nothing only they would need.
    ``rules``: the rule set (``"readable"``, ``"fused"``, a dict; see ``fxtools.rule_set``);
    ``None`` (default) uses the one in effect, readable unless a ``rule_set`` block says otherwise.
    ``check_finite=True``: the forward and backward raise ``fxtools.NonFiniteError`` when a step
    computes a NaN or an unintended infinity, naming the first (``training/finite.py``).
    """
    if rules is not None:
        with registry.rule_set(rules):
            sp = split(f, *args, policy=policy, grad_leaves=grad_leaves, dynamic_shapes=dynamic_shapes)
        return checked_split(sp) if check_finite else sp
    policies.resolve(policy)  # validate early
    from_module = isinstance(f, torch.nn.Module)
    if from_module:
        args = (dict(f.named_parameters()), *args)
        if isinstance(dynamic_shapes, (tuple, list)):
            dynamic_shapes = (None, *dynamic_shapes)
        f = functional(f)
    argnums = tuple(range(len(args)))
    writes: WrittenInputs | None = None
    while True:  # each differentiable write into an argument found makes the program write a copy instead
        try:
            with checkpoint_regions():
                fn = f if writes is None else writes.function(f)
                cap = front(fn, args, made_by=SPLIT, argnums=argnums, dynamic_shapes=dynamic_shapes, grad_leaves=grad_leaves)
            wrt = differentiated(cap, argnums, grad_leaves)
            found = differentiable_writes(cap.gm, wrt)
            if not found:
                if writes is not None:
                    _name_written(cap, writes)
                with fx_traceback.preserve_node_meta():
                    rev = reverse(cap.gm, ReverseSpec(wrt, "cotangent"))
                break
        except InplaceError as e:
            found = written_by(e) or {}
            if not found.keys() - (writes.lines.keys() if writes is not None else set()):
                raise
        if writes is not None and not found.keys() - writes.lines.keys():
            raise FxtoolsError("internal error: a differentiable write into an argument is kept in place")
        writes = WrittenInputs({**found, **(writes.lines if writes is not None else {})})
    joint = rev.gm
    accumulate_into_scatters(joint)
    simplify(joint)
    sizes.check(cap.symbolic, joint)
    _name_items(joint)
    part = _Partition(joint, sum(cap.tensor_leaf), len(cap.out_leaves), policy)
    forward = _forward_graph(joint, part, cap)
    backward = _backward_graph(joint, part, cap, grads_structure(cap, args, _flat_grads(part, wrt), argnums))
    sp = _described(cap, args, part, forward, backward, rev.ct_index, policy, from_module)
    if writes is not None:
        _describe_writes(sp, writes)
    return checked_split(sp) if check_finite else sp


def _name_written(cap: Captured, writes: WrittenInputs) -> None:
    """Name each new value of a written argument after it (``y_written``), where the graph computes
    it (not an input, nor an output of the program's own)."""
    outs = pytree.tree_leaves(cap.gm.graph.output_node().args[0])
    n = len(writes.positions)
    if len(outs) != len(cap.out_leaves) or len(outs) < n:
        return
    own = set(outs[: len(outs) - n])
    names = [name for name, t in zip(cap.names, cap.tensor_leaf) if t]
    for i, node in zip(writes.positions, outs[len(outs) - n :]):
        if isinstance(node, fx.Node) and node.op == "call_function" and node not in own and i < len(names):
            node._rename(f"{names[i]}_written")


def _describe_writes(sp: Split, writes: WrittenInputs) -> None:
    """``sp.written`` and ``sp.write_back`` for the arguments ``writes`` lists (``training/written.py``)."""
    writes.names = [i.path or i.name for i in sp.signature]
    sp.write_back = writes
    sp.written = [replace(sp.signature[i], kind="written", line=writes.lines.get(i)) for i in writes.positions]


def _forward_graph(joint: fx.GraphModule, part: _Partition, cap: Captured) -> fx.GraphModule:
    """The forward: the inputs in; outputs, saved values and side effects (buffer updates)."""
    fg = fx.Graph()
    env = {}
    for p in part.primals:
        env[p] = _copy_meta(fg.placeholder(p.name), p)
    for n in forward_nodes(part, part.saved):
        env[n] = node_copy(fg, n, env)
        meta.PART.set(env[n], "forward")
    out_struct = pytree.tree_unflatten([env[o] if isinstance(o, fx.Node) else o for o in part.fw_outs], cap.out_spec)
    fg.output((returnable(fg, out_struct), tuple(env[s] for s in part.saved)))
    return emit(GuardedGraphModule(joint, fg, class_name="SplitForward", generate_code=False), cap, SPLIT)


def _flat_grads(part: _Partition, wrt: list[bool]) -> list:
    """The joint graph's gradient outputs, one per tensor leaf (None where none is computed)."""
    it = iter(part.grads)
    return [next(it) if w else None for w in wrt]


def _backward_graph(joint: fx.GraphModule, part: _Partition, cap: Captured, grads) -> fx.GraphModule:
    """The backward: saved values and cotangents in, recomputation placed just before first use,
    ``grads`` (joint-graph nodes, nested as the arguments) out."""
    keep = set(forward_nodes(part, part.saved))
    bg = fx.Graph()
    benv = {}
    for s in part.saved:
        benv[s] = _copy_meta(bg.placeholder(s.name), s)
    for c in part.cts:
        benv[c] = _copy_meta(bg.placeholder(c.name), c)
    for v in backward_nodes(part, part.saved, part.recomputed, part.forget):
        benv[v] = node_copy(bg, v, benv)
        meta.PART.set(benv[v], "recompute" if v in keep else "backward")  # computed in both graphs
    bg.output(returnable(bg, pytree.tree_map(lambda g: benv[g] if isinstance(g, fx.Node) else g, grads), "the gradients"))
    return emit(GuardedGraphModule(joint, bg, class_name="SplitBackward", generate_code=False), cap, SPLIT)


def _described(cap: Captured, args: tuple, part: _Partition, forward, backward, ct_index, policy, from_module) -> Split:
    """The Split of these graphs: inputs, saved values and cotangents described, guards installed."""
    paths = [p for p, _ in pytree.tree_flatten_with_path(tuple(args))[0]]
    tensor_paths = [p for p, t in zip(paths, cap.tensor_leaf) if t]
    top = cap.arg_names

    def path_text(path):
        return top[path[0].idx] + _keystr(path[1:]) if path else None

    signature = [_info(p, "input", path_text(path)) for p, path in zip(part.primals, tensor_paths)]
    n_out = len(cap.out_leaves)
    out_paths = [p for p, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(n_out)), cap.out_spec))[0]]
    cotangents = [_info(c, "cotangent", "out" + _keystr(out_paths[i])) for c, i in zip(part.cts, ct_index)]
    saved, storage_bytes = _saved_infos(part)
    backward_boxed = _boxed(backward)
    layouts = _layouts(forward, backward, part, signature)
    _install_guards(forward, backward, backward_boxed, part, signature, cotangents, cap, layouts)
    guards = _argument_guards(cap, args, part, signature, layouts)
    n_leaves = sum(isinstance(a, torch.Tensor) for a in pytree.tree_leaves(tuple(args)))
    guard_sharing(forward, args, guards, forward.guards.written if n_leaves == len(part.primals) else None)
    if guards.shared:
        _refuse_shared(cap, args, guards.shared[0], forward)
    closures.attach_held(forward, cap.reads, SPLIT.name, holders=(backward,))  # closed-over state, checked on every forward
    out_is_tensor = [isinstance(o, torch.Tensor) for o in cap.out_leaves]
    return Split(
        forward,
        backward,
        backward_boxed,
        signature,
        saved,
        cotangents,
        policy,
        cap.in_spec,
        cap.out_spec,
        guards=guards,
        captured=cap,
        ct_index=ct_index,
        from_module=from_module,
        leaf_paths=tensor_paths,
        out_is_tensor=out_is_tensor,
        out_tensor_paths=["out" + _keystr(p) for p, t in zip(out_paths, out_is_tensor) if t],
        storage_bytes=storage_bytes,
        _partition=part,
    )


def _saved_infos(part: _Partition) -> tuple[list[TensorInfo], dict[str, int]]:
    """What the forward saves, described; the bytes of each storage the saved values live in."""
    fw_out_nodes = {o for o in part.fw_outs if isinstance(o, fx.Node)}
    primal_set = set(part.primals)
    saved, storage_bytes = [], {}
    for s in part.saved:
        root = storage_root(s)
        kind = "input" if root in primal_set else "output" if s in fw_out_nodes else "activation"
        storage_bytes[root.name] = max(storage_bytes.get(root.name, 0), nbytes(root.meta.get("val")), nbytes(s.meta.get("val")))
        info = _info(s, kind, line=user_line_of(s), storage=root.name)
        info.note = meta.NOTE.get(s)
        info.offload = s in part.offload
        saved.append(info)
    return saved, storage_bytes


def _refuse_shared(cap: Captured, args: tuple, group: tuple, forward: fx.GraphModule) -> None:
    """Refuse a split of a program writing in place whose example arguments share memory (the
    same tensor twice): the forward/backward partition does not see the sharing, and a value the
    backward reads could be one the forward's write changed."""
    leaves = [(path, a) for path, a in pytree.tree_flatten_with_path(tuple(args))[0] if isinstance(a, torch.Tensor)]
    names = [cap.arg_names[path[0].idx] + _keystr(path[1:]) for path, _ in (leaves[i] for i in group)]
    writes = (
        n
        for g in (cap.gm, forward)
        for n in g.graph.nodes
        if n.op == "call_function" and str(getattr(n.target, "__name__", "")).split(".")[0].endswith("_")
    )
    where = next((w for w in map(user_line_of, writes) if w), "a line of the program")
    raise FxtoolsError(
        f"fxtools.split (and fxtools.compile) cannot split a program that writes in place ({where}) when called with "
        f"arguments sharing memory: {' and '.join(names)} share memory. Pass separate tensors (.clone() one of "
        "them); fxtools.vjp and the other transforms take them"
    )


def _argument_guards(cap: Captured, args: tuple, part: _Partition, signature, layouts: tuple[set, set]) -> Guards:
    """Guards of the original arguments; an input's layout matters where the forward, or the
    backward reading it as saved, views it (``layouts``: ``_layouts`` of the two graphs)."""
    fw_paths, bw_paths = layouts
    strided = {i.path for i, p in zip(signature, part.primals) if (i.path or i.name) in fw_paths or p.name in bw_paths}
    guards = build(SPLIT.name, cap.arg_names, args, layout=strided)
    sizes.guard_symbolic(guards, cap.traced_sizes(), args)
    return guards
