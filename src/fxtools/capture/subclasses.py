"""Tensor subclasses (DTensor) through capture: traced as their local tensors, with collectives.

A program taking DTensors (tensor parallel: ``parallelize_module``'s parameters, ``from_local``
inputs) is captured as a program of their *local* tensors, as AOTAutograd does with PyTorch's
subclass protocol (``__tensor_flatten__`` / ``__tensor_unflatten__``): each DTensor argument
becomes its local tensor, rebuilt into a DTensor inside the traced function, so DTensor's own
dispatch runs while fxtools traces and the graph holds the local ops and the functional
collectives (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce``) its redistributions run. DTensor outputs are returned as their local tensors, and
``LocalView`` rebuilds them (and the DTensor gradients of DTensor arguments) with the placements
eager gives.

**Which derivative.** Each rank's graph is differentiated as a function of its local tensors:
the collectives' rules (``rules/collectives.py``) are their adjoints, so the backward computes the
derivative of the sum over ranks of each rank's objective. DTensor's autograd differentiates the
*global* program instead, and the two meet at the edges of the DTensor region, where the calls of
DTensor's autograd functions are captured as ``custom_vjp`` calls with the rule of eager:

- ``to_local()`` of a DTensor replicated over a mesh dimension of ``n`` ranks gives each rank the
  whole value, and eager takes each rank's gradient of it as the whole gradient: the local
  gradient is ``n`` times the share of one rank, so the rule divides it by ``n``; over a
  ``Partial`` dimension eager takes the ranks' gradients as partial sums, and the rule sums them
  (``all_reduce``). The share ``g / n`` is marked, and the rule of an ``all_reduce`` receiving
  it returns ``g`` itself (the sum of ``n`` equal shares), so no collective runs for it, as none
  runs in eager's backward. (Shares DTensor itself makes, such as a replicated bias split to be
  added to a partial sum, are not recognised: their gradient is all-reduced, where eager's
  backward needs no collective.)
- ``DTensor.from_local(x, mesh, [Replicate()])``: the local gradient of a replicated value is a
  partial sum; eager gives each rank the whole gradient, so the rule all-reduces it.

Ops DTensor computes with handlers of its own (``loss_parallel()``'s log-softmax and NLL loss)
are captured as one custom call each, whose rule is eager's backward handler on the DTensors
(``_EAGER_BACKWARDS``): eager's fused backward, which needs no collective.

Placements fxtools does not handle are refused when the program is built, naming the placement.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError, current_user_line
from ..signature.naming import record_mesh_dims
from . import custom
from .patching import patched
from .replicated import assert_replicated
from .replicated import replicated as is_replicated

__all__ = [
    "DTensorInside",
    "GradPlacements",
    "Layout",
    "LocalView",
    "dtensor_functions",
    "is_dtensor_step",
    "is_mesh",
    "is_subclass",
    "refuse_subclass_arguments",
    "local_view",
    "shared_replica",
]

_functional = torch.ops._c10d_functional


def _dtensor():
    """The DTensor class, if the program's process imported it (no DTensor exists otherwise:
    programs without one pay no import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_mesh(x) -> bool:
    """Whether ``x`` is a DeviceMesh: a description of ranks (its rank table is a tensor of ints the
    program reads as one), taken as a constant of the program."""
    mesh = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    return mesh is not None and isinstance(x, mesh)


def is_dtensor_step(node) -> bool:
    """Whether a captured node is a step of a DTensor program's local graph whose rule is the
    *global* program's (eager DTensor's): a functional collective, an edge of the DTensor region
    (``from_local``, ``to_local``, a replicated value's shares) or an op with eager's backward
    handler. Their rules are adjoints across the ranks, not of each rank's local function."""
    target = getattr(node, "target", None)
    if getattr(target, "namespace", None) == "_c10d_functional":
        return True
    kind = getattr(target, "kind", None)
    return isinstance(target, custom.CustomCall) and getattr(getattr(kind, "fn", None), "_fxtools_dtensor", False)


