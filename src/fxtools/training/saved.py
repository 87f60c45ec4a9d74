"""What a compiled module's forward keeps for its backward, and how that backward is differentiated.

``fxtools.compile`` and ``fxtools.backend`` run a split's forward and backward inside one
``torch.autograd.Function`` (``backend._SplitFunction``); this module is its memory and its
second order.

- **Saved values** (``SavedValues``): every tensor the forward saves goes through
  ``ctx.save_for_backward``, so PyTorch's saved-tensor hooks (``torch.autograd.graph.save_on_cpu``,
  ``saved_tensors_hooks``, memory tools) see each one, as they see eager autograd's. The backward
  unpacks them once, releases the node's references unless the graph is retained, and hands the
  list to the boxed backward, which frees each value after its last use. Non-tensor values stay
  plain attributes.
- **Offload** (``TensorInfo.offload``, set by a policy): such a value is copied to CPU memory after
  the forward (pinned memory and a side stream on CUDA, the device taken from the tensor) and
  copied back to its device, with its strides, before the backward uses it.
- **Double backward** (``Replay``): a backward run with ``create_graph=True`` does not use the
  saved values: it runs the captured program (``Split.captured.gm``: the user's ATen ops, with their
  ``detach`` and ``no_grad`` regions) again on the inputs with autograd recording, and takes
  autograd's gradient of it, so the gradients are PyTorch functions of the inputs and cotangents,
  differentiable to any order as eager code is (compiled graphs are never differentiated). The
  replay reads what the forward read: the inputs (refused if modified in place since), the
  module's buffers as they were before the forward (the forward's own updates, BatchNorm's running
  statistics, are copied first and not repeated), and the random-number generators' states
  (dropout draws the same masks). What it cannot replay exactly raises ``FxtoolsError``: a forward
  a compiler made whose graph draws random numbers, a function with its own backward
  (``torch.autograd.Function``, ``fxtools.custom_vjp``), a forward writing an input that requires
  grad.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError, user_line_of
from ..graph import meta
from ..graph.nodes import written_args
from ..passes.subgraphs import subgraphs

__all__ = ["SavedValues", "Replay", "differentiated", "to_host", "to_device", "rng_state", "rng_restored"]


# --------------------------------------------------------------------------------------------
# Offload: a saved tensor in CPU memory between the forward and the backward
# --------------------------------------------------------------------------------------------


@functools.cache
def _side_stream(device: torch.device):
    """The stream offload copies run on, one per CUDA device (so they overlap the computation)."""
    return torch.cuda.Stream(device)


@dataclass
class _Place:
    """Where an offloaded tensor came from: its device, shape and strides."""

    device: torch.device
    shape: torch.Size
    stride: tuple


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each broadcast (stride-0) dimension cut to size 1: the memory it spans, once."""
    index = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for n, st in zip(t.shape, t.stride()))
    return t[index]


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, _Place]:
    """A copy of ``t`` in CPU memory (broadcast dimensions once), and where it came from.

    On CUDA the copy goes to pinned memory on a side stream, after the work that made ``t``;
    ``t``'s memory is not reused before the copy is done (``record_stream``). Elsewhere a plain
    copy (on the CPU a no-op device-wise, kept so the path runs everywhere)."""
    place, base = _Place(t.device, t.shape, t.stride()), _compact(t)
    if t.device.type != "cuda":
        return base.to("cpu", copy=True), place
    stream = _side_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host = torch.empty_like(base, device="cpu", pin_memory=True)
        host.copy_(base, non_blocking=True)
    t.record_stream(stream)
    return host, place


