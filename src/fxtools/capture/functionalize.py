"""Remove in-place ops from a captured graph, so that it can be differentiated.

The captured (pre-dispatch, not functionalised) graph may contain mutating ATen overloads:
``y.add_(1)``, ``x.squeeze_(0)``, ``z[0].mul_(3)``, ``out[:, 1] = v`` (``copy_`` on a view),
``torch.relu_``, ``y.as_strided_(size, stride)``... ``functionalize`` rewrites them on the graph:

- A mutation of a tensor that the function *created* (an intermediate) becomes its functional
  counterpart (``add_`` -> ``add``, ``copy_(dst, src)`` -> ``src`` cast and expanded to
  ``dst``, ``fill_`` -> ``full``, ``index_put_`` -> ``index_put``, ...). When the mutated tensor
  is a view, the new value is written back into its base with the scatter form of each view
  (``select`` -> ``select_scatter``, ``slice`` -> ``slice_scatter``, ``view`` -> reshape back,
  ``transpose`` -> transpose back, ...), and every later use of any alias of that base (the base
  itself, views taken before the mutation) reads a view regenerated from the new base.
  Aliasing is read off the FakeTensors of the trace: two values alias when they share storage.
  A copy standing for a view (``meta.VIEW_COPY``: ``x[t]`` with a 0-dim tensor ``t``) is first
  kept in step with its base by explicit in-place writes (``_keep_view_copies_in_step``).
- A mutation of a graph input or of a tensor the function closes over (a module's buffers, such
  as BatchNorm's ``num_batches_tracked``) stays in place, so the caller sees it exactly as in
  eager mode. Such a mutation must not take part in differentiation: if it does (it writes a
  value computed from a differentiated input) differentiation stops with an error naming the op
  and the user's line. Reads of that tensor made before the mutation by ops whose backward may
  keep their arguments read a snapshot (``clone``) instead, so the backward sees the values the
  forward saw.

An ``out=`` variant writing one intermediate becomes its functional overload (``sum.IntList_out``
-> ``sum.dim_IntList``), written as above; an empty ``out`` tensor takes the result's shape.
Anything else (mutation through an expanded or otherwise unsupported view, ``out=`` with several
outputs, ``set_``, resizing a non-empty tensor...) raises ``FxtoolsError`` naming the op and the line.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import FxtoolsError, user_line_of
from ..graph import meta
from ..graph.data_dependent import materialize
from ..graph.nodes import fake_mode_of, is_float
from ..registry import Rule, differentiable_nodes, is_nondifferentiable
from ..signature.naming import identifier, short_op

aten = torch.ops.aten

__all__ = ["functionalize", "InplaceError", "kept_input_writes"]


class InplaceError(FxtoolsError):
    """An in-place op fxtools cannot turn into functional code without changing its gradient.

    ``written_input``: for a differentiable write into a graph input (kept in place, see the
    module docstring), the position of that input among the graph's placeholders, else None. A
    caller owning the inputs (``torch.compile``'s backend) can then compute the new value out of
    place and copy it into the input itself, as AOTAutograd does (``training/backend.py``)."""

    written_input: int | None = None
    where: str | None = None  # the user's line of the in-place op, when known


# ---------------------------------------------------------------------------------------------
# Schema helpers


def _is_op(target) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def _written_args(op) -> list[int]:
    """Positions of the schema arguments an op writes to (``Tensor(a!)``)."""
    return [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def is_mutating(node: fx.Node) -> bool:
    return node.op == "call_function" and _is_op(node.target) and bool(_written_args(node.target))


def _is_view_op(op) -> bool:
    """Ops whose output aliases their input without writing it (``view``, ``select``, ``split``...).

    ``_unsafe_view`` too: its schema declares no alias (autograd does not track it as a view), but
    its result shares its input's storage; vmap's batching rules reshape their fresh results with it
    (``mm(...)._unsafe_view(...)``), and an in-place op of the program on that result (``y.add_(b)``
    after ``F.linear`` under ``torch.func.vmap``) writes the same memory."""
    if op is aten._unsafe_view.default:
        return True
    if not _is_op(op) or op._schema.is_mutable:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def _returns_written(op) -> bool:
    """In-place ops that return the tensor they write (``mul_``: ``buf.mul_(0.9).add_(x)`` chains)."""
    return (
        _is_op(op)
        and _written_args(op) == [0]
        and any(r.alias_info is not None and r.alias_info.is_write for r in op._schema.returns)
    )


def _arg_names(op):
    return [a.name for a in op._schema.arguments]


_SPECIAL_FUNCTIONAL = {
    aten.normal_.default: aten.normal_functional.default,
}


_NO_FUNCTIONAL = {
    "set_",
    "resize_",
    "resize_as_",
    "resize_as_sparse_",
    "sparse_resize_",
    "sparse_resize_and_clear_",
    "requires_grad_",
    "retain_grad",
}


def _functional_of(op):
    """The out-of-place overload computing what in-place ``op`` writes, or None."""
    if op._schema.name.split("::")[-1] in _NO_FUNCTIONAL:
        return None
    if op in _SPECIAL_FUNCTIONAL:
        return _SPECIAL_FUNCTIONAL[op]
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None:
        return None
    names = _arg_names(op)
    types = [str(a.type) for a in op._schema.arguments]
    candidates = [op._overloadname] + [o for o in packet.overloads() if o != op._overloadname]
    for ov in candidates:
        if ov not in packet.overloads():
            continue
        f = getattr(packet, ov)
        if (
            _arg_names(f)[1:] == names[1:]
            and [str(a.type) for a in f._schema.arguments] == types
            and not f._schema.is_mutable
            and len(f._schema.returns) == 1
        ):
            return f
    return None


def _functional_of_out(op):
    """The overload computing what ``out=`` variant ``op`` writes into its one ``out`` argument
    (``sum.IntList_out`` -> ``sum.dim_IntList``: the same arguments without ``out``), or None."""
    written = _written_args(op)
    args = op._schema.arguments
    if len(written) != 1 or not args[written[0]].kwarg_only or len(op._schema.returns) != 1:
        return None
    kept = [(a.name, str(a.type)) for i, a in enumerate(args) if i != written[0]]
    packet = getattr(aten, op._schema.name.split("::")[-1], None)
    for ov in packet.overloads() if packet is not None else ():
        f = getattr(packet, ov)
        if (
            not f._schema.is_mutable
            and len(f._schema.returns) == 1
            and [(a.name, str(a.type)) for a in f._schema.arguments] == kept
        ):
            return f
    return None


# ---------------------------------------------------------------------------------------------
# Graph helpers


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def _storage(val):
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except Exception:  # noqa: BLE001 - tensors without storage cannot alias anything
        return None


def _closed_over_storages(gm: fx.GraphModule):
    """``_storage`` that knows which values live in a closed-over tensor's memory.

    Each read of a closed-over real tensor (a ``get_attr`` node) gets its own FakeTensor, and so
    do views of it (``buf[0]``, ``buf.detach()``): their fake storages differ, though the tensors
    share memory when the code runs. Each is mapped to the real tensor's storage, so that a write
    through a view (``buf[0].add_(1)``, ``buf.data.add_(1)``) is seen as a write to the buffer.
    """
    canonical: dict = {}
    for node in gm.graph.nodes:
        st = _storage(_val(node))
        if st is None:
            continue
        if node.op == "get_attr":
            real = getattr(gm, node.target, None)
            if isinstance(real, torch.Tensor) and not isinstance(real, torch._subclasses.FakeTensor):
                real_st = _storage(real)
                if real_st is not None:
                    canonical[st] = real_st
            continue
        src = node.args[0] if node.op == "call_function" and node.args else None
        if isinstance(src, fx.Node) and src.op == "call_function" and node.target is operator.getitem:
            src = src.args[0] if _is_view_op(src.target) and src.args else None
        elif not (node.op == "call_function" and (_is_view_op(node.target) or _returns_written(node.target))):
            src = None
        if isinstance(src, fx.Node) and _storage(_val(src)) in canonical:
            canonical[st] = canonical[_storage(_val(src))]

    def storage(val):
        st = _storage(val)
        return canonical.get(st, st)

    return storage


def _where(node) -> str:
    return user_line_of(node) or "an unknown line"


def _error(node, why: str) -> InplaceError:
    return InplaceError(
        f"in-place {node.target} (from {_where(node)}): {why}.\n"
        "Write the computation out of place (for example `y = y + 1` instead of `y.add_(1)`, "
        "or torch.where / index_put instead of item assignment)."
    )


class _Builder:
    """Creates nodes before a given node, with FakeTensor values and the user's stack trace."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.fake_mode = fake_mode_of(graph)
        self.before: fx.Node | None = None  # the node new nodes go before
        self.trace: str | None = None  # the stack trace they get
        self.made: set[fx.Node] = set()  # the nodes it created

    def __call__(self, target, *args, **kwargs):
        if self.before is not None:  # symbolic sizes (``expand`` to a dynamic shape) as nodes
            args, kwargs = materialize(self.graph, self.before, (args, kwargs))
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args, kwargs)
        self.made.add(node)
        vals, kvals = fx.node.map_arg((args, kwargs), _val)
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*vals, **kvals)
        else:  # pragma: no cover - captured graphs always carry FakeTensors
            node.meta["val"] = target(*vals, **kvals)
        if self.trace:
            node.meta["stack_trace"] = self.trace
        if self.before is not None and "custom" in self.before.meta:  # e.g. checkpoint regions
            node.meta["custom"] = self.before.meta["custom"]
        return node

    def cast_like(self, value, like):
        """``value`` converted to the dtype and broadcast to the shape of FakeTensor ``like``."""
        v = _val(value)
        if v.dtype != like.dtype:
            value = self(aten._to_copy.default, value, dtype=like.dtype)
            v = _val(value)
        if tuple(v.shape) != tuple(like.shape):
            value = self(aten.expand.default, value, list(like.shape))
        return value