def is_subclass(x) -> bool:
    """Whether ``x`` is a DTensor (the tensor subclass fxtools traces as its local tensor)."""
    cls = _dtensor()
    return cls is not None and isinstance(x, cls)


class SubclassError(FxtoolsError):
    """A tensor subclass, or a placement of one, that fxtools cannot trace."""


class DTensorInside(Exception):  # noqa: N818 - a signal to capture, not an error
    """Raised while a program is traced above autograd and makes a DTensor: capture traces it
    again below autograd, where DTensor's dispatch runs."""


_ABOVE_AUTOGRAD: contextvars.ContextVar[bool] = contextvars.ContextVar("fxtools_dtensor_above_autograd", default=False)


@dataclass(frozen=True)
class Layout:
    """What a DTensor is besides its local tensor: its class, the non-tensor parts (the mesh), the
    flatten context (placements, global metadata), its global size and strides. Layouts compare
    equal when a graph made for one serves the other."""

    cls: type
    others: tuple  # (name, value) of the non-tensor inner parts (the DeviceMesh)
    ctx: Any
    size: tuple
    stride: tuple

    @classmethod
    def of(cls, x) -> Layout:
        names, ctx = x.__tensor_flatten__()
        inner = [n for n in names if isinstance(getattr(x, n), torch.Tensor)]
        if inner != ["_local_tensor"]:
            raise SubclassError(f"fxtools traces DTensors as their one local tensor; this one has {inner}")
        _check_placements(x.placements)
        record_mesh_dims(x.device_mesh)  # collectives over its groups are named after its dimensions
        others = tuple((n, getattr(x, n)) for n in names if n not in inner)
        return cls(type(x), others, ctx, tuple(x.shape), tuple(x.stride()))

    @property
    def placements(self) -> tuple:
        return self.ctx[0]

    @property
    def mesh(self):
        return dict(self.others)["device_mesh"]

    def grad_layout(self, partial: set[str] | frozenset[str] = frozenset()) -> Layout:
        """The layout of the gradient eager gives this DTensor (and of the cotangent an output's
        graph takes): a Partial dimension's is whole (Replicate); a replicated dimension's is a
        pending sum if its group is among ``partial`` (``GradPlacements``)."""
        from torch.distributed.tensor import Partial, Replicate

        def grad(d, p):
            if p.is_partial():
                return Replicate()
            return Partial() if p.is_replicate() and self.mesh.get_group(d).group_name in partial else p

        placements = tuple(grad(d, p) for d, p in enumerate(self.placements))
        return Layout(self.cls, self.others, (placements, *self.ctx[1:]), self.size, self.stride)

    def key(self) -> tuple:
        """What a cached graph is specialised to (the mesh by identity)."""
        return (self.cls, tuple(id(v) for _, v in self.others), self.ctx[:-1], self.size, self.stride)

    def wrap(self, local: torch.Tensor, requires_grad: bool | None = None):
        """The DTensor with this layout around ``local``."""
        ctx = self.ctx if requires_grad is None else (*self.ctx[:-1], requires_grad)
        return self.cls.__tensor_unflatten__(  # type: ignore[attr-defined]
            {"_local_tensor": local, **dict(self.others)}, ctx, self.size, self.stride
        )


