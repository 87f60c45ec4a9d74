"""Memoized replay of rule calls while ``reverse`` traces its template.

Tracing dispatches every torch call inside a rule through ``make_fx`` and FakeTensors, about a
millisecond per op. A model of identical layers calls each rule many times on arguments of the
same metadata, and the nodes such a call adds to the graph depend only on the function and on
that metadata (and on its Python arguments). ``Memo.call(fn, *args)`` traces the first such call
for real and records the nodes it added; later calls copy those nodes, reading the current
arguments' nodes instead, and hand back fresh FakeTensors of the recorded metadata.

The copies are made through the tracer's ``create_node``, so ``fx.traceback.set_current_meta``
(``fxtools.split``'s stack traces and markers) applies to them as to traced nodes, and they get
the names tracing would give them. Random ops are copied as new nodes: independent draws.

Whatever cannot be keyed or replayed faithfully is simply called: rules marked ``replayable =
False`` (``registry.vjp_rule(..., replay=False)``: they read the traced graph), arguments that are not
FakeTensors of this trace or plain Python values, symbolic sizes, constants known to the tracer,
calls that modify an argument in place or that read traced values they were not given.
"""

from __future__ import annotations

import contextvars
import operator
import types

import torch
import torch.fx as fx
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx.experimental import proxy_tensor
from torch.fx.immutable_collections import immutable_list
from torch.utils import _pytree as pytree

from ..graph.fakes import detached, wrapper
from ..graph.nodes import copy_args

aten = torch.ops.aten

_ATOMS = frozenset({int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, types.EllipsisType})
# node.meta entries that creating a node sets (or, under ``preserve_node_meta``, takes from the op
# being differentiated): the copy gets its own, not the recorded node's
_CREATED = frozenset(
    {
        "val",
        "stack_trace",
        "seq_nr",
        "nn_module_stack",
        "torch_fn",
        "eager_input_vals",
        "is_gradient_acc",
        "autograd_backward",
        "is_functional_regenerated",
        "unbacked_bindings",
        *fx.proxy._COPY_META_FIELDS,
    }
)

# False: every call is traced for real (the tests compare replay with it)
ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("fxtools_replay_enabled", default=True)


class _Unkeyable(Exception):
    pass


def _atom_key(x):
    t = type(x)
    if t in _ATOMS:
        return t, x
    if t is float:
        return t, x.hex()  # -0.0 and 0.0 differ; nan equals itself
    if t is complex:
        return t, x.real.hex(), x.imag.hex()
    if t is slice:
        return t, _atom_key(x.start), _atom_key(x.stop), _atom_key(x.step)
    raise _Unkeyable


def _static(val) -> bool:
    """A FakeTensor whose metadata a fresh tensor can reproduce."""
    return (
        type(val) is FakeTensor
        and val.layout is torch.strided
        and not val.is_neg()
        and not val.is_conj()
        and all(type(s) is int for s in (*val.shape, *val.stride(), val.storage_offset()))
        and _static_nbytes(val)
    )


def _static_nbytes(val) -> bool:
    nbytes = val.untyped_storage().nbytes()  # symbolic for a view of a symbolic-sized base
    return type(nbytes) is int and nbytes % val.element_size() == 0


def _tensor_key(t, tracer):
    if not _static(t):
        raise _Unkeyable
    slot = proxy_tensor.get_proxy_slot(t, tracer, None)
    if slot is None or slot.constant is not None:  # not traced here, or a constant make_fx folds
        raise _Unkeyable
    meta = (tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(), t.dtype, t.device, t.requires_grad)
    return meta, slot.proxy.node


def _key(fn, args, kwargs, tracer):
    """``(key, tensors, nodes)``: the call's key, its distinct tensor arguments and their nodes."""
    leaves, spec = _flatten(args, kwargs)
    parts, tensors, nodes, index = [fn, spec], [], [], {}
    for x in leaves:
        if isinstance(x, torch.Tensor):
            i = index.get(id(x))
            if i is None:
                meta, node = _tensor_key(x, tracer)
                i = index[id(x)] = len(tensors)
                tensors.append(x)
                nodes.append(node)
                parts.append(meta)
            parts.append(("T", i))  # which leaves are the same tensor
        else:
            parts.append(_atom_key(x))
    key = tuple(parts)
    hash(key)
    if len(set(nodes)) != len(nodes):
        raise _Unkeyable  # two tensors traced to one node: copies could not tell them apart
    return key, tensors, nodes