# ---------------------------------------------------------------------------------------------
# Views: how to redo a view on a new base, and how to write a new view value back


_SHAPE_ONLY = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten._reshape_alias.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.view_as.default,
    aten.reshape_as.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.alias.default,
    aten.contiguous.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten.to.other,
    aten.type_as.default,
    aten.lift_fresh.default,
    aten.expand.default,
    aten.expand_as.default,
    aten.view_as_real.default,
    aten.view_as_complex.default,
}
_INVOLUTIONS = {aten.t.default, aten.numpy_T.default, aten.mT.default}
_TRANSPOSES = {aten.transpose.int, aten.swapdims.default, aten.swapaxes.default}
_SPLITS = {
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.tensor_split.sections,
    aten.tensor_split.indices,
    aten.unsafe_split.Tensor,
    aten.unsafe_split_with_sizes.default,
    aten.hsplit.int,
    aten.vsplit.int,
}


class _Step:
    """One view op applied to its first argument (and, for multi-output views, an index)."""

    def __init__(self, target, args, kwargs, index=None, multi_val=None):
        self.target, self.args, self.kwargs, self.index = target, tuple(args), dict(kwargs), index
        self.multi_val = multi_val  # the list of FakeTensors of a multi-output view op

    def apply(self, b: _Builder, parent):
        """The view regenerated from ``parent``'s current value."""
        if self.target is aten.as_strided.default and isinstance(self.args[0], fx.Node):
            return _as_strided_on(b, parent, _val(self.args[0]), self.args[1:], self.kwargs)
        node = b(self.target, parent, *self.args[1:], **self.kwargs)
        if self.index is not None:
            node = b(operator.getitem, node, self.index)
        return node

    def arg(self, i, name, default):
        """The view op's argument ``i`` (keyword ``name``), or ``default``."""
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(name, default)

    def scatter(self, b: _Builder, parent, child, pval, cval, mutation):
        """The new value of ``parent`` once its view (this step) holds ``child``."""
        write = _Write(b, parent, child, pval, cval, mutation)
        scatter = _SCATTERS.get(self.target)
        if scatter is None:
            raise write.cannot(self)
        return scatter(self, write)


class _Write:
    """A write through one view: ``child``, the view's new value, goes into ``parent``.
    ``pval`` and ``cval`` are their FakeTensors, ``mutation`` the in-place op (for errors)."""

    def __init__(self, b: _Builder, parent, child, pval, cval, mutation):
        self.b, self.parent, self.child, self.pval, self.cval, self.mutation = b, parent, child, pval, cval, mutation

    def cannot(self, step: _Step) -> InplaceError:
        return _error(self.mutation, f"it writes through a view made by {step.target}, which fxtools cannot write back")