def _check_placements(placements) -> None:
    """Refuse placements whose local form fxtools does not differentiate."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    for p in placements:
        ok = type(p) in (Shard, Replicate) or (type(p) is Partial and p.reduce_op == "sum")
        if not ok:
            raise SubclassError(
                f"fxtools does not differentiate DTensors placed as {p} (at {current_user_line() or 'an argument'}): "
                "it handles Shard, Replicate and Partial('sum'); see docs/security.md#known-gaps"
            )


def refuse_subclass_arguments(names: list[str], leaves: list) -> None:
    """DTensor arguments reach capture only as their local tensors (``LocalView``, which
    ``fxtools.compile`` and the backend use); a transform given one refuses it, naming it."""
    for name, x in zip(names, leaves):
        if is_subclass(x):
            raise SubclassError(
                f"argument {name} is a DTensor: fxtools.compile and torch.compile(backend=fxtools.backend()) train "
                "programs taking DTensors; the other transforms take plain tensors (pass x.to_local() or "
                "x.full_tensor()). See docs/security.md#known-gaps"
            )


def local(x):
    """The local tensor of a DTensor, anything else as it is."""
    return x._local_tensor if is_subclass(x) else x


class LocalView:
    """``fn(*args)`` with DTensor leaves as a function of their local tensors.

    ``args(args)`` are the arguments with DTensors replaced by their local tensors;
    ``function(fn)`` takes those and rebuilds the DTensors before calling ``fn`` (DTensor outputs
    are returned as local tensors, their layouts kept in ``out_layouts``); ``key`` is what a graph
    made for ``args`` is specialised to besides the local tensors' own guards."""

    def __init__(self, args):
        leaves = pytree.tree_leaves(tuple(args))
        self.layouts = [Layout.of(x) if is_subclass(x) else None for x in leaves]
        self.tensor_layouts = [lay for lay, x in zip(self.layouts, leaves) if isinstance(x, torch.Tensor)]
        self.key = tuple(None if lay is None else lay.key() for lay in self.layouts)
        # which replicated dimensions of each DTensor argument's gradient eager leaves pending sums
        self.grad_placements = [None if lay is None else GradPlacements() for lay in self.layouts]
        self.tensor_grad_placements = [g for g, x in zip(self.grad_placements, leaves) if isinstance(x, torch.Tensor)]
        self.out_layouts: list = []  # of every output leaf (None: not a DTensor)
        self.out_tensor_layouts: list = []  # of the tensor output leaves
        self.fn: Any = None  # the program (``function``)

    def args(self, args) -> tuple:
        """``args`` with each DTensor replaced by its local tensor (requiring grad as the DTensor does)."""

        def plain(x):
            return x._local_tensor.detach().requires_grad_(x.requires_grad) if is_subclass(x) else x

        return tuple(pytree.tree_map_only(torch.Tensor, plain, tuple(args)))

    def function(self, fn):
        layouts = self.layouts
        self.fn = fn  # the program of DTensors, run again by a differentiable backward

        def local_fn(*args):
            leaves, spec = pytree.tree_flatten(args)
            with dtensor_functions():
                full = [
                    leaf if lay is None else lay.wrap(_argument(leaf, lay, grad), False)
                    for leaf, lay, grad in zip(leaves, layouts, self.grad_placements)
                ]
                out = fn(*pytree.tree_unflatten(full, spec))
            out_leaves, out_spec = pytree.tree_flatten(out)
            self.out_layouts = [Layout.of(o) if is_subclass(o) else None for o in out_leaves]
            self.out_tensor_layouts = [lay for lay, o in zip(self.out_layouts, out_leaves) if isinstance(o, torch.Tensor)]
            out_leaves = [o if lay is None else _output(local(o), lay) for o, lay in zip(out_leaves, self.out_layouts)]
            return pytree.tree_unflatten(out_leaves, out_spec)

        local_fn.__fxtools_below_autograd__ = True  # type: ignore[attr-defined]  # a marker the capture reads
        for attr in ("__signature__", "__name__", "__fxtools_module__", "__fxtools_input_kinds__"):
            if hasattr(fn, attr):
                setattr(local_fn, attr, getattr(fn, attr))
        return local_fn


def _argument(x, layout: Layout, grad: GradPlacements | None):
    """A DTensor argument's local tensor, its gradient over the replicated dimensions whole or a
    pending sum as eager gives it (``grad``: which)."""
    replicated = _groups(layout.mesh, layout.placements, lambda p: p.is_replicate())
    return _FROM_LOCAL(x, tuple(replicated), (), grad) if replicated else x


def _output(x, layout: Layout):
    """A DTensor output's local tensor; its cotangent (``grad_placements`` of the layout) is each
    rank's share over the replicated dimensions."""
    replicated = _groups(layout.mesh, layout.placements, lambda p: p.is_replicate())
    return _TO_LOCAL(x, tuple(replicated), (), None) if replicated else x


def local_view(args) -> LocalView | None:
    """A ``LocalView`` of ``args`` if any of their leaves is a DTensor, else None."""
    if _dtensor() is None or not any(is_subclass(x) for x in pytree.tree_leaves(tuple(args))):
        return None
    return LocalView(args)