def _flatten(args, kwargs):
    """``(leaves, structure)`` of a call's arguments, as ``pytree.tree_flatten`` but read directly
    when they are nested tuples, lists and dicts (what rules and ops take): the structure lists, in order,
    the keyword names, each container's type and length and a ``None`` for each leaf (a TreeSpec,
    hashed at each look-up, costs more than the rest of the key)."""
    leaves: list = []
    shape: list = [tuple(kwargs)] if kwargs else []

    def walk(xs):
        for x in xs:
            t = type(x)
            if t is tuple or t is list or t is immutable_list:
                shape.append((t, len(x)))
                if not walk(x):
                    return False
            elif t is dict:
                shape.append((t, tuple(x)))
                if not walk(x.values()):
                    return False
            elif t in _ATOMS or t is float or t is complex or t is slice or isinstance(x, torch.Tensor):
                leaves.append(x)
                shape.append(None)
            else:
                return False  # a pytree node of another kind (dict, namedtuple): pytree's own flattening
        return True

    if not walk(args) or (kwargs and not walk(kwargs.values())):
        return pytree.tree_flatten((args, kwargs))
    return leaves, (len(args), *shape)


class _Like:
    """How to make FakeTensors with a recorded value's metadata (storage offset and size included),
    read once when the call is recorded rather than at each replay."""

    __slots__ = ("device", "dtype", "mode", "offset", "plain", "shape", "size", "stride", "wrap")

    def __init__(self, val):
        self.mode, self.device, self.dtype = val.fake_mode, val.device, val.dtype
        self.wrap = wrapper(self.mode, self.device).wrap
        self.shape, self.stride = val.shape, val.stride()
        self.offset, nbytes = val.storage_offset(), val.untyped_storage().nbytes()
        self.size = nbytes // val.element_size()
        with no_python_dispatcher(), in_kernel_invocation_manager(self.mode):
            meta = aten.empty_strided.default(self.shape, self.stride, dtype=self.dtype, device="meta")
        self.plain = self.offset == 0 and meta.untyped_storage().nbytes() == nbytes

    def meta(self):
        """A meta tensor of this metadata (called under ``in_kernel_invocation_manager``)."""
        if self.plain:
            return aten.empty_strided.default(self.shape, self.stride, dtype=self.dtype, device="meta")
        base = aten.empty.memory_format([self.size], dtype=self.dtype, device="meta")
        return aten.as_strided.default(base, self.shape, self.stride, self.offset)

    def fresh(self, meta, n=2):
        """``n`` new FakeTensors of ``meta``, untraced: one to trace, and the snapshot of it that
        ``node.meta["val"]`` keeps (as make_fx does); only the snapshot (``n=1``) for a value the
        call does not return, which nothing traces. Made as FakeTensorMode makes its own
        (``fast_detach``): a meta tensor wrapped in FakeTensors of the recorded value's mode (each
        wrapper has its own metadata), without a trip through the modes (``graph/fakes.py``)."""
        wrap = self.wrap
        return (wrap(meta), wrap(meta)) if n == 2 else tuple(wrap(meta) for _ in range(n))


def _same_meta(t, val) -> bool:
    return (
        isinstance(val, torch.Tensor)
        and t.shape == val.shape
        and t.stride() == val.stride()
        and t.dtype == val.dtype
        and t.device == val.device
        and t.storage_offset() == val.storage_offset()
    )