# How to write a view's new value back into its parent: one function per kind of view op.


def _scatter_shape_only(s: _Step, w: _Write):
    if w.pval.dtype != w.cval.dtype or w.pval.is_complex() != w.cval.is_complex():
        raise _error(w.mutation, f"writing through a {s.target} view that changes the dtype is not supported")
    if tuple(w.pval.shape) == tuple(w.cval.shape):
        return w.child
    if s.target in (aten.expand.default, aten.expand_as.default):
        raise _error(w.mutation, "it writes through an expanded view, where several elements share memory")
    return w.b(aten.reshape.default, w.child, list(w.pval.shape))


def _scatter_view_as_real(s: _Step, w: _Write):  # the complex tensor whose (real, imag) pairs the view holds
    return w.b(aten.view_as_complex.default, w.b(aten.contiguous.default, w.child))


def _scatter_view_as_complex(s: _Step, w: _Write):
    return w.b(aten.view_as_real.default, w.child)


def _scatter_same(s: _Step, w: _Write):
    return w.child


def _scatter_select(s: _Step, w: _Write):
    return w.b(aten.select_scatter.default, w.parent, w.child, s.arg(1, "dim", 0), s.arg(2, "index", 0))


def _scatter_slice(s: _Step, w: _Write):
    dim, start, end, step = s.arg(1, "dim", 0), s.arg(2, "start", None), s.arg(3, "end", None), s.arg(4, "step", 1)
    if isinstance(end, int) and end >= sys.maxsize:  # ``x[1:]``: to the end, at every size
        end = None
    return w.b(aten.slice_scatter.default, w.parent, w.child, dim, start, end, step)


def _scatter_narrow(s: _Step, w: _Write):
    dim, start, length = s.args[1], s.args[2], s.args[3]
    start = start + w.pval.shape[dim] if start < 0 else start
    return w.b(aten.slice_scatter.default, w.parent, w.child, dim, start, start + length, 1)


def _scatter_diagonal(s: _Step, w: _Write):
    offset, dim1, dim2 = s.arg(1, "offset", 0), s.arg(2, "dim1", 0), s.arg(3, "dim2", 1)
    return w.b(aten.diagonal_scatter.default, w.parent, w.child, offset, dim1, dim2)


def _scatter_transpose(s: _Step, w: _Write):
    return w.b(aten.transpose.int, w.child, s.args[1], s.args[2])


def _scatter_involution(s: _Step, w: _Write):
    if w.cval.is_complex():
        raise w.cannot(s)
    return w.b(s.target, w.child)


def _scatter_permute(s: _Step, w: _Write):
    dims = [d % w.pval.dim() for d in s.args[1]]
    inverse = [dims.index(i) for i in range(len(dims))]
    return w.b(aten.permute.default, w.child, inverse)


def _scatter_movedim(s: _Step, w: _Write):
    return w.b(s.target, w.child, s.args[2], s.args[1])


def _scatter_unbind(s: _Step, w: _Write):
    return w.b(aten.select_scatter.default, w.parent, w.child, s.arg(1, "dim", 0), s.index)


def _scatter_split(s: _Step, w: _Write):
    if s.multi_val is None:
        raise w.cannot(s)
    dim = s.arg(2, "dim", 0)
    if s.target is aten.hsplit.int:
        dim = 1 if w.pval.dim() > 1 else 0
    if s.target is aten.vsplit.int:
        dim = 0
    dim %= w.pval.dim()
    start = sum(v.shape[dim] for v in s.multi_val[: s.index])
    return w.b(aten.slice_scatter.default, w.parent, w.child, dim, start, start + w.cval.shape[dim], 1)


def _scatter_complex_part(s: _Step, w: _Write):  # one part of a complex tensor: the other kept
    if not w.pval.is_complex():
        return w.child  # .real of a real tensor is the tensor itself
    if s.target is aten.real.default:
        return w.b(aten.complex.default, w.child, w.b(aten.imag.default, w.parent))
    return w.b(aten.complex.default, w.b(aten.real.default, w.parent), w.child)


def _scatter_as_strided(s: _Step, w: _Write):
    """Write through the flat positions the view covers (as_strided_scatter's gradient in
    PyTorch does not give the gradient of this write)."""
    pval, b = w.pval, w.b
    order = _memory_order(pval)
    if order is None:
        raise w.cannot(s)
    size, stride, offset = _as_strided_args(s.args[1:], s.kwargs, pval)
    if not _within(pval, size, stride, offset):
        raise w.cannot(s)
    positions = b(aten.arange.default, pval.numel(), dtype=torch.int64, device=pval.device)
    index = b(aten.as_strided.default, positions, size, stride, offset - pval.storage_offset())
    in_memory = b(aten.permute.default, w.parent, order) if order != list(range(pval.dim())) else w.parent
    flat = b(aten.index_put.default, b(aten.reshape.default, in_memory, [-1]), [index], w.child)
    value = b(aten.reshape.default, flat, [pval.shape[d] for d in order])
    return b(aten.permute.default, value, _inverse(order)) if order != list(range(pval.dim())) else value


def _refuse_partial_overlap(node: fx.Node, written, args, storage) -> None:
    """An in-place op reading memory that partly overlaps the memory it writes (``y[1:].mul_(y[:-1])``)
    has no defined result: eager's depends on its kernel's order (PyTorch refuses it where it can
    tell), so it is refused rather than computed from the values before the write."""
    st = storage(written)
    if st is None:
        return
    for arg in pytree.tree_leaves((args, node.kwargs)):
        val = _val(arg)
        if val is written or not isinstance(val, torch.Tensor) or storage(val) != st:
            continue
        if _overlap_partly(written, val):
            raise _error(
                node,
                "some elements it reads and some it writes are the same memory (a view of the value "
                "written), so the result depends on the order the kernel runs in; eager PyTorch "
                "refuses this where it can tell. Clone the input first (`y[1:].mul_(y[:-1].clone())`)",
            )