# ---------------------------------------------------------------------------------------------
# The edges of the DTensor region: DTensor's autograd functions with eager's rule


def _groups(mesh, placements, which) -> list[tuple[str, int]]:
    """(group name, size) of the mesh dimensions whose placement satisfies ``which``."""
    return [(mesh.get_group(d).group_name, mesh.size(d)) for d, p in enumerate(placements) if which(p)]


def _all_reduce(t, group: str, op: str = "sum"):
    return _functional.wait_tensor(_functional.all_reduce(t, op, group))


# a cache of the shares to_local's rule made, by identity: id(share) -> (weakref to it, whole gradient, group)
_SHARES: dict[int, tuple] = {}


def shared_replica(ct, group: str):
    """If ``ct`` is ``g / n``, the share of one of ``n`` ranks holding the same gradient ``g`` of a
    replicated value over ``group`` (made by ``to_local``'s rule), then ``g``, else None."""
    found = _SHARES.get(id(ct))
    if found is None or found[0]() is not ct or found[2] != group:
        return None
    return found[1]


class GradPlacements:
    """The mesh dimensions (by group name) over which a replicated argument's gradient is left a
    pending sum (``Partial``), as eager leaves it where it is computed from sharded values."""

    def __init__(self):
        self.partial: set[str] = set()


def _summed(ct, group: str, n: int, grad: GradPlacements | None):
    """The sum over ``group`` of the ranks' cotangents ``ct`` of a replicated value: ``g`` for the
    shares ``g / n`` of a replicated ``g``, ``n * ct`` for a replicated ``ct`` (no collective);
    else left a pending sum for an argument (``grad``, as eager leaves it), or all-reduced."""
    whole = shared_replica(ct, group)
    if whole is not None:
        return whole
    if is_replicated(ct, group):
        return ct * n
    if grad is not None:
        grad.partial.add(group)
        return ct
    return _all_reduce(ct, group)


def _shares(ct, replicated):
    """The shares ``ct / n`` of the ranks of each group of ``replicated`` (``(name, n)``) in a
    cotangent ``ct`` every one of them holds whole (as eager DTensor takes it, unchecked), marked
    so that summing them over the group gives ``ct`` itself (``shared_replica``)."""
    assert_replicated(ct, [group for group, _ in replicated])
    for group, n in replicated:
        whole, ct = ct, ct / n
        for key in [k for k, v in _SHARES.items() if v[0]() is None]:
            del _SHARES[key]
        _SHARES[id(ct)] = (weakref.ref(ct), whole, group)
    return ct


def _partition(x, group, n):
    return x / n


def _partition_fwd(x, group, n):
    return x / n, (group, n)


def _partition_bwd(res, ct):
    return _shares(ct, [res]), None, None


# DTensor's Replicate -> Partial("sum") (a replicated bias added to partial sums): each rank's
# share of the value; its cotangent, a Partial value's, is the same on every rank
_partition._fxtools_dtensor = True  # type: ignore[attr-defined]
_PARTITION = custom.custom_vjp(_partition)
_PARTITION.defvjp(_partition_fwd, _partition_bwd)


@contextlib.contextmanager
def _partitions_as_shares():
    """While capturing: ``Partial("sum")._partition_value`` (how DTensor turns a replicated value
    into partial sums) through ``_PARTITION``, whose backward marks the shares it makes."""
    from torch.distributed.tensor import Partial

    original = Partial._partition_value

    def partition(self, tensor, mesh, mesh_dim):
        if type(self) is not Partial or self.reduce_op != "sum":
            return original(self, tensor, mesh, mesh_dim)
        return _PARTITION(tensor, mesh.get_group(mesh_dim).group_name, mesh.size(mesh_dim))

    with patched(Partial, _partition_value=partition):
        yield


# ---------------------------------------------------------------------------------------------
# Ops DTensor computes with handlers of its own (``loss_parallel()``'s log-softmax and NLL loss):
# one custom call each, whose backward is eager's, the op's derivative formula on DTensors. Their
# local ops alone would be differentiated as each rank's share: the logsumexp's maximum and the
# one-hot target's sum would need collectives eager's fused backward does without.