def _replayable(node: fx.Node, recorded: set, known: set) -> bool:
    """A copy of recorded ``node`` computes what tracing would: it reads only recorded nodes, the
    call's arguments (``known``) and constants, and its values have static metadata."""
    if node.op != "call_function":
        return False  # get_attr: a constant read inside the call
    if any(a not in recorded and a not in known and a.op != "get_attr" for a in node.all_input_nodes):
        return False  # reads a traced value it was not given
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        if not all(v is None or _static(v) for v in val):
            return False
    elif not _static(val):
        return False
    return node.target is not operator.getitem or (
        node.args[0] in recorded and isinstance(node.args[0].meta["val"], (tuple, list))
    )


def _likes(node: fx.Node):
    """The ``_Like`` of a recorded node's value (a tuple for several); None for a getitem's
    (its replay detaches the item its op's copy made)."""
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        return tuple(None if v is None else _Like(v) for v in val)
    return None if node.target is operator.getitem else _Like(val)


def _base_create_node(tracer):
    """The ``create_node`` a copy of a plain op's node can be made by, or None. make_fx's own
    (``PythonKeyTracer.create_node``) adds to an op's node only what the op's tags ask
    (``eager_input_vals``); a copy of a node that got none is made by the ``fx.proxy.TracerBase``
    method it extends, which sets the rest (the current meta of ``fx.traceback.set_current_meta``,
    sequence numbers): the same node, without asking again."""
    if type(tracer).create_node is proxy_tensor.PythonKeyTracer.create_node and not tracer.check_mutable_operations:
        return fx.proxy.TracerBase.create_node
    return None


def _plain(node: fx.Node) -> bool:
    return node.op == "call_function" and "eager_input_vals" not in node.meta


class _Recording:
    """The nodes one call added, and how its result is made of them."""

    def __init__(self, nodes, inputs, out_leaves, out_spec, mode):
        self.nodes = nodes  # recorded nodes, in graph order
        self.inputs = inputs  # the argument nodes they read (by tensor index)
        self.out_leaves = out_leaves  # ("arg", i) | ("node", node) | ("value", v)
        self.out_spec = out_spec
        self.returned = {x for kind, x in out_leaves if kind == "node"}
        self.mode = mode  # the FakeTensorMode of every recorded value
        self.likes: dict | None = None  # node -> _Like of its value (a tuple for several): on the first replay
        self.kept: dict | None = None  # node -> the meta entries its copies take from it: on the first replay
        self.plain = {node for node in nodes if _plain(node)}  # copies made by ``_base_create_node``

    @classmethod
    def make(cls, nodes, inputs, tensors, out, tracer):
        """The recording of a call, or None if its replay would not be what tracing gives."""
        recorded, known = set(nodes), set(inputs)
        if not all(_replayable(node, recorded, known) for node in nodes):
            return None
        arg_of = {id(t): i for i, t in enumerate(tensors)}
        leaves, spec = pytree.tree_flatten(out)
        out_leaves: list[tuple[str, object]] = []
        holder = {}
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if id(x) in arg_of:
                    out_leaves.append(("arg", arg_of[id(x)]))
                    continue
                slot = proxy_tensor.get_proxy_slot(x, tracer, None)
                if (
                    slot is None
                    or slot.constant is not None
                    or x.requires_grad
                    or slot.proxy.node not in recorded
                    or holder.setdefault(slot.proxy.node, id(x)) != id(x)
                    or not _same_meta(x, slot.proxy.node.meta["val"])
                ):
                    return None
                out_leaves.append(("node", slot.proxy.node))
            else:
                try:
                    _atom_key(x)
                except _Unkeyable:
                    return None  # may hold traced tensors pytree does not see
                out_leaves.append(("value", x))
        vals = [node.meta["val"] for node in nodes]
        modes = {v.fake_mode for val in vals for v in (val if isinstance(val, (tuple, list)) else (val,)) if v is not None}
        if len(modes) > 1:
            return None
        return cls(nodes, inputs, out_leaves, spec, next(iter(modes), None))

    def metas(self, likes: dict) -> dict:
        """A new meta tensor for each recorded value (tuples for several), made in one kernel invocation."""
        if self.mode is None:
            return {}
        with no_python_dispatcher(), in_kernel_invocation_manager(self.mode):
            return {
                node: like.meta() if isinstance(like, _Like) else tuple(None if v is None else v.meta() for v in like)
                for node, like in likes.items()
                if like is not None
            }

    def replay(self, tracer, tensors, nodes):
        """Add copies of the recorded nodes reading ``nodes``; the call's result."""
        env = dict(zip(self.inputs, nodes))
        vals = {}
        likes, kept = self.likes, self.kept
        if likes is None or kept is None:  # read once, when first replayed: many calls recorded never are
            likes = self.likes = {node: _likes(node) for node in self.nodes}
            kept = self.kept = {
                node: [(k, v) for k, v in node.meta.items() if k not in _CREATED or k == "original_aten"] for node in self.nodes
            }
        metas = self.metas(likes)
        base = _base_create_node(tracer)
        for old in self.nodes:
            args, kwargs = fx.node.map_arg((old.args, old.kwargs), lambda n: env.get(n, n))
            if base is not None and old in self.plain:  # arguments checked when recorded: ``copy_args``
                new = copy_args(base(tracer, old.op, old.target, (), {}, name=old.name), args, kwargs)
            else:
                new = tracer.create_node(old.op, old.target, args, kwargs, name=old.name)
            env[old] = new
            val, like = old.meta["val"], likes[old]
            if isinstance(val, (tuple, list)):  # its items are tracked by their getitem copies
                pairs = [(None, None) if v is None else v.fresh(m) for v, m in zip(like, metas[old])]
                vals[old] = type(val)(t for t, _ in pairs)
                new.meta["val"] = type(val)(snapshot for _, snapshot in pairs)
            else:
                if old.target is not operator.getitem and old not in self.returned:
                    (new.meta["val"],) = like.fresh(metas[old], 1)  # a value inside the call: nothing traces it
                else:
                    if old.target is operator.getitem:
                        t = vals[old.args[0]][old.args[1]]
                        snapshot = detached(t)
                    else:
                        t, snapshot = like.fresh(metas[old])
                    vals[old] = t
                    proxy_tensor.track_tensor(t, tracer.proxy(new), constant=None, tracer=tracer)
                    new.meta["val"] = snapshot
            for k, v in kept[old]:  # tensor_meta, the ATen op it was traced from: the same
                if k not in new.meta:
                    new.meta[k] = v
        leaves = [tensors[x] if kind == "arg" else vals[x] if kind == "node" else x for kind, x in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)