def _overlap_partly(a, b) -> bool:
    """Whether strided views ``a`` and ``b`` of one storage share some elements but are not the
    same view (the same view, as in ``x.mul_(x)``, is fine)."""
    layouts = [(t.storage_offset(), list(t.shape), list(t.stride())) for t in (a, b)]
    if not all(isinstance(n, int) for n in pytree.tree_leaves(layouts)):
        return False  # symbolic sizes: reading them as numbers would specialise the graph
    la, lb = layouts
    if la == lb or a.numel() == 0 or b.numel() == 0:
        return False
    spans = [(o, o + sum((n - 1) * abs(d) for n, d in zip(shape, stride))) for o, shape, stride in (la, lb)]
    if spans[0][1] < spans[1][0] or spans[1][1] < spans[0][0]:
        return False
    end = max(spans[0][1], spans[1][1]) + 1
    if end > 1 << 24:
        return True  # too large to list: the spans meet
    with unset_fake_temporarily():
        every = torch.arange(end)
        ia = torch.as_strided(every, la[1], la[2], la[0]).reshape(-1)
        ib = torch.as_strided(every, lb[1], lb[2], lb[0]).reshape(-1)
        return bool(torch.isin(ia, ib).any())


def _memory_order(val) -> list[int] | None:
    """``val``'s dimensions from outermost to innermost in memory, when ``val`` covers a span of
    its storage densely (else None): ``val.permute(order)`` lists its storage in order."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    if not is_non_overlapping_and_dense_or_false(val):
        return None
    return sorted(range(val.dim()), key=lambda d: -val.stride(d) if val.shape[d] != 1 else 0)


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return inv


def _as_strided_args(args, kwargs, base_val):
    """``(size, stride, storage_offset)`` of an ``as_strided`` call (the offset defaults to the base's)."""
    size, stride = list(args[0]), list(args[1])
    offset = args[2] if len(args) > 2 else kwargs.get("storage_offset")
    return size, stride, base_val.storage_offset() if offset is None else offset


def _within(val, size, stride, offset) -> bool:
    """Whether an ``as_strided`` view reads only the storage span ``val`` covers."""
    if any(n == 0 for n in size):
        return True
    last = offset + sum((n - 1) * st for n, st in zip(size, stride))
    return offset >= val.storage_offset() and last < val.storage_offset() + val.numel() and min(stride, default=0) >= 0


def _as_strided_on(b: _Builder, value, like, args, kwargs):
    """``as_strided`` of ``like`` (a FakeTensor of the trace), taken on ``value``, the node now
    holding its values: a functional rewrite may lay them out differently (``copy_(dst, src)``
    becomes ``src``, with ``src``'s strides), and ``as_strided`` reads memory, so ``value`` is
    first laid out in ``like``'s memory order."""
    vval = _val(value)
    size, stride, offset = _as_strided_args(args, kwargs, like)
    if tuple(vval.stride()) == tuple(like.stride()) and vval.storage_offset() == like.storage_offset():
        return b(aten.as_strided.default, value, size, stride, offset)
    order = _memory_order(like)
    if order is None or not _within(like, size, stride, offset):
        raise _error(
            b.before,
            "it reads a tensor's memory through as_strided after an in-place op on that tensor; fxtools "
            "computes the modified tensor out of place, with another memory layout",
        )
    dense = b(aten.clone.default, b(aten.permute.default, value, order), memory_format=torch.contiguous_format)
    return b(aten.as_strided.default, dense, size, stride, offset - like.storage_offset())


_SCATTERS = {
    **dict.fromkeys(_SHAPE_ONLY, _scatter_shape_only),
    aten.view_as_real.default: _scatter_view_as_real,
    aten.view_as_complex.default: _scatter_view_as_complex,
    aten.detach.default: _scatter_same,
    aten.detach_.default: _scatter_same,
    aten.select.int: _scatter_select,
    aten.slice.Tensor: _scatter_slice,
    aten.narrow.default: _scatter_narrow,
    aten.diagonal.default: _scatter_diagonal,
    **dict.fromkeys(_TRANSPOSES, _scatter_transpose),
    **dict.fromkeys(_INVOLUTIONS, _scatter_involution),
    aten.permute.default: _scatter_permute,
    **dict.fromkeys((aten.movedim.int, aten.movedim.intlist, aten.moveaxis.int, aten.moveaxis.intlist), _scatter_movedim),
    aten.unbind.int: _scatter_unbind,
    **dict.fromkeys(_SPLITS, _scatter_split),
    aten.real.default: _scatter_complex_part,
    aten.imag.default: _scatter_complex_part,
    aten.as_strided.default: _scatter_as_strided,
}


# ---------------------------------------------------------------------------------------------
# The pass


class _Alias:
    """What fxtools knows about a value that lives in an intermediate's storage."""

    __slots__ = ("parent", "step", "storage", "version")

    def __init__(self, storage, parent, step, version):
        self.storage = storage  # StorageWeakRef of the base
        self.parent = parent  # original node this is a view of (None: the base itself)
        self.step = step  # _Step from parent, or None for the base / an opaque alias
        self.version = version  # version of the storage when this value was made


class _Opaque(Exception):
    pass


def _kept_mutation_rule(node: fx.Node) -> Rule:
    """Rule for an in-place op kept on an input or buffer: it must carry no gradient."""
    op, where = node.target, _where(node)
    written = _written_placeholder(_arg_at(node, _written_args(op)[0]))

    def fwd(*args, **kwargs):
        err = InplaceError(
            f"in-place {op} (from {where}) writes to a function input or a closed-over tensor "
            "and takes part in differentiation (it writes, or writes into, a value that depends "
            "on a differentiated input). fxtools keeps such mutations in place so the caller sees "
            "them, and cannot differentiate through them without a wrong gradient.\n"
            "Compute the new value out of place and return it, or do the update under "
            "torch.no_grad() / on .detach()ed values."
        )
        err.written_input, err.where = written, where
        raise err

    def bwd(aux, ct):  # pragma: no cover - fwd always raises
        raise AssertionError("unreachable")

    return Rule(fwd, bwd, "fxtools-inplace")


def kept_input_writes(gm: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    """The in-place ops ``functionalize`` kept on graph inputs of ``gm`` that must carry no
    gradient, each with the position of the input it writes among the placeholders (writes into
    closed-over tensors, and ops only updating statistics on the side, are not listed)."""
    found = []
    for node in gm.graph.nodes:
        rule = meta.RULE.get(node) if node.op == "call_function" else None
        if getattr(rule, "source", None) == "fxtools-inplace" and is_mutating(node):
            i = _written_placeholder(_arg_at(node, _written_args(node.target)[0]))
            if i is not None:
                found.append((node, i))
    return found


def _written_placeholder(target) -> int | None:
    """The position among its graph's placeholders of the input ``target`` is (or is a view of,
    through view ops and in-place ops returning it only), else None."""
    while isinstance(target, fx.Node) and target.op == "call_function" and target.args:
        if is_mutating(target) and _returns_written(target.target):
            target = _arg_at(target, _written_args(target.target)[0])
        elif _is_view_op(target.target) or target.target is operator.getitem:
            target = target.args[0]
        else:
            return None
    if not (isinstance(target, fx.Node) and target.op == "placeholder"):
        return None
    return [n for n in target.graph.nodes if n.op == "placeholder"].index(target)


def _maybe_differentiable(gm: fx.GraphModule, differentiated: Sequence[bool] | None = None) -> set:
    """Nodes that depend differentiably on a floating-point input the transform differentiates
    (``differentiated``: one bool per placeholder; None: any of them)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    marks = [True] * len(placeholders) if differentiated is None else list(differentiated)
    if len(marks) != len(placeholders):
        raise FxtoolsError(f"internal error: {len(marks)} differentiated marks for {len(placeholders)} inputs")
    wrt = {n for n, d in zip(placeholders, marks) if d and is_float(n.meta.get("val"))}
    return differentiable_nodes(gm, wrt)


def functionalize(gm: fx.GraphModule, differentiated: Sequence[bool] | None = None) -> fx.GraphModule:
    """Rewrite in-place ops on intermediates into functional ops (see the module docstring).

    ``differentiated``: one bool per placeholder, whether the transform differentiates it (None:
    each may be). An input written in place under ``no_grad`` is refused only where it may carry a
    gradient: a buffer passed as an argument the transform holds constant (running statistics)
    is updated as in eager.

    Changes ``gm`` in place and returns it. Raises ``InplaceError`` (an ``FxtoolsError``) naming
    the op and the user's line for in-place code it cannot rewrite without changing gradients.
    """
    if not any(is_mutating(n) for n in gm.graph.nodes):
        return gm
    _keep_view_copies_in_step(gm)
    _Functionalizer(gm, differentiated).run()
    gm.graph.lint()
    gm.recompile()
    return gm


def _keep_view_copies_in_step(gm: fx.GraphModule) -> None:
    """Make in-place writes see through the copies that stand for views (``meta.VIEW_COPY``:
    ``x[t]`` with a 0-dim tensor ``t``, ``narrow`` with a tensor start, computed by ``aten.index``
    / ``index_select``), as they see through the views eager returns.

    After each write into a copy's memory (``v.mul_(2)``, ``v[0] = 1``) the copy is put back into
    its base (``index_put_`` / ``index_copy_``); after each write into the base's memory the copy,
    when read later, is gathered again from the base (``copy_``). These are ordinary in-place ops,
    rewritten below like the user's. A copy fxtools could not write back (``False``) is refused
    instead, naming the write."""
    copies = [n for n in gm.graph.nodes if meta.VIEW_COPY.on(n)]
    if not copies or not any(is_mutating(n) for n in gm.graph.nodes):
        return
    storage = _closed_over_storages(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_read: dict = {}
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            st = storage(_val(a))
            if st is not None:
                last_read[st] = max(last_read.get(st, -1), order[n])
    for copy in reversed(copies):  # a copy read later through a copy of it is read later too
        st_copy, st_base = storage(_val(copy)), storage(_val(copy.args[0]))
        last_read[st_base] = max(last_read.get(st_base, -1), last_read.get(st_copy, -1))
    b = _Builder(gm.graph)
    live: list[tuple[fx.Node, object, object]] = []  # (copy, its storage, its base's storage)
    for node in list(gm.graph.nodes):
        if node in copies and isinstance(node.args[0], fx.Node):
            live.append((node, storage(_val(node)), storage(_val(node.args[0]))))
        if not is_mutating(node) or not live:
            continue
        b.before, b.trace = node.next, node.meta.get("stack_trace")
        pending: list[tuple[fx.Node, tuple | None]] = [(node, None)]
        while pending:
            write, made = pending.pop(0)
            written = {storage(_val(_arg_at(write, i))) for i in _written_args(write.target)} - {None}
            for copy, st_copy, st_base in live:
                if st_copy in written and made != ("gathered", copy):
                    if not meta.VIEW_COPY.get(copy):
                        raise _copy_not_written_back(node, copy)
                    pending.append((_put_back(b, copy), ("put back", copy)))
                if st_base in written and made != ("put back", copy) and last_read.get(st_copy, -1) > order[node]:
                    if not meta.VIEW_COPY.get(copy):
                        raise _copy_not_written_back(node, copy)
                    again = b(copy.target, *copy.args, **copy.kwargs)
                    pending.append((b(aten.copy_.default, copy, again), ("gathered", copy)))


def _put_back(b: _Builder, copy: fx.Node) -> fx.Node:
    """``copy``'s current value written into its base, where eager's view of it lives."""
    if copy.target is aten.index_select.default:
        base, dim, index = copy.args[:3]
        return b(aten.index_copy_.default, base, dim, index, copy)
    base, indices = copy.args[:2]
    return b(aten.index_put_.default, base, indices, copy)


def _copy_not_written_back(write: fx.Node, copy: fx.Node) -> InplaceError:
    return _error(
        write,
        f"it writes into the result of indexing with a 0-dim tensor or of narrow with a tensor start "
        f"(from {_where(copy)}), or into the tensor it indexes, while that result is still used; eager returns a view "
        "there, which fxtools computes as a copy and cannot keep in step here (under vmap). Write with "
        "index_put / index_copy, or clone the indexed value",
    )


class _Functionalizer:
    """One ``functionalize`` pass: walks the graph in order, keeping what it knows of each
    storage (its aliases, its current value, how many times it was modified), and rewrites or
    keeps each in-place op as it comes."""

    def __init__(self, gm: fx.GraphModule, differentiated: Sequence[bool] | None = None):
        self.gm = gm
        self.maybe_need = _maybe_differentiable(gm, differentiated)
        self.b = _Builder(gm.graph)
        self.storage = _closed_over_storages(gm)
        self.input_storages: dict = {}  # storage -> placeholder / get_attr node owning it
        self.aliases: dict[fx.Node, _Alias] = {}
        self.base: dict = {}  # intermediate storage -> the node that created it
        self.latest: dict = {}  # intermediate storage -> node holding the base's current value
        self.version: dict = {}  # intermediate storage -> number of mutations so far
        self.opaque: set = set()  # intermediate storages with aliases fxtools cannot regenerate
        self.cache: dict = {}  # (node, version) -> regenerated node
        self.repl: dict[fx.Node, fx.Node] = {}  # original node -> node holding its value (when not stale)
        self.original: dict = {}  # node -> its arguments before they were remapped
        self.to_erase: list[fx.Node] = []
        self.kept: list[fx.Node] = []  # in-place ops left on inputs and buffers
        self.grad_enabled = True
        # storages a differentiable op has read so far (an op whose backward may save them)
        self.read_differentiably: set = set()

    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            self.visit(node)
        for node in reversed(self.to_erase):
            if node.users:
                raise _error(node, "internal error: a rewritten in-place op is still used")
            self.gm.graph.erase_node(node)
        if self.kept:
            _mark_reads_after_writes(self.gm, self.kept, self.storage)
            _snapshot_reads(self.gm, self.kept, self.b, self.storage)

    def visit(self, node: fx.Node) -> None:
        """Read ``node``'s arguments at their current values; record it, keep it or rewrite it."""
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            self.grad_enabled = bool(node.args[0])
            return
        orig_args = self.original[node] = node.args
        self.remap(node)
        if node.target is aten.as_strided.default and node.args[0] is not orig_args[0]:
            self.b.before, self.b.trace = node, node.meta.get("stack_trace")
            relaid = _as_strided_on(self.b, node.args[0], _val(orig_args[0]), node.args[1:], node.kwargs)
            node.replace_all_uses_with(relaid)
            self.repl[node] = relaid
            self.to_erase.append(node)
            return
        if not is_mutating(node):
            self.register(node)
            self.note_reads(node)
            return
        self.b.before, self.b.trace = node, node.meta.get("stack_trace")
        written = _written_args(node.target)
        target = _arg_at(node, written[0], orig_args)
        st = self.storage(_val(target))
        _refuse_partial_overlap(node, _val(target), orig_args, self.storage)
        if st is None or st in self.input_storages or not isinstance(target, fx.Node):
            self.keep(node, written, st)
        else:
            self.rewrite(node, target, st)

    def note_reads(self, node: fx.Node) -> None:
        """Record the storages a differentiable op reads (views, ``detach`` and ``getitem`` read
        nothing: their users do)."""
        if (
            node.op != "call_function"
            or node not in self.maybe_need
            or node.target is operator.getitem
            or _is_view_op(node.target)
            or is_nondifferentiable(node.target)
        ):
            return
        unread = _values_unread_by_backward(node)
        for a in node.all_input_nodes:
            st = self.storage(_val(a))
            if st is not None and a not in unread:
                self.read_differentiably.add(st)

    # -- values and aliases

    def current(self, node):
        """The node holding ``node``'s value at this point of the program."""
        if not isinstance(node, fx.Node):
            return node
        info = self.aliases.get(node)
        if info is None or info.version == self.version[info.storage]:
            return self.repl.get(node, node)
        if info.parent is None:
            if info.step is not None:
                raise _Opaque(node)
            return self.latest[info.storage]
        key = (node, self.version[info.storage])
        if key not in self.cache:
            self.cache[key] = info.step.apply(self.b, self.current(info.parent))
        return self.cache[key]

    def remap(self, node: fx.Node) -> None:
        try:
            node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), self.current)
        except _Opaque as e:
            raise _error_use(e.args[0], node) from None

    def register(self, node: fx.Node) -> None:
        """Record storage facts for a node that is not an in-place op."""
        st = self.storage(node.meta.get("val"))
        if st is None:
            return
        if node.op in ("placeholder", "get_attr"):
            self.input_storages.setdefault(st, node)
            return
        if st in self.input_storages:
            return
        if st not in self.latest:
            self.latest[st], self.version[st], self.base[st] = node, 0, node
            self.aliases[node] = _Alias(st, None, None, 0)
            return
        parent, step = self.view_parent(node, st)
        if parent is None:
            self.opaque.add(st)
            self.aliases[node] = _Alias(st, None, _Step(node.target, (), {}), self.version[st])
        else:
            self.aliases[node] = _Alias(st, parent, step, self.version[st])

    def view_parent(self, node: fx.Node, st):
        """``(parent, step)`` when ``node`` is a view of ``parent`` (a known alias of ``st``), else ``(None, None)``."""
        if node.op != "call_function":
            return None, None
        args = self.original.get(node, node.args)
        if node.target is operator.getitem:
            multi = args[0]
            if not (isinstance(multi, fx.Node) and multi.op == "call_function" and _is_view_op(multi.target)):
                return None, None
            margs = self.original.get(multi, multi.args)
            if isinstance(margs[0], fx.Node) and self.storage(_val(margs[0])) == st and margs[0] in self.aliases:
                return margs[0], _Step(multi.target, margs, multi.kwargs, args[1], _val(multi))
            return None, None
        if (
            _is_view_op(node.target)
            and args
            and isinstance(args[0], fx.Node)
            and self.storage(_val(args[0])) == st
            and args[0] in self.aliases
        ):
            return args[0], _Step(node.target, args, node.kwargs)
        return None, None

    # -- in-place ops

    def keep(self, node: fx.Node, written: list[int], st) -> None:
        """An in-place op on an input or buffer stays (see ``_keep``)."""
        if st is None and not all(self.storage(_val(_arg_at(node, i))) in self.input_storages for i in written):
            raise _error(node, "fxtools cannot tell which tensor it modifies")
        read_before = any(self.storage(_val(_arg_at(node, i))) in self.read_differentiably for i in written)
        _keep(node, written, self.maybe_need, self.grad_enabled, read_before)
        self.kept.append(node)

    def rewrite(self, node: fx.Node, target: fx.Node, st) -> None:
        """An in-place op on an intermediate (``target``, in storage ``st``) becomes functional."""
        if node.target is aten.copy_.default and target in self.aliases and self.same_memory(target, self.original[node][1]):
            # ``x[i] += v`` copies the sum, already in ``x[i]``, there again (``__setitem__``): no write
            self.repl[node] = self.current(target)
            self.aliases[node] = self.aliases[target]
            self.to_erase.append(node)
            return
        info = self.rewritable(node, target, st)
        kind, func = _rewrite_kind(node)
        if kind == "view" and func is aten.as_strided.default:  # reads memory: laid out as the trace's tensor was
            orig = self.original[node]
            self.repl[node] = _as_strided_on(self.b, node.args[0], _val(orig[0]), node.args[1:], node.kwargs)
            self.aliases[node] = _Alias(st, target, _Step(func, orig, node.kwargs), self.version[st])
            self.to_erase.append(node)
            return
        if kind == "view":
            self.repl[node] = self.b(func, *node.args, **node.kwargs)
            self.aliases[node] = _Alias(st, target, _Step(func, node.args, node.kwargs), self.version[st])
            self.to_erase.append(node)
            return
        tval = _val(target)
        if kind == "out" and tuple(tval.shape) != tuple(_val(node).shape):
            if tval.numel() or info.parent is not None or info.step is not None:
                raise _error(
                    node, f"out= resizes a tensor that is not empty or is a view ({list(tval.shape)} to {list(_val(node).shape)})"
                )
            tval = _val(node)  # an empty out= tensor takes the result's shape, as in eager
        value = _functional_value(self.b, node, func, tval, self.input_storages, self.storage)
        value = self.b.cast_like(value, tval)
        self.latest[st] = self.write_back(node, value, target)
        if meta.WRITES.on(node) and self.latest[st] in self.b.made:  # h[0] = v: the new h, h_1
            self.latest[st]._rename(identifier(meta.WRITES.get(node)))
        if value is not self.latest[st]:
            self.name_step(node, value)  # h[0] *= 2: h_mul
        self.version[st] += 1
        self.aliases[node] = _Alias(st, info.parent, info.step, self.version[st])
        self.repl[node] = value
        self.to_erase.append(node)

    def name_step(self, node: fx.Node, made) -> None:
        """A value computed here for the in-place statement ``node`` is named after the variable the
        statement writes and its op (``h_mul``, ``h_slice_scatter``), not after the op alone."""
        if meta.WRITES.on(node) and made in self.b.made:
            made._rename(identifier(f"{meta.WRITES.get(node)}_{short_op(made)}"))

    def same_memory(self, a, b) -> bool:
        """Whether the tensors ``a`` and ``b`` are the same elements of one storage, laid out alike."""
        va, vb = _val(a), _val(b) if isinstance(b, fx.Node) else None
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or va.dtype != vb.dtype:
            return False
        if self.storage(va) is None or self.storage(va) != self.storage(vb):
            return False
        pairs = [(va.storage_offset(), vb.storage_offset()), *zip(va.shape, vb.shape), *zip(va.stride(), vb.stride())]
        return va.dim() == vb.dim() and all(statically_known_true(x == y) for x, y in pairs)

    def rewritable(self, node: fx.Node, target: fx.Node, st) -> _Alias:
        """What is known of ``target``, after checking that a functional rewrite keeps gradients."""
        if (_written_args(node.target) != [0] or len(node.target._schema.returns) != 1) and _functional_of_out(
            node.target
        ) is None:
            raise _error(node, "only ops that modify their first argument or one out= tensor can be rewritten")
        if st in self.opaque:
            raise _error(node, "it modifies a tensor with an alias (view) fxtools cannot follow")
        if _functional_of_out(node.target) is not None and self.grad_enabled:
            if any(a in self.maybe_need for a in pytree.tree_leaves(self.original[node]) if isinstance(a, fx.Node)):
                raise _error(node, "as in eager autograd, an out= argument is refused when an input carries a gradient")
        info = self.aliases.get(target)
        if info is None:
            raise _error(node, "fxtools cannot tell how the modified tensor relates to its base")
        if self.base[st] in self.maybe_need and (not self.grad_enabled or _through_detach(target, self.aliases)):
            raise _error(
                node,
                "it modifies a value that carries a gradient under torch.no_grad() or "
                "through .detach() or .data; its gradient would be that of the old value, "
                "which a functional rewrite cannot reproduce",
            )
        return info

    def write_back(self, node: fx.Node, value, target: fx.Node):
        """The base's new value once ``target`` (the base, or a view of it) holds ``value``:
        written back through the chain of views with each one's scatter."""
        child, cur = value, target
        while self.aliases[cur].parent is not None:
            a = self.aliases[cur]
            parent = a.parent
            child = a.step.scatter(self.b, self.current(parent), child, _val(parent), _val(cur), node)
            self.name_step(node, child)  # h[1:, ::2] = v: h_slice_scatter, then h_1
            cur = parent
        if self.aliases[cur].step is not None:
            raise _error(node, "it modifies a tensor with an alias (view) fxtools cannot follow")
        return child