_aten = torch.ops.aten


def _log_softmax_backward(handlers, op, args, grads, outs):
    # loss_parallel()'s handler of _log_softmax_backward_data passes the cotangent through: the
    # NLL loss's backward, fused, computed the log-softmax's (as in eager)
    return local(grads[0]).to(args[0].dtype), grads[0].placements


def _nll_loss_backward(handlers, op, args, grads, outs):
    back = _BACKWARD_OPS[op]
    grad = handlers[back](back, (grads[0], *args[:5], outs[1]), {})
    return local(grad), grad.placements


_BACKWARD_OPS = {  # whose handlers eager's backward runs (those of loss_parallel())
    _aten._log_softmax.default: _aten._log_softmax_backward_data.default,
    _aten.nll_loss_forward.default: _aten.nll_loss_backward.default,
    _aten.nll_loss2d_forward.default: _aten.nll_loss2d_backward.default,
}
_EAGER_BACKWARDS = {
    _aten._log_softmax.default: _log_softmax_backward,
    _aten.nll_loss_forward.default: _nll_loss_backward,
    _aten.nll_loss2d_forward.default: _nll_loss_backward,
}


def _with_eager_backward(handlers: dict, handler):
    """``handler`` (DTensor's, of an op in ``_EAGER_BACKWARDS``) as one ``custom_vjp`` call of its
    arguments' local tensors, whose rule dispatches the op's backward on DTensors (``handlers``)."""

    def handle(op, args, kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_pos = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
        specs = [getattr(leaves[i], "_spec", None) for i in tensor_pos]
        out_specs: list = []

        def rebuild(locals_, specs_):
            return [t if sp is None else _dtensor()(t, sp, requires_grad=False) for t, sp in zip(locals_, specs_)]

        def arguments(tensors):
            full = list(leaves)
            for i, t in zip(tensor_pos, rebuild(tensors, specs)):
                full[i] = t
            return pytree.tree_unflatten(full, spec)

        def call(*tensors):
            outs = handler(op, *arguments(tensors))
            outs = list(outs) if isinstance(outs, tuple) else [outs]
            out_specs[:] = [getattr(o, "_spec", None) for o in outs]
            return tuple(local(o) for o in outs)

        def fwd(*tensors):
            outs = call(*tensors)
            return outs, (tensors, outs)

        def bwd(res, cts):
            tensors, outs = res
            a, _ = arguments(tensors)
            cts = [ct if sp is None else _eager_cotangent(ct, sp) for ct, sp in zip(cts, out_specs)]
            grad, placements = _EAGER_BACKWARDS[op](handlers, op, a, rebuild(cts, out_specs), rebuild(outs, out_specs))
            return (_local_cotangent(grad, specs[0], placements), *(None for _ in tensors[1:]))

        call.__name__ = _snake_op(op)
        call._fxtools_dtensor = True  # type: ignore[attr-defined]
        fn = custom.custom_vjp(call)
        fn.defvjp(fwd, bwd)
        outs = fn(*(local(leaves[i]) for i in tensor_pos))
        wrapped = rebuild(list(outs), out_specs)
        return tuple(wrapped) if len(wrapped) > 1 else wrapped[0]

    return handle


def _eager_cotangent(ct, spec):
    """The cotangent eager's backward takes for a DTensor output (whole over its replicated mesh
    dimensions) from each rank's share of it (``capture/subclasses.py``'s derivative: of the sum
    over ranks)."""
    for group, n in _groups(spec.mesh, spec.placements, lambda p: p.is_replicate()):
        ct = _summed(ct, group, n, None)
    return ct


def _local_cotangent(grad, spec, placements):
    """Each rank's share of the gradient eager's backward gives a DTensor argument (``spec``):
    over a replicated mesh dimension where eager's gradient is whole, ``1 / n`` of it."""
    groups = _groups(spec.mesh, spec.placements, lambda p: True)
    shared = [g for g, q, p in zip(groups, spec.placements, placements) if q.is_replicate() and p.is_replicate()]
    return _shares(grad, shared) if shared else grad


def _snake_op(op) -> str:
    return op._schema.name.split("::")[-1].strip("_")


@contextlib.contextmanager
def _eager_backwards():
    """While capturing: the ops of ``_EAGER_BACKWARDS`` DTensor has handlers for (while
    ``loss_parallel()`` is active) as custom calls with eager's backward."""
    handlers = _dtensor()._op_dispatcher._custom_op_handlers
    originals = {op: handlers[op] for op in _EAGER_BACKWARDS if op in handlers and _BACKWARD_OPS[op] in handlers}
    snapshot = dict(handlers)
    for op, handler in originals.items():
        handlers[op] = _with_eager_backward(snapshot, handler)
    try:
        yield
    finally:
        for op, handler in originals.items():
            if op in handlers:
                handlers[op] = handler


def _edge(kind: str):
    """A ``custom_vjp`` identity whose rule is eager's at an edge of the DTensor region."""

    def fun(x, replicated, partial, grad):
        if kind == "from_local":  # a value eager takes as replicated, unchecked (differentiated or not)
            assert_replicated(x, [group for group, _ in replicated])
        return x

    def fwd(x, replicated, partial, grad):
        return fun(x, replicated, partial, grad), (replicated, partial, grad)

    def bwd(res, ct):
        replicated, partial, grad = res
        if ct is None:
            return None, None, None, None
        if kind == "from_local":
            for group, n in replicated:
                ct = _summed(ct, group, n, grad)
            return ct, None, None, None
        ct = _shares(ct, replicated)
        for group, _ in partial:
            ct = _all_reduce(ct, group)
        return ct, None, None, None

    fun.__name__ = f"dtensor_{kind}"
    fun._fxtools_dtensor = True  # type: ignore[attr-defined]
    edge = custom.custom_vjp(fun)
    edge.defvjp(fwd, bwd)
    return edge


_FROM_LOCAL = _edge("from_local")
_TO_LOCAL = _edge("to_local")


def _from_local(apply, x, mesh, placements, *rest):
    if _ABOVE_AUTOGRAD.get():
        raise DTensorInside
    _check_placements(placements)
    replicated = _groups(mesh, placements, lambda p: p.is_replicate())
    if replicated:
        x = _FROM_LOCAL(x, tuple(replicated), (), None)
    return apply(x, mesh, placements, *rest)


def _to_local(apply, x, grad_placements=None):
    placements = tuple(grad_placements or x.placements)
    _check_placements(placements)
    out = apply(x, grad_placements)
    replicated = _groups(x.device_mesh, placements, lambda p: p.is_replicate())
    partial = _groups(x.device_mesh, placements, lambda p: p.is_partial())
    if replicated or partial:
        out = _TO_LOCAL(out, tuple(replicated), tuple(partial), None)
    return out


@contextlib.contextmanager
def dtensor_functions(pre_dispatch: bool = False):
    """While capturing: DTensor's ``from_local`` / ``to_local`` with eager's rules at the edges of
    the DTensor region, its other autograd functions (redistributions) traced into their local
    ops and collectives. ``pre_dispatch``: the trace is above autograd, where DTensors cannot be
    traced; making one raises ``DTensorInside``."""
    if _dtensor() is None:  # pragma: no cover - builds without torch.distributed
        yield
        return
    from torch.distributed.tensor import _api, _redistribute

    handlers = {
        _api._FromTorchTensor: _from_local,
        _api._ToTorchTensor: _to_local,
        _redistribute.Redistribute: None,
    }
    exporting = torch.compiler._is_exporting_flag
    if not pre_dispatch:  # DTensors are made as in eager, not recorded as export records them
        torch.compiler._is_exporting_flag = False
    token = _ABOVE_AUTOGRAD.set(pre_dispatch)
    try:
        with custom.function_handlers(handlers), _partitions_as_shares(), _eager_backwards():
            yield
    finally:
        torch.compiler._is_exporting_flag = exporting
        _ABOVE_AUTOGRAD.reset(token)