def to_device(host: torch.Tensor, place: _Place) -> torch.Tensor:
    """``host`` back on ``place.device`` with ``place``'s shape and strides (``to_host``'s inverse).

    On CUDA the copy runs on the side stream (after the copy out) and the current stream waits
    for it."""
    if place.device.type != "cuda":
        back = host.to(place.device)
    else:
        stream, current = _side_stream(place.device), torch.cuda.current_stream(place.device)
        with torch.cuda.stream(stream):
            back = host.to(place.device, non_blocking=True)
        current.wait_stream(stream)
        back.record_stream(current)
    back = back.expand(place.shape)
    if back.stride() == place.stride:
        return back
    try:  # the original layout, where it can be written (not an overlapping one)
        return torch.empty_strided(place.shape, place.stride, dtype=back.dtype, device=back.device).copy_(back)
    except RuntimeError:
        return back


# --------------------------------------------------------------------------------------------
# Saved values through ctx.save_for_backward
# --------------------------------------------------------------------------------------------


class SavedValues:
    """How a split's saved values travel from its forward to its backward (the module docstring).

    ``infos``: the split's ``Split.saved`` (one per saved value, in order)."""

    def __init__(self, infos):
        self.offload = [i.offload for i in infos]

    def pack(self, ctx, saved: list) -> None:
        """In the forward: offload what the policy says, then save every tensor through ``ctx``."""
        places: list[_Place | None] = [None] * len(saved)
        for i, (value, off) in enumerate(zip(saved, self.offload)):
            if off and isinstance(value, torch.Tensor):
                saved[i], places[i] = to_host(value)
        if any(p is not None and p.device.type == "cuda" for p in places) and _hooks_active():
            torch.cuda.synchronize()  # a hook may read the host copies now: let them land first
        ctx.save_for_backward(*[v for v in saved if isinstance(v, torch.Tensor)])
        ctx.fxtools_plain = [None if isinstance(v, torch.Tensor) else v for v in saved]
        ctx.fxtools_is_tensor = [isinstance(v, torch.Tensor) for v in saved]
        ctx.fxtools_places = places
        saved.clear()

    def unpack(self, ctx) -> list:
        """In the backward: the saved values, offloaded ones back on their devices. Unless the
        graph is retained, ``ctx`` lets go of them, so the caller's list holds the only references."""
        tensors = iter(ctx.saved_tensors)
        values = [next(tensors) if t else v for t, v in zip(ctx.fxtools_is_tensor, ctx.fxtools_plain)]
        del tensors
        for i, place in enumerate(ctx.fxtools_places):
            if place is not None:
                values[i] = to_device(values[i], place)
        release(ctx)
        return values