def _error_use(alias, user) -> InplaceError:
    return InplaceError(
        f"{user.target if user.op != 'output' else 'the output'} (from {_where(user)}) reads {alias.name}, "
        f"a view of a tensor that was later modified in place, and fxtools cannot recompute that "
        f"view ({alias.target}) from the modified tensor. Write the computation out of place."
    )


def _rewrite_kind(node: fx.Node):
    """How an in-place op on an intermediate is rewritten: ``("view", f)`` when it only changes
    the tensor's view (``squeeze_``: ``f`` makes the new view), else ``("data", f)`` with ``f``
    its out-of-place overload (None for ``copy_``)."""
    op = node.target
    func = _functional_of(op)
    if op is aten.copy_.default:
        return "data", None
    if _functional_of_out(op) is not None:
        return "out", _functional_of_out(op)
    if op in (aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default):
        return "data", func
    if func is None:
        raise _error(node, "fxtools knows no out-of-place version of this op")
    if not _is_view_op(func):
        return "data", func
    return "view", func


def _arg_at(node, i, args=None):
    args = node.args if args is None else args
    if i < len(args):
        return args[i]
    name = node.target._schema.arguments[i].name
    return node.kwargs.get(name)


def _through_detach(node, aliases) -> bool:
    while node is not None:
        if node.op == "call_function" and node.target in (aten.detach.default, aten.detach_.default):
            return True
        info = aliases.get(node)
        node = info.parent if info is not None else None
    return False