class Memo:
    """Memoized calls for one template trace (see the module docstring)."""

    def __init__(self):
        self.recordings: dict = {}  # key -> _Recording, or None for calls that cannot be replayed
        self.hits = 0
        self.misses = 0

    def call(self, fn, /, *args, **kwargs):
        """``fn(*args, **kwargs)``, replayed when an equal call was traced before."""
        mode = proxy_tensor.get_innermost_proxy_mode()
        if not ENABLED.get() or mode is None or fn is operator.getitem or not getattr(fn, "replayable", True):
            return fn(*args, **kwargs)
        tracer = mode.tracer
        # Reading tensor metadata under make_fx's torch-function modes costs a dispatch per read.
        with torch._C.DisableTorchFunction():
            try:
                key, tensors, nodes = _key(fn, args, kwargs, tracer)
            except (_Unkeyable, TypeError):
                key = None
            recording = self.recordings.get(key)
            if recording is not None:
                self.hits += 1
                return recording.replay(tracer, tensors, nodes)
            record = key is not None and key not in self.recordings
            if record:
                last = next(reversed(tracer.graph.nodes), None)
                versions = [t._version for t in tensors]
        if not record:
            return fn(*args, **kwargs)
        self.misses += 1
        out = fn(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            added = []
            for node in reversed(tracer.graph.nodes):
                if node is last:
                    break
                added.append(node)
            added.reverse()
            unchanged = [t._version for t in tensors] == versions  # else it wrote into an argument
            self.recordings[key] = _Recording.make(added, nodes, tensors, out, tracer) if unchanged else None
        return out