def _hooks_active() -> bool:
    """Whether saved-tensor hooks (``saved_tensors_hooks``, ``save_on_cpu``) are in effect."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``, ``create_graph``)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def release(ctx) -> None:
    """Unless the running backward keeps the graph, drop what ``ctx`` holds for a backward."""
    if not graph_kept():
        ctx.maybe_clear_saved_tensors()
        ctx.fxtools_plain = ctx.fxtools_record = ctx.fxtools_inputs = None


# --------------------------------------------------------------------------------------------
# Double backward: the captured program replayed with autograd recording
# --------------------------------------------------------------------------------------------


def _random_nodes(gm: fx.GraphModule | None) -> list[fx.Node]:
    """The nodes of an ATen graph (a compiler's input) and its subgraphs that draw random numbers."""
    found: list[fx.Node] = []
    for g in (gm, *subgraphs(gm)) if gm is not None else ():
        for node in g.graph.nodes:
            op = _aten_op(node)
            if node.op == "call_function" and isinstance(op, torch._ops.OpOverload):
                if torch.Tag.nondeterministic_seeded in op.tags:
                    found.append(node)
    return found


def _aten_op(node: fx.Node):
    """The ATen op a node calls, or was traced from (rendered graphs call public functions)."""
    return node.target if isinstance(node.target, torch._ops.OpOverload) else node.meta.get("original_aten")


def _written_root(node: fx.Node) -> fx.Node:
    """The graph value whose memory ``node`` is (through views)."""
    while node.op in ("call_function", "call_method") and isinstance(node.args[0], fx.Node):
        op = _aten_op(node)
        if node.target is operator.getitem or not isinstance(op, torch._ops.OpOverload) or not _is_view(op):
            break
        node = node.args[0]
    return node


def _is_view(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _static_writes(gm: fx.GraphModule, lines: dict | None = None) -> set:
    """The placeholder positions and attribute names whose memory an op of ``gm`` writes, by the
    ATen op each node was traced from (``written_args``: BatchNorm's statistics too, which its
    kernel writes without bumping their version counters). ``lines``, if given, gets each one's
    user lines of the writes."""
    positions = {p: i for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out: set = set()
    lines = {} if lines is None else lines
    for node in gm.graph.nodes:
        op = _aten_op(node)
        if node.op not in ("call_function", "call_method") or node.target is operator.getitem:
            continue
        if not isinstance(op, torch._ops.OpOverload):
            continue
        for value in written_args(op, node.args, node.kwargs):
            root = _written_root(value) if isinstance(value, fx.Node) else None
            key: object = None
            if root is not None and root.op == "get_attr":
                key = root.target
            elif root is not None and root.op == "placeholder":
                key = positions[root]
            if key is not None:
                out.add(key)
                lines.setdefault(key, set()).add(user_line_of(node) or str(op))
    return out


def _custom_calls(gm: fx.GraphModule) -> list[str]:
    """The user lines of the calls of functions with their own backward (``torch.autograd.Function``,
    ``fxtools.custom_vjp``) in a captured graph and its subgraphs."""
    return sorted(
        {user_line_of(n) or str(meta.CUSTOM.get(n)) for g in (gm, *subgraphs(gm)) for n in g.graph.nodes if meta.CUSTOM.get(n)}
    )


def rng_state(leaves) -> tuple:
    """The default generators' states: the CPU's, and those of the accelerators ``leaves`` are on."""
    devices = sorted({x.device for x in leaves if isinstance(x, torch.Tensor) and not x.is_cpu}, key=str)
    return torch.get_rng_state(), [(d, torch.get_device_module(d.type).get_rng_state(d)) for d in devices]


def _same_rng(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for (_, x), (_, y) in zip(a[1], b[1]))


@dataclass
class _Record:
    """What a forward read, kept for a replay: the inputs and their versions, copies of the
    tensors the forward writes as they were before it, versions of the attributes it reads, the
    generators' states before it, and whether it drew from them."""

    leaves: list
    versions: list
    snapshots: dict  # leaf position or attribute name -> copy from before the forward
    attr_versions: dict
    rng: tuple
    drew: bool = False
    writes_grad_input: tuple = ()  # inputs requiring grad that the forward wrote


class Replay:
    """The differentiable backward of a split (the module docstring): ``record`` before each
    forward that may be differentiated and ``finish`` after it; ``vjp`` in a backward with
    ``create_graph=True``.

    What the forward writes (buffer updates, such as BatchNorm's statistics, as attributes or as
    inputs) is read from the schemas of its ops, and from the version counters at its first run,
    for which every tensor it could write is copied first; later runs copy only what it writes.

    ``compiled_forward``: the ATen graph a forward compiler got (``None``: the readable forward
    runs). Its random draws are the compiled code's own: a replay of one that draws is refused."""

    def __init__(self, sp, compiled_forward: fx.GraphModule | None):
        self.split = sp
        self.program = fw = sp.captured.gm  # the captured program: the user's ops, detach and custom calls kept
        self.attrs = sorted(
            {n.target for n in fw.graph.nodes if n.op == "get_attr" and isinstance(_attr(fw, n.target), torch.Tensor)}
        )
        self.random = _random_nodes(compiled_forward)
        self.custom = _custom_calls(sp.captured.gm)
        self.compiled_forward = compiled_forward is not None
        self.write_lines: dict = {}  # leaf position or attribute name -> the user lines writing it
        self.written = _static_writes(fw, self.write_lines)  # leaf positions and attribute names the forward writes
        self.learnt = False  # whether a run has shown what else it writes (by version counters)

    def record(self, leaves) -> _Record:
        """Before the forward: what a replay will need."""
        fw = self.program
        candidates = set(self.written)
        if not self.learnt:
            candidates |= {i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and not x.requires_grad}
            candidates |= set(self.attrs)
        snapshots = {k: (_attr(fw, k) if isinstance(k, str) else leaves[k]).clone() for k in candidates}
        versions = [x._version if isinstance(x, torch.Tensor) else None for x in leaves]
        attr_versions = {t: _attr(fw, t)._version for t in self.attrs}
        return _Record(list(leaves), versions, snapshots, attr_versions, rng_state(leaves))

    def finish(self, record: _Record) -> None:
        """After the forward: what it wrote (kept as copies from before it) and whether it drew."""
        fw = self.program
        written = {t for t, v in record.attr_versions.items() if _attr(fw, t)._version != v}
        written |= {i for i, (x, v) in enumerate(zip(record.leaves, record.versions)) if v is not None and x._version != v}
        written |= self.written
        self.written, self.learnt = written, True
        record.writes_grad_input = tuple(i for i in written if isinstance(i, int) and record.leaves[i].requires_grad)
        record.snapshots = {k: v for k, v in record.snapshots.items() if k in written}
        for k in written - record.snapshots.keys():  # not copied: a replay must not read it
            record.snapshots[k] = None
        for t in written:
            if isinstance(t, str):
                del record.attr_versions[t]
            else:
                record.versions[t] = None
        _, accelerators = record.rng  # the same devices as before the forward
        now = (torch.get_rng_state(), [(d, torch.get_device_module(d.type).get_rng_state(d)) for d, _ in accelerators])
        record.drew = not _same_rng(record.rng, now)

    def vjp(self, record: _Record | None, cts: list) -> list:
        """The gradients for ``cts``, recorded by autograd as functions of the inputs and ``cts``:
        autograd's backward of the captured program, replayed on the inputs."""
        self._check(record)
        assert record is not None
        copies = {k: v.clone() for k, v in record.snapshots.items()}
        leaves = [copies.get(i, x) for i, x in enumerate(record.leaves)]
        attrs = {k: v for k, v in copies.items() if isinstance(k, str)}

        def run(xs):
            outs = pytree.tree_leaves(_ReplayForward(self.program, attrs).run(*xs))
            return [(outs[i], ct) for i, ct in zip(self.split.ct_index, cts) if outs[i].requires_grad]

        with rng_restored(record.rng):
            return differentiated(leaves, run)

    def check_unchanged(self, record: _Record | None) -> None:
        """Refuse a differentiable backward of a forward whose graph was freed, or whose inputs
        were modified in place since it ran (``SubclassLeaves.differentiable_backward`` replays
        the user's program, not the captured one: the captured program's own checks do not apply)."""
        what = "double backward (create_graph=True) through fxtools.compile"
        if record is None:
            raise FxtoolsError(
                f"{what}: this graph was freed by an earlier backward; pass retain_graph=True (or create_graph=True) "
                "to the earlier one"
            )
        if record.drew:
            raise FxtoolsError(
                f"{what}: the forward of a program taking DTensors drew random numbers, which its differentiable "
                "backward, eager's on the DTensors, would draw anew: make the program deterministic (model.eval(), dropout p=0)"
            )
        self._check_versions(record)

    def _names(self, keys) -> str:
        return ", ".join(k if isinstance(k, str) else self.split.signature[k].path or self.split.signature[k].name for k in keys)

    def _check(self, record: _Record | None) -> None:
        """Refuse a replay that would not compute what the forward computed."""
        what = "double backward (create_graph=True) through fxtools.compile"
        if record is None:
            raise FxtoolsError(
                f"{what}: this graph was freed by an earlier backward; pass retain_graph=True (or create_graph=True) "
                "to the earlier one"
            )
        if self.custom:
            raise FxtoolsError(
                f"{what}: the program calls a function with its own backward ({'; '.join(self.custom)}); the "
                "differentiable backward replays the forward with autograd, which would differentiate that function's "
                "forward ops instead of its backward: differentiate twice with fxtools.hvp or fxtools.grad, which "
                "differentiate the function's backward, or run this model eagerly"
            )
        if record.writes_grad_input or any(v is None for v in record.snapshots.values()):
            written = [*record.writes_grad_input, *(k for k, v in record.snapshots.items() if v is None)]
            where = sorted({line for k in written for line in self.write_lines.get(k, ())})
            raise FxtoolsError(
                f"{what}: the forward writes {self._names(written)} in place"
                + (f" (at {'; '.join(where)})" if where else "")
                + ", and its backward replays the forward from the values before: write to a copy in the program instead"
            )
        if (self.random or record.drew) and self.compiled_forward:
            lines = sorted({user_line_of(n) or n.name for n in self.random}) or ["a random op"]
            raise FxtoolsError(
                f"{what}: the forward, made by fw_compiler, draws random numbers ({'; '.join(lines)}) and its draws "
                "cannot be replayed; compile without fw_compiler (fxtools replays the draws of its own forward exactly) "
                "or make the program deterministic (model.eval(), dropout p=0)"
            )
        self._check_versions(record)

    def _check_versions(self, record: _Record) -> None:
        """Refuse inputs and attributes modified in place since the forward (as autograd does)."""
        changed = [i for i, (x, v) in enumerate(zip(record.leaves, record.versions)) if v is not None and x._version != v]
        fw = self.program
        changed += [t for t, v in record.attr_versions.items() if _attr(fw, t)._version != v]
        if changed:
            raise FxtoolsError(
                f"double backward through fxtools.compile: {self._names(changed)} modified in place after the forward, "
                "which the differentiable backward replays: modify a copy, or run the backward first"
            )


def differentiated(leaves: list, run) -> list:
    """Autograd's gradients, recorded (``create_graph=True``), of the ``(output, cotangent)`` pairs
    ``run(xs)`` returns, with respect to the ``leaves`` that require grad (``xs``: one alias of each,
    so that an input passed twice gets a gradient per position); None for the other leaves."""
    wrt = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    xs = list(leaves)
    with torch.enable_grad():
        for i in wrt:
            xs[i] = xs[i].view_as(xs[i])
        pairs = run(xs)
        grads = torch.autograd.grad(
            [y for y, _ in pairs], [xs[i] for i in wrt], [ct for _, ct in pairs], create_graph=True, allow_unused=True
        )
    flat: list = [None] * len(leaves)
    for i, g in zip(wrt, grads):
        flat[i] = g
    return flat


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def rng_restored(rng):
    """The generators as they were before the forward (``rng_state``), restored afterwards."""
    cpu, states = rng
    with contextlib.ExitStack() as stack:
        for device_type in sorted({d.type for d, _ in states}) or ["cuda"]:
            indices = [d.index for d, _ in states if d.type == device_type]
            stack.enter_context(torch.random.fork_rng(devices=indices, device_type=device_type))
        torch.set_rng_state(cpu)
        for device, state in states:
            torch.get_device_module(device.type).set_rng_state(state, device)
        yield


class _ReplayForward(fx.Interpreter):
    """The forward graph, run with some attributes replaced (snapshots of the buffers it writes)."""

    def __init__(self, gm: fx.GraphModule, attrs: dict):
        super().__init__(gm)
        self.attrs = attrs

    def get_attr(self, target, args, kwargs):
        if target in self.attrs:
            return self.attrs[target]
        return super().get_attr(target, args, kwargs)