def _detached_input(node):
    """The input or buffer that ``node`` is a ``detach()`` (``.data``) of, possibly through
    views, else None."""
    detached = False
    while isinstance(node, fx.Node) and node.op == "call_function":
        detached = detached or node.target in (aten.detach.default, aten.detach_.default)
        if not (_is_view_op(node.target) or node.target is operator.getitem) or not node.args:
            return None
        node = node.args[0]
    return node if detached and isinstance(node, fx.Node) else None


def _functional_value(b: _Builder, node, func, tval, input_storages, _storage):
    """The new value of the written tensor, computed out of place."""
    op, args, kwargs = node.target, node.args, node.kwargs
    if _functional_of_out(op) is not None:
        out = op._schema.arguments[_written_args(op)[0]].name
        return b(func, *args, **{k: v for k, v in kwargs.items() if k != out})
    if op is aten.copy_.default:
        src = args[1]
        st = _storage(_val(src))
        if st is not None and st in input_storages:
            # the source may itself be modified in place later: copy it now
            src = b(aten.clone.default, src)
        return b.cast_like(src, tval)
    if op is aten.zero_.default:
        return b(aten.full.default, list(tval.shape), 0, dtype=tval.dtype, device=tval.device, pin_memory=False)
    if op is aten.fill_.Scalar:
        return b(aten.full.default, list(tval.shape), args[1], dtype=tval.dtype, device=tval.device, pin_memory=False)
    if op is aten.fill_.Tensor:
        return b.cast_like(args[1], tval)
    # the out-of-place overload may lack the in-place one's defaults (bernoulli_.float's p=0.5)
    args = list(args)
    for a in op._schema.arguments[len(args) :]:
        if a.kwarg_only or a.name in kwargs or not a.has_default_value():
            break
        args.append(a.default_value)
    return b(func, *args, **kwargs)


def _values_unread_by_backward(node: fx.Node) -> tuple:
    """Arguments whose values ``node``'s backward never reads: an embedding's weight (its gradient
    is a scatter of the output's by the indices; ``per_sample_weights``' gradient would read it).
    A write into such an argument after the op does not change the op's gradient, so one
    ``nn.Embedding(max_norm=...)`` may be called twice, renormalising between the calls."""
    if node.target is aten.embedding.default:
        return (node.args[0],)
    if node.target is aten._embedding_bag.default and _arg_at(node, 6) is None:
        return (node.args[0],)
    return ()


def _side_effect_only(op) -> bool:
    """Ops that return fresh values and update some arguments on the side (BatchNorm's running
    statistics in ``_native_batch_norm_legit``): their outputs are differentiated by their own
    rule; the updates, as in eager autograd, carry no gradient."""
    return all(r.alias_info is None for r in op._schema.returns) and bool(op._schema.returns)


def _keep(node, written, maybe_need, grad_enabled, read_before=True):
    """An in-place op on an input or buffer stays; it must not carry a gradient.

    A write through ``.detach()`` / ``.data`` into an input that may be differentiated
    (``F.embedding``'s ``max_norm`` renormalises the weight so) is exact when no differentiable
    op whose backward reads the input's values read it before (``read_before`` False): every later op reads the written
    memory and its gradient reaches the input, as in eager. After such a read, eager's gradient
    depends on what its backward saved, and the write is refused."""
    if _side_effect_only(node.target):
        return
    meta.RULE.set(node, _kept_mutation_rule(node))
    target = _arg_at(node, written[0])
    if read_before and _detached_input(target) in maybe_need:
        raise _error(
            node,
            "it modifies, through .detach() or .data, an input that may be differentiated: "
            "eager autograd does not see the write, but the tensors it saved for the "
            "backward do, so the gradient depends on what autograd happens to save",
        )
    if not grad_enabled and isinstance(target, fx.Node) and target in maybe_need and node.users:
        raise _error(
            node,
            "it modifies, under torch.no_grad(), an input that may be differentiated, and "
            "the modified value is used afterwards; its gradient would be that of the "
            "input, which fxtools cannot reproduce",
        )


def _mark_reads_after_writes(gm: fx.GraphModule, kept: list, _storage) -> None:
    """Record on each kept in-place op the later nodes reading the memory it writes
    (``meta.READ_AFTER_WRITE``): a read of the written input goes through its placeholder, so the
    graph alone does not say that the write reaches what the read computes."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    for node in kept:
        written = {_storage(_val(_arg_at(node, i))) for i in _written_args(node.target)} - {None}
        readers = tuple(
            n
            for n in nodes[position[node] + 1 :]
            if n not in kept
            and not (n.op == "call_function" and is_nondifferentiable(n.target))  # buf.detach()
            and any(_storage(_val(a)) in written and _detached_input(a) is None for a in n.all_input_nodes)
        )
        if readers:
            meta.READ_AFTER_WRITE.set(node, readers)


def _snapshot_reads(gm: fx.GraphModule, kept: list, b: _Builder, _storage) -> None:
    """Differentiable ops reading an input before it is modified in place read a copy instead.

    Their backward runs after the whole forward, so it would otherwise see the modified values.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_write: dict = {}
    for node in kept:
        for i in _written_args(node.target):
            st = _storage(_val(_arg_at(node, i)))
            if st is not None:
                last_write[st] = max(last_write.get(st, -1), order[node])
    need = _maybe_differentiable(gm)
    for node in list(graph.nodes):
        if (
            node not in need
            or node.op != "call_function"
            or node.target is operator.getitem
            or meta.RULE.on(node)
            or _is_view_op(node.target)
        ):
            continue
        b.before, b.trace = node, node.meta.get("stack_trace")
        snaps = {}
        own = {_arg_at(node, i) for i in _written_args(node.target)} if is_mutating(node) else set()

        def snap(a):
            if not isinstance(a, fx.Node) or a in own:
                return a
            st = _storage(_val(a))
            if st is None or last_write.get(st, -1) < order[node]:
                return a
            if a not in snaps:
                snaps[a] = b(aten.clone.default, a)
            return snaps[a]

        node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), snap)
