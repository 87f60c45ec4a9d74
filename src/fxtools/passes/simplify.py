"""Simplification passes that make generated graphs read like hand-written code.

They work on the ATen graph, where every node carries its FakeTensor value
(``node.meta['val']``), and run to a fixed point:

- algebraic identities: ``x * 1``, ``x / 1``, ``-(-x)``, ``x * -1 -> -x``, ``x - 0`` and
  ``x + (-0.0)``, where "1" is anything known to be a tensor full of ones (``ones_like``, an
  expanded one, ...);
- fills folded into numbers (``t * ones_like(loss) / n`` -> ``t * 0.25``);
- no-op shape ops: view/reshape/expand/squeeze/conversion to the same shape and dtype,
  a view of a view, a transpose of a transpose, a permute of a permute;
- common subexpressions (never of random or mutating ops);
- dead code (keeping ops that mutate buffers, such as BatchNorm's running statistics);
- backward kernels' ``output_mask`` reduced to the results that are used.

Every rewrite is exact: the simplified graph computes bit for bit what the graph it replaces
computes, for every input (overflow, NaN, infinities and signed zeros included) and on every
device, or the rewrite is not applied. So some identities of real numbers are not used:

- ``x + 0 -> x`` (and ``0 + x``, ``x - (-0.0)``): ``-0.0 + 0`` is ``+0.0``; only ``x - 0`` and
  ``x + (-0.0)`` are ``x`` for every float ``x`` (integers: every zero);
- ``(t * a) * b -> t * (a * b)``, even for powers of two: ``(x * 2) * 0.5`` overflows to inf at
  3e38 in float32, and ``(x * 0.5) * 2`` loses the last bit of subnormal ``x``;
- ``a + b * c -> addcmul(a, b, c)`` (``transforms/forward.py``): the kernel may round once (fused multiply-add);
- a division by a fill or a 0-dim tensor becomes a division by a number only when the number's
  reciprocal is exact (a power of two): CUDA divides by a number as a multiplication by its
  rounded reciprocal, and by a tensor exactly; likewise a fill divided by a number is folded
  only when both give the same result (the fill is 0 or ±1, or the divisor a power of two).

Rewrites that are exact: ``x * 1``, ``x / 1`` (also at NaN, inf, -0.0), ``x * -1 -> -x``,
``-(-x)``, transposes and permutes that compose to the identity (or are it), no-op views and conversions,
fills (NaN and infinities included: the code says ``x * nan``) computed in the node's dtype op
by op as PyTorch would, ``sum(x, all dims) -> sum(x)``.
"""

from __future__ import annotations

import math
import operator
import re
import sys

import torch
import torch.fx as fx
from torch._dispatch.python import no_python_dispatcher
from torch._prims_common import is_contiguous_or_false
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..graph import meta
from ..graph.data_dependent import broadcasts_into, materialize, same_shape, shape_arg, sizes_from_inputs
from ..graph.fakes import wrapper
from ..graph.nodes import (
    STATEFUL_NORMS,
    ancestors,
    fake_mode_of,
    has_generic_name,
    is_impure,
    is_input_leaf,
    reads_tracked_tensor,
)
from .subgraphs import drop_unused_subgraphs, subgraphs

aten = torch.ops.aten

_VIEWS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.alias.default,
    aten.flatten.using_ints,
    aten.detach.default,
}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CONVERSIONS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default}
_CONSTANT_FILLS = {
    aten.ones_like.default: 1,
    aten.zeros_like.default: 0,
    aten.ones.default: 1,
    aten.zeros.default: 0,
    aten.new_ones.default: 1,
    aten.new_zeros.default: 0,
}


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def _same_type(a, b) -> bool:
    va, vb = _val(a), _val(b)
    return (
        isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and same_shape(va.shape, vb.shape) and va.dtype == vb.dtype
    )


class _Rewriter:
    """What the rewrites share while ``identities`` runs over one graph: the fake mode that gives
    new nodes their values, and the fill values found so far.

    The fill values are remembered because a deep model's residual stream is a chain of adds that
    each question would walk again. That is sound while the graph changes: the nodes answered are
    at or before the node being rewritten, and rewriting a node changes only its users' arguments.
    One rewriter serves every sweep of a ``simplify``: between sweeps (``next_sweep``) the numbers
    found are kept (a node filled with a number stays so under exact rewrites) and the unknowns
    forgotten (a later rewrite of an argument may make one known).
    """

    def __init__(self, graph: fx.Graph):
        self.fake_mode = fake_mode_of(graph)
        self._known: dict[fx.Node, object] = {}

    def next_sweep(self) -> None:
        """Forget the nodes found not to be fills (see the class docstring)."""
        self._known = {n: v for n, v in self._known.items() if v is not None}

    def constant(self, node):
        """The number a tensor node is known to be filled with, else None.

        Fills (``ones_like``, ``full``, ...), their views and conversions, and arithmetic of them
        with numbers (``-ones_like(loss) / 2``). The number is rounded to the node's dtype, so
        using it in place of the tensor computes exactly the same.
        """
        if not isinstance(node, fx.Node):
            return None
        if node not in self._known:
            self._known[node] = self._rounded_fill(node)
        return self._known[node]

    def _rounded_fill(self, node: fx.Node):
        value = _fill_value(node, self.constant)
        val = _val(node)
        if value is None or not isinstance(val, torch.Tensor) or val.is_complex() or isinstance(value, bool):
            return None
        return torch.tensor(value, dtype=val.dtype).item()

    def new(self, before: fx.Node, target, args, kwargs=None) -> fx.Node:
        """A call of ``target`` inserted just before ``before`` (symbolic sizes in ``args`` made
        nodes), with its fake value and the metadata a rewrite keeps."""
        graph = before.graph
        args, kwargs = materialize(graph, before, (args, dict(kwargs or {})))
        with graph.inserting_before(before):
            node = graph.create_node("call_function", target, args, kwargs, name=target.overloadpacket.__name__)
        if self.fake_mode is not None:
            vals, kvals = fx.node.map_arg((args, kwargs), _val)
            node.meta["val"] = _view_value(self.fake_mode, target, vals, kvals)
            if node.meta["val"] is None:
                with self.fake_mode:
                    node.meta["val"] = target(*vals, **kvals)
        for key in meta.KEPT_ON_REWRITE:
            if key in before.meta:
                node.meta[key] = before.meta[key]
        return node


class _ViewsInKernel(TorchDispatchMode):
    """Runs a view op on FakeTensors of ``fake_mode`` by its meta kernel alone, as FakeTensorMode's
    own fast paths do (``fast_detach``): the op's view bookkeeping (``_is_view()``, ``_base``, the
    shared storage) happens above this mode, as it does above FakeTensorMode, so the result is the
    value FakeTensorMode gives, without the cache key and checks of a full fake dispatch (about a
    third of its cost)."""

    def __init__(self, fake_mode):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:
            return args[0].fake_device
        with no_python_dispatcher(), in_kernel_invocation_manager(self.fake_mode):
            out = func(*args, **(kwargs or {}))
        return wrapper(self.fake_mode, args[0].fake_device).wrap(out) if isinstance(out, torch.Tensor) else out


def _view_value(fake_mode, target, vals, kvals):
    """The value of ``target(*vals, **kvals)`` for a view op of one static FakeTensor of ``fake_mode``
    (``_ViewsInKernel``); None for anything else (computed under the fake mode)."""
    if not (isinstance(target, torch._ops.OpOverload) and target.is_view and vals and not kvals and _returns_one_tensor(target)):
        return None
    x, rest = vals[0], vals[1:]
    if type(x) is not FakeTensor or x.fake_mode is not fake_mode or x.constant is not None or x.layout is not torch.strided:
        return None
    if not all(type(s) is int for s in (*x.shape, *x.stride(), x.storage_offset())):
        return None
    if any(isinstance(a, (torch.Tensor, torch.SymInt)) for a in pytree.tree_leaves(rest)):
        return None
    try:
        with _ViewsInKernel(fake_mode):
            return target(x, *rest)
    except Exception:  # noqa: BLE001 - the fake mode gives its own answer (or error)
        return None


def _returns_one_tensor(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)


def fill_value(node):
    """The number ``node``'s tensor is known to be filled with (``zeros_like(x)``, ``-ones(...) / 2``,
    their views and conversions), rounded to its dtype; None if not known."""
    return _Rewriter(node.graph).constant(node) if isinstance(node, fx.Node) else None


def _fill_value(node, constant_value):
    """The number ``node`` is filled with (unrounded), asking ``constant_value`` about its inputs."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    t, args = node.target, node.args
    if t in _CONSTANT_FILLS:
        return _CONSTANT_FILLS[t]
    if t in (aten.full_like.default, aten.new_full.default, aten.full.default):
        return args[1] if isinstance(args[1], (int, float)) else None
    if t is aten.scalar_tensor.default:
        return args[0]
    if t in _VIEWS or t in _CONVERSIONS or t in (aten.clone.default, aten.contiguous.default):
        return constant_value(args[0])
    if t is aten.neg.default:
        v = constant_value(args[0])
        return None if v is None else -v
    if t in _OPS and len(args) == 2 and not node.kwargs and _val(node).is_floating_point():
        a, b = (constant_value(x) if isinstance(x, fx.Node) else x for x in args)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
            dtype = _val(node).dtype
            if t is aten.div.Tensor and a not in (0, 1, -1) and not _exact_reciprocal(b, dtype):
                return None  # CUDA computes fill / b as fill * (1 / b), rounded twice
            return _OPS[t](torch.tensor(a, dtype=dtype), b).item()
    return None


def _exact_reciprocal(b, dtype) -> bool:
    """``x / b`` equals ``x * (1 / b)`` for every ``x``: ``b`` is a power of two whose reciprocal
    is a normal number of ``dtype`` (CUDA divides by a number through its reciprocal)."""
    if not dtype.is_floating_point or not _is_number(b) or b == 0 or not math.isfinite(b) or abs(math.frexp(b)[0]) != 0.5:
        return False
    r = 1 / b
    info = torch.finfo(dtype)
    return torch.tensor(b, dtype=dtype).item() == b and info.tiny <= abs(r) <= info.max and abs(b) >= info.tiny


# The tensor arithmetic that folds numbers, with the Python operator computing it.
_OPS = {
    aten.add.Tensor: operator.add,
    aten.sub.Tensor: operator.sub,
    aten.mul.Tensor: operator.mul,
    aten.div.Tensor: operator.truediv,
}
_BINARY = tuple(_OPS)
_SCALAR_OVERLOADS = {
    aten.add.Scalar: aten.add.Tensor,
    aten.sub.Scalar: aten.sub.Tensor,
    aten.mul.Scalar: aten.mul.Tensor,
    aten.div.Scalar: aten.div.Tensor,
}


_FILL_LIKE = {
    aten.ones_like.default: aten.new_ones.default,
    aten.zeros_like.default: aten.new_zeros.default,
    aten.full_like.default: aten.new_full.default,
}


# ``x.new_zeros(shape)`` reads only ``x``'s dtype and device: made from an input instead, it
# depends on nothing computed (fxtools.split then recomputes it rather than saving it).
_NEW_FILLS = (aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default)


def _only_shapes_a_fill(node) -> bool:
    """``ones_like(v)`` where ``v`` is computed only for this: the fill needs its shape, not its
    value (``grad``'s seed ``ones_like(loss)``, when the loss itself is not returned)."""
    v = node.args[0]
    kwargs_ok = all(k == "pin_memory" and not x for k, x in node.kwargs.items())
    return (
        kwargs_ok
        and isinstance(v, fx.Node)
        and v.op == "call_function"
        and set(v.users) == {node}
        and not is_impure(v)
        and isinstance(_val(v), torch.Tensor)
        and is_contiguous_or_false(_val(v))  # unbacked sizes: not known, so left as it is
    )


def _input_like(graph, val):
    """An input tensor of ``val``'s dtype and device: ``input.new_ones(shape)`` then makes a fill
    without computing anything."""
    for n in graph.nodes:
        if is_input_leaf(n):
            v = _val(n)
            if isinstance(v, torch.Tensor) and v.dtype == val.dtype and v.device == val.device:
                return n
        elif n.op == "call_function" and n.target is not operator.getitem:
            return None
    return None


def _scalar_of_dtype(node) -> bool:
    """``node`` is ``t op torch.scalar_tensor(number)`` with ``t``, the scalar and the result of
    one dtype: the number itself computes the same (``t / scalar_tensor(2.)`` is ``t / 2``; with an
    integer ``t`` the scalar's dtype would decide the result's, a Python float the default dtype's).
    Divisions need an exact reciprocal (see ``_exact_reciprocal``)."""
    t, x = node.args
    dtype = _val(node).dtype
    return (
        isinstance(x, fx.Node)
        and x.op == "call_function"
        and x.target is aten.scalar_tensor.default
        and isinstance(_val(x), torch.Tensor)
        and _val(x).dtype == dtype
        and isinstance(_val(t), torch.Tensor)
        and _val(t).dtype == dtype
        and _is_number(x.args[0])
        and (node.target is not aten.div.Tensor or _exact_reciprocal(x.args[0], dtype))
    )


def _number_converted(node, rw):
    """``_to_copy(2.0, dtype=...)``: a number converted is a ``scalar_tensor`` of that dtype."""
    x = node.args[0]
    if isinstance(x, (int, float)) and set(node.kwargs) == {"dtype"}:
        return rw.new(node, aten.scalar_tensor.default, (x,), node.kwargs)
    return None


def _fill_from_input(node, rw):
    """``ones_like(v)`` where ``v`` is computed only for its shape -> ``input.new_ones(shape)``."""
    if not _only_shapes_a_fill(node):
        return None
    source = _input_like(node.graph, _val(node))
    if source is None:
        return None
    fill = _FILL_LIKE[node.target]
    value = () if fill is aten.new_full.default and len(node.args) < 2 else tuple(node.args[1:2])
    return rw.new(node, fill, (source, list(_val(node).shape), *value))


def _new_fill_from_input(node, rw):
    """``v.new_zeros(shape)`` with ``v`` computed -> ``input.new_zeros(shape)`` (see ``_NEW_FILLS``)."""
    x = node.args[0]
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is not operator.getitem):
        return None
    source = _input_like(node.graph, _val(x))
    return None if source is None else rw.new(node, node.target, (source, *node.args[1:]), node.kwargs)


def _tensor_overload(node, rw):
    """``add.Scalar`` -> ``add.Tensor``: one spelling of each arithmetic op for the rules below."""
    if len(node.args) == 2 and not node.kwargs:
        return rw.new(node, _SCALAR_OVERLOADS[node.target], node.args)
    return None


def _scalar_tensor_operand(node, rw):
    """``t / scalar_tensor(2.)`` -> ``t / 2`` (see ``_scalar_of_dtype``)."""
    if len(node.args) == 2 and not node.kwargs and _scalar_of_dtype(node):
        return rw.new(node, node.target, (node.args[0], node.args[1].args[0]))
    return None


def _fill_operand(node, rw):
    """``t * fill`` -> ``t * number`` and ``t * s.expand(sizes)`` -> ``t * s``."""
    if len(node.args) == 2 and not node.kwargs:
        return _fold_fill(node, rw) or _unexpand_symbolic(node, rw)
    return None


def _times_one(node, rw):
    """``x * 1``, ``x / 1``, ``1 * x`` -> ``x`` and ``x * -1`` -> ``-x`` (when ``x`` has the result's type)."""
    if len(node.args) != 2:
        return None
    x, y = node.args
    if rw.constant(y) == 1 or y == 1:
        return x if _same_type(x, node) else None
    if node.target is aten.mul.Tensor and rw.constant(x) == 1 and _same_type(y, node):
        return y
    if node.target is aten.mul.Tensor and (y == -1 or rw.constant(y) == -1) and _same_type(x, node):
        return rw.new(node, aten.neg.default, (x,))
    return None


def _times_ones(node, rw):
    """``ones.view(n, 1) * w`` -> ``w.expand(n, m)``: a product with a tensor of ones broadcast
    over ``w`` is ``w`` broadcast, read-only (not for a module's output, which its caller may write)."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs or _is_output(node):
        return None
    x, y = node.args
    other = y if rw.constant(x) == 1 else x if rw.constant(y) == 1 else None
    val, out = _val(other), _val(node)
    if not (isinstance(other, fx.Node) and isinstance(val, torch.Tensor) and val.dtype == out.dtype):
        return None
    if not same_shape(val.shape, out.shape) and _viewed(node):
        return None  # the product is laid out contiguously; ``.view`` may refuse the broadcast's strides
    return rw.new(node, aten.expand.default, (other, shape_arg(node, out)))


_STRIDE_VIEWS = {
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.select.int,
    aten.slice.Tensor,
    aten.expand.default,
    aten.alias.default,
}


def _viewed(node: fx.Node) -> bool:
    """Whether ``.view`` (or ``_unsafe_view``) reads ``node``, directly or through views of it."""
    for user in node.users:
        if user.op == "call_function" and user.target in (aten.view.default, aten._unsafe_view.default):
            return True
        if user.op == "call_function" and user.target in _STRIDE_VIEWS and _viewed(user):
            return True
    return False


def _fresh_clone(node, rw):
    """``clone(t)`` -> ``t`` for ``t`` a new tensor (``zeros(...)``, ``a + b``) of the same strides
    that nothing writes in place, directly or through a view, and that the module does not also
    return next to the clone (two outputs would then be one tensor)."""
    x = node.args[0]
    fmt = node.kwargs.get("memory_format", torch.preserve_format)
    if _input_view(x):
        return _read_only_clone(node, x, fmt)
    if not (isinstance(x, fx.Node) and x.op == "call_function" and isinstance(x.target, torch._ops.OpOverload)):
        return None
    schema = x.target._schema
    if schema.is_mutable or len(schema.returns) != 1 or schema.returns[0].alias_info is not None:
        return None  # a view or an in-place op: its result shares memory with another tensor
    a, b = _val(x), _val(node)
    if fmt not in (None, torch.preserve_format) or not (_same_type(x, node) and same_shape(a.stride(), b.stride())):
        return None
    ax, an = _aliases(x), _aliases(node)
    if any(_mutates(u) for v in ax | an for u in v.users) or (_returned(ax) and _returned(an)):
        return None
    return x


def _input_view(x) -> bool:
    """Whether ``x`` is an input of the graph or a view of one (``x[1]``, ``x.t()``)."""
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _STRIDE_VIEWS and x.args:
        x = x.args[0]
    return isinstance(x, fx.Node) and x.op == "placeholder"


def _read_only_clone(node, x, fmt):
    """``clone(x)`` -> ``x`` for an input ``x`` when the copy is only read: the graph writes no
    tensor in place (inputs may share memory when called: a write into another input may be a
    write into ``x``; the copy is then a snapshot), the copy is not returned (it must not share
    the caller's memory), and no ``.view`` needs its dense layout (the module may be called with
    other strides)."""
    if fmt not in (None, torch.preserve_format) or not _same_type(x, node) or _viewed(node):
        return None
    if _returned(_aliases(node)) or any(_mutates(n) for n in node.graph.nodes):
        return None
    return x


def _aliases(node: fx.Node) -> set[fx.Node]:
    """``node`` and the views of it (the nodes that share its memory)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += [u for u in n.users if isinstance(u.target, torch._ops.OpOverload) and u.target.is_view]
    return seen


def _returned(nodes: set[fx.Node]) -> bool:
    return any(u.op == "output" for n in nodes for u in n.users)


def _is_output(node: fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)


def _plus_zero(node, rw):
    """``x - 0``, ``x + (-0.0)``, ``(-0.0) + x`` -> ``x`` (see ``_neutral_zero``)."""
    if len(node.args) != 2 or node.kwargs:
        return None
    x, y = node.args
    if _neutral_zero(y, node, node.target, rw) and _same_type(x, node):
        return x
    if node.target is aten.add.Tensor and _neutral_zero(x, node, node.target, rw) and _same_type(y, node):
        return y
    return None


def _doubled(node, rw):
    """``x + x`` -> ``x * 2`` for real floating ``x`` (the same number, rounding included; one
    name fewer in the code)."""
    if len(node.args) != 2 or node.kwargs or node.args[0] is not node.args[1]:
        return None
    x = node.args[0]
    val = _val(x)
    if not (isinstance(val, torch.Tensor) and val.is_floating_point() and _same_type(x, node)):
        return None
    return rw.new(node, aten.mul.Tensor, (x, 2))


def _double_negation(node, rw):
    """``-(-x)`` -> ``x``."""
    x = node.args[0]
    return x.args[0] if isinstance(x, fx.Node) and x.target is aten.neg.default else None


def _detach(node, rw):
    """``detach`` of a constant is the constant. Of a value computed from the inputs or from a
    closed-over tensor that requires grad (a parameter) it stays: the generated code's own
    derivative (``fxtools.hvp`` and ``hessian`` differentiate a gradient's code, and so does
    autograd run over it) must see the value as a constant, as PyTorch does at every order."""
    x = node.args[0]
    if isinstance(x, fx.Node) and any(a.op == "placeholder" or reads_tracked_tensor(a) for a in ancestors([x])):
        return None
    return x


_CONTIGUOUS_KERNELS = {aten.native_group_norm.default}


def _no_op_view(node, rw):
    """A view, conversion or ``contiguous`` to the same shape, dtype and device is its input.

    ``contiguous()`` of a transposed tensor is not a no-op: a later ``.view`` needs it. Nor is one
    before a kernel that refuses other layouts (``native_group_norm``): a call of the module with
    another layout than the example's needs it, and on a contiguous tensor it copies nothing.
    """
    x, t = node.args[0], node.target
    if t is aten.detach.default:
        return _detach(node, rw)
    if (
        isinstance(x, fx.Node)
        and _same_type(x, node)
        and (t not in _CONVERSIONS or _same_device(x, node))
        and (
            t is not aten.contiguous.default
            or (_val(x).is_contiguous() and not _CONTIGUOUS_KERNELS & {u.target for u in node.users})
        )
    ):
        return x
    return None


def _contiguous_operand(node, rw):
    """A kernel of ``_CONTIGUOUS_KERNELS`` reads ``x.contiguous()``, as the composite op calling it
    (``group_norm``) does: a trace on a contiguous example (or a retrace of generated code) drops
    that call, and the module would refuse other layouts eager runs. Changes ``node`` in place."""
    x = node.args[0]
    if isinstance(x, fx.Node) and x.target is not aten.contiguous.default:
        node.update_arg(0, rw.new(node, aten.contiguous.default, (x,)))
    return None


def _reshape_of_reshape(node, rw):
    """``x.view(a).view(b)`` -> ``x.view(b)`` (a reshape if either was one)."""
    x, t = node.args[0], node.target
    if not (isinstance(x, fx.Node) and x.target in _RESHAPES):
        return None
    target = aten.reshape.default if aten.reshape.default in (t, x.target) else t
    return rw.new(node, target, (x.args[0], shape_arg(node, _val(node))))


def _transpose_of_transpose(node, rw):
    """``x.transpose(a, b).transpose(b, a)`` -> ``x``."""
    x = node.args[0]
    if isinstance(x, fx.Node) and x.target is aten.transpose.int:
        nd = _val(x).dim()
        if {a % nd for a in node.args[1:]} == {a % nd for a in x.args[1:]}:
            return x.args[0]
    return None


def _sum_of_all_dims(node, rw):
    """``sum(x, all dims)`` -> ``sum(x)``."""
    if len(node.args) == 2 and not node.kwargs and _val(node).dim() == 0:
        return rw.new(node, aten.sum.default, (node.args[0],))
    return None


def _canonical_transpose(node, rw):
    """``x.t()``, ``x.mT`` -> ``x.transpose(-2, -1)`` with dims sorted and positive; a transpose
    of one dimension with itself (or ``t`` of a vector) is ``x``."""
    x, t = node.args[0], node.target
    if not isinstance(x, fx.Node):
        return None
    nd = _val(x).dim()
    if nd < 2 and t is not aten.transpose.int:
        return x
    dims = sorted(d % nd for d in node.args[1:3]) if t is aten.transpose.int else [nd - 2, nd - 1]
    if dims[0] == dims[1]:
        return x
    if t is not aten.transpose.int or list(node.args[1:3]) != dims:
        return rw.new(node, aten.transpose.int, (x, *dims))
    return None


def _identity_permute(node, rw):
    """``x.permute([0, 1, ..., n - 1])`` -> ``x`` (batching rules move a batch dimension already in place)."""
    x = node.args[0]
    if isinstance(x, fx.Node) and isinstance(_val(x), torch.Tensor):
        nd = _val(x).dim()
        dims = node.args[1]
        if isinstance(dims, (list, tuple)) and all(isinstance(d, int) for d in dims):
            if [d % nd for d in dims] == list(range(nd)) if nd else not dims:
                return x
    return None


def _permute_of_permute(node, rw):
    """Two permutes -> one (none if they compose to the identity)."""
    x = node.args[0]
    if not (isinstance(x, fx.Node) and x.target is aten.permute.default):
        return None
    inner, outer = list(x.args[1]), list(node.args[1])
    composed = [inner[o] for o in outer]
    if composed == sorted(composed):
        return x.args[0]
    return rw.new(node, aten.permute.default, (x.args[0], composed))


# A view and the functional write into that place (``x[1:] = v`` -> ``slice_scatter(x, v, 0, 1)``)
_SCATTERS = {
    aten.slice.Tensor: aten.slice_scatter.default,
    aten.select.int: aten.select_scatter.default,
    aten.diagonal.default: aten.diagonal_scatter.default,
}


def _place(node: fx.Node) -> tuple | None:
    """Where a view or a scatter of ``_SCATTERS`` reads or writes, comparable between the two:
    its arguments after the tensor(s), defaults filled in, ``dim`` non-negative and a slice's
    open bounds as None."""
    bound = _arguments(node)[0]
    if not (isinstance(bound, tuple) and bound[0] == "list"):
        return None
    args = [b[1] if b[0] in ("int", "NoneType") else b for b in bound[1]]
    scatter = node.target in _SCATTERS.values()
    place, x = args[2 if scatter else 1 :], _val(node.args[0])
    if not isinstance(x, torch.Tensor) or not all(a is None or type(a) is int for a in place):
        return None
    if node.target in (aten.slice.Tensor, aten.slice_scatter.default):
        dim, start, end, step = place
        end = None if end is not None and end >= sys.maxsize else end
        return (dim % x.dim(), start or 0, end, step)
    if node.target in (aten.diagonal.default, aten.diagonal_scatter.default):
        offset, d1, d2 = place
        return (offset, d1 % x.dim(), d2 % x.dim())
    return (place[0] % x.dim(), place[1])


def _read_back(node, rw):
    """``slice(slice_scatter(b, v, *place), *place)`` -> ``v`` (and select, diagonal): reading the
    place just written reads what was written, unless either is written in place or both are
    returned."""
    x = node.args[0]
    if not (isinstance(x, fx.Node) and x.target is _SCATTERS[node.target] and isinstance(x.args[1], fx.Node)):
        return None
    v = x.args[1]
    if _place(x) is None or _place(x) != _place(node) or not _same_type(v, node):
        return None
    av, an = _aliases(v), _aliases(node)
    if any(_mutates(u) for a in av | an | _aliases(x) for u in a.users) or (_returned(av) and _returned(an)):
        return None
    return v


def _written_again(node, rw):
    """``scatter(scatter(b, v, *place), v, *place)`` -> the inner scatter: ``x[i] += v`` writes the
    sum into ``x[i]``, then copies the same value there again."""
    base, v = node.args[0], node.args[1] if len(node.args) > 1 else None
    if not (isinstance(base, fx.Node) and base.target is node.target and len(base.args) > 1 and base.args[1] is v):
        return None
    place = _place(node)
    return base if place is not None and place == _place(base) else None


def _scattered_back(node, rw):
    """``slice_scatter(x, x[place], place)`` -> ``x`` (and select, diagonal): writing a place back
    what it holds, as a gradient becomes once ``_disjoint_sum`` joins the two parts of ``x[i] += v``'s."""
    x, v = node.args[0], node.args[1] if len(node.args) > 1 else None
    view = next((op for op, scatter in _SCATTERS.items() if scatter is node.target), None)
    if not (isinstance(v, fx.Node) and v.target is view and v.args[0] is x and _same_type(x, node)):
        return None
    if _place(node) is None or _place(node) != _place(v):
        return None
    if any(_mutates(u) for a in _aliases(x) | _aliases(v) for u in a.users):
        return None
    return x


def _region(node: fx.Node) -> tuple | None:
    """The part of its output a scatter writes, comparable with the unpadded part of a pad:
    ``("slice", dim, start, stop, step)``, ``("select", dim, index)`` with the bounds resolved, or
    the diagonal's op and place; None unless static."""
    place, x = _place(node), _val(node.args[0])
    if place is None or node.target is aten.diagonal_scatter.default:
        return None if place is None else (node.target, *place)
    size = x.shape[place[0]]
    if node.target is aten.select_scatter.default:
        index = place[1] if place[1] >= 0 or type(size) is not int else place[1] + size
        return ("select", place[0], index) if index >= 0 else None
    dim, start, end, step = place
    if type(size) is not int:  # a symbolic size: only a slice from a fixed start to the end
        return ("slice", dim, start, "end", step) if start >= 0 and end is None else None
    start, stop, _ = slice(start, end).indices(size)
    return ("slice", dim, start, "end" if stop >= size else max(stop, start), step)


def _zero_outside(node, rw) -> list[tuple]:
    """``(region, v)`` pairs, each a way to read ``node`` as ``v`` written into zeros at ``region``:
    a scatter into a zero fill, or a pad by zeros along one dim (of ``v.unsqueeze(dim)``: also
    where ``select`` writes)."""
    if not isinstance(node, fx.Node) or len(node.args) < 2:
        return []
    if node.target in _SCATTERS.values() and rw.constant(node.args[0]) == 0:
        region = _region(node)
        return [] if region is None else [(region, node.args[1])]
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if node.target is not aten.constant_pad_nd.default or value != 0 or not isinstance(node.args[1], (list, tuple)):
        return []
    inner, pad = node.args[0], list(node.args[1])
    v = _val(inner)
    padded = [i for i in range(0, len(pad), 2) if not (type(pad[i]) is int and pad[i] == 0 == pad[i + 1])]
    if len(padded) != 1 or not isinstance(v, torch.Tensor) or type(pad[padded[0]]) is not int or pad[padded[0]] < 0:
        return []  # the high pad may be symbolic: the shapes compared by the caller fix it
    dim, lo, hi = v.dim() - 1 - padded[0] // 2, pad[padded[0]], pad[padded[0] + 1]
    found = []
    if type(hi) is int and hi == 0:
        found.append((("slice", dim, lo, "end", 1), inner))
    elif type(v.shape[dim]) is int:
        found.append((("slice", dim, lo, lo + v.shape[dim], 1), inner))
    if isinstance(inner, fx.Node) and inner.target is aten.unsqueeze.default and v.shape[dim] == 1:
        if isinstance(inner.args[1], int) and inner.args[1] % v.dim() == dim:
            found.append((("select", dim, lo), inner.args[0]))
    return found


def _disjoint_sum(node, rw):
    """``scatter(x, zeros, place) + scatter(zeros, v, place)`` -> ``scatter(x, v, place)``, the
    second part also a pad by zeros: the gradient of ``x[i] += v`` or ``x.diagonal().mul_(w)``,
    whose two parts are the gradient outside the written place and inside it. Each number is then
    one of the two parts rather than one plus a zero: the same, but for the sign of a zero part
    (``-0.0 + 0.0`` is ``+0.0``; the chain rule's product is kept, which eager's backward of an
    in-place write also gives only up to that sign)."""
    if len(node.args) != 2 or node.kwargs:
        return None
    for a, b in (node.args, node.args[::-1]):
        if not (isinstance(a, fx.Node) and a.target in _SCATTERS.values() and rw.constant(a.args[1]) == 0):
            continue
        if not (_same_type(a.args[0], node) and _same_type(b, node)):
            continue
        for region, v in _zero_outside(b, rw):
            if region == _region(a) and _val(v).dtype == _val(node).dtype:
                return rw.new(node, a.target, (a.args[0], v, *a.args[2:]), a.kwargs)
    return None


# Each rewrite with the ops it applies to, in order of preference: a node takes the first that
# returns something.
_REWRITE_FAMILIES = (
    (_CONVERSIONS, _number_converted),
    (_FILL_LIKE, _fill_from_input),
    (_NEW_FILLS, _new_fill_from_input),
    (_SCALAR_OVERLOADS, _tensor_overload),
    (_BINARY, _scalar_tensor_operand),
    (_BINARY, _fill_operand),
    ((aten.mul.Tensor, aten.div.Tensor), _times_one),
    ((aten.mul.Tensor,), _times_ones),
    ((aten.clone.default,), _fresh_clone),
    ((aten.add.Tensor, aten.sub.Tensor), _plus_zero),
    ((aten.add.Tensor,), _doubled),
    ((aten.neg.default,), _double_negation),
    ((aten.detach.default,), _detach),
    ((*_VIEWS, *_CONVERSIONS, aten.contiguous.default), _no_op_view),
    (_RESHAPES, _reshape_of_reshape),
    (tuple(_CONTIGUOUS_KERNELS), _contiguous_operand),
    ((aten.transpose.int,), _transpose_of_transpose),
    ((aten.sum.dim_IntList,), _sum_of_all_dims),
    ((aten.t.default, aten.mT.default, aten.transpose.int), _canonical_transpose),
    ((aten.permute.default,), _identity_permute),
    ((aten.permute.default,), _permute_of_permute),
    (tuple(_SCATTERS), _read_back),
    (tuple(_SCATTERS.values()), _written_again),
    (tuple(_SCATTERS.values()), _scattered_back),
    ((aten.add.Tensor,), _disjoint_sum),
)


def _rewrite_table() -> dict:
    """The op table: each op to its rewrites, in ``_REWRITE_FAMILIES``' order."""
    table: dict = {}
    for ops, rewrite in _REWRITE_FAMILIES:
        for op in ops:
            table.setdefault(op, []).append(rewrite)
    return table


_REWRITES = _rewrite_table()


def _rewrite(node: fx.Node, rw: _Rewriter):
    """A node (existing or new) that computes the same as ``node`` more simply, or None."""
    if node.op != "call_function" or not node.args:
        return None
    for rewrite in _REWRITES.get(node.target, ()):
        new = rewrite(node, rw)
        if new is not None:
            return new
    return None


def _neutral_zero(z, node, op, rw) -> bool:
    """``z`` is a zero that ``op`` (add or sub) leaves every value of ``node``'s dtype unchanged
    with: any zero for integers; for floats ``x - 0.0`` and ``x + (-0.0)``, never ``x + 0.0``
    (``-0.0 + 0.0`` is ``+0.0``) nor ``x - (-0.0)``."""
    v = z if _is_number(z) else rw.constant(z)
    if v is None or isinstance(v, bool) or v != 0:
        return False
    if not _val(node).is_floating_point():
        return True
    negative = math.copysign(1.0, v) < 0
    return negative if op is aten.add.Tensor else not negative


def _fold_fill(node, rw):
    """``t * f`` -> ``t * 0.5`` when ``f`` is known to be filled with 0.5 and only broadcasts into
    ``t`` (same dtype and shape as the result).

    Seeds and their scalings (``ones_like(loss).expand(...) / n``) then become numbers in the code,
    and whatever the fill was shaped after (in ``grad``, the loss itself) becomes dead code.
    """
    a, b = node.args
    out = _val(node)
    if not isinstance(out, torch.Tensor):
        return None
    for tensor, fill in ((a, b), (b, a)):
        if fill is a and node.target not in (aten.add.Tensor, aten.mul.Tensor):
            continue
        value = rw.constant(fill)
        if value is None or not isinstance(tensor, fx.Node) or not _same_type(tensor, node):
            continue
        fv = _val(fill)
        if node.target is aten.div.Tensor and not _exact_reciprocal(value, out.dtype):
            continue  # on CUDA, t / number is t * (1 / number): not t / tensor
        if fv.dtype == out.dtype and broadcasts_into(fv.shape, out.shape):
            return rw.new(node, node.target, (tensor, value))
    return None


def _unexpand_symbolic(node, rw):
    """``t * s.expand([batch, 4])`` -> ``t * s`` when ``s`` only broadcasts into ``t`` (same dtype
    and shape as the result), for an expand to symbolic sizes.

    It is what ``_fold_fill`` does for a static fill: with a size marked dynamic, a mean's seed
    ``ones / (batch * 4)`` is no number, but a 0-d tensor that multiplies as one.
    """
    a, b = node.args
    out = _val(node)
    if not isinstance(out, torch.Tensor):
        return None
    for tensor, e in ((a, b), (b, a)):
        if e is a and node.target not in (aten.add.Tensor, aten.mul.Tensor):
            continue
        if not (
            isinstance(e, fx.Node)
            and e.op == "call_function"
            and e.target is aten.expand.default
            and isinstance(tensor, fx.Node)
            and _same_type(tensor, node)
            and any(isinstance(n, fx.Node) for n in e.args[1])
        ):
            continue
        source = e.args[0]
        sv = _val(source)
        if isinstance(sv, torch.Tensor) and sv.dtype == out.dtype and broadcasts_into(sv.shape, out.shape):
            return rw.new(node, node.target, (tensor, source))
    return None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same_device(a, b):
    return _val(a).device == _val(b).device


def _made_since(start: fx.Node, node: fx.Node, new) -> bool:
    """Whether ``new`` is not a node that existed when ``node``'s predecessor was ``start``."""
    if not isinstance(new, fx.Node):
        return True
    n = node.prev
    while n is not start:
        if n is new:
            return True
        n = n.prev
    return False


def identities(gm: fx.GraphModule, rw: _Rewriter | None = None) -> bool:
    """One sweep of the exact rewrites over ``gm``'s graph; whether anything changed. ``rw``: the
    rewriter of the earlier sweeps of one ``simplify`` (``_Rewriter.next_sweep``)."""
    if rw is None:
        rw = _Rewriter(gm.graph)
    else:
        rw.next_sweep()
    changed = False
    for node in list(gm.graph.nodes):
        if not node.users and not is_impure(node):
            continue
        start = node.prev  # _rewrite inserts the nodes it makes just before ``node``
        new = _rewrite(node, rw)
        if new is not None and new is not node:
            _replace(gm.graph, node, new, start)
            changed = True
    return changed


def _replace(graph: fx.Graph, node: fx.Node, new, start: fx.Node) -> None:
    """``node``'s uses now read ``new``; ``node`` is erased, and its name passed on to ``new``
    when ``new`` was made for it (a cotangent's ``grad_`` name, a step's readable name)."""
    only_for_this = isinstance(new, fx.Node) and set(new.users) == {node} and has_generic_name(new)
    node.replace_all_uses_with(new)
    if not (_made_since(start, node, new) or only_for_this):
        return
    name, op_only, helper = node.name, _op_only_name(node), meta.INTERMEDIATE.on(node)
    graph.erase_node(node)
    named = name.startswith("grad_") and not helper  # a cotangent, not a step computing one
    # a step's name goes to what replaces it; a backward step's only to a backward value
    backward = isinstance(new, fx.Node) and any(a.name.startswith("grad_") for a in new.all_input_nodes)
    step = not op_only and (backward or not (helper and name.startswith("grad_")))
    if isinstance(new, fx.Node) and (named or (step and has_generic_name(new))):
        new.name = name  # the erased node's name: unique, and still reserved in the namespace


def _op_only_name(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and (
        re.fullmatch(rf"_*{re.escape(node.target.overloadpacket.__name__.strip('_'))}_*(_\d+)?", node.name) is not None
    )


def _hashable(x):
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_hashable(i) for i in x))
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    if isinstance(x, float) and x != x:
        return ("nan",)
    if isinstance(x, float) and x == 0:
        return ("float", x, math.copysign(1.0, x))  # -0.0 == 0.0, but x + -0.0 is not x + 0.0
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x))
    return (type(x).__name__, x)


def _arguments(node: fx.Node) -> tuple:
    """``node``'s arguments, hashable; an op's bound to its schema with the defaults filled in, so
    that ``sdpa(q, k, v)`` and ``sdpa(q, k, v, None, 0.0, False)`` are the same call."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return _hashable(node.args), _hashable(node.kwargs)
    arguments, names = _schema_arguments(target)
    bound = []
    for i, (name, kwarg_only, has_default, default) in enumerate(arguments):
        if i < len(node.args) and not kwarg_only:
            bound.append(node.args[i])
        elif name in node.kwargs:
            bound.append(node.kwargs[name])
        elif has_default:
            bound.append(default)
        else:
            return _hashable(node.args), _hashable(node.kwargs)  # not a call of this schema: as written
    if len(node.args) > len(bound) or any(k not in names for k in node.kwargs):
        return _hashable(node.args), _hashable(node.kwargs)
    return _hashable(bound), ()


_SCHEMAS: dict[int, tuple] = {}  # id(op) -> (op, its arguments, their names): read once per op


def _schema_arguments(op: torch._ops.OpOverload) -> tuple[list[tuple], frozenset]:
    """``op``'s arguments as ``(name, kwarg_only, has_default, default)`` and the set of their names."""
    entry = _SCHEMAS.get(id(op))
    if entry is None or entry[0] is not op:
        arguments = [
            (a.name, a.kwarg_only, a.has_default_value(), a.default_value if a.has_default_value() else None)
            for a in op._schema.arguments
        ]
        entry = _SCHEMAS[id(op)] = (op, arguments, frozenset(a[0] for a in arguments))
    return entry[1], entry[2]


def cse(gm: fx.GraphModule, keys: dict | None = None) -> bool:
    """Merge each op with an earlier twin (same op, same arguments, same grad mode): a twin
    computed in a ``no_grad`` block is a constant of the reverse pass, the other is not.

    ``keys``: a dict kept across the calls of one ``simplify`` (``_cse_key``'s memo, and which
    nodes mutate: a node's target and arguments decide it)."""
    seen, changed = {}, False
    nodes = list(gm.graph.nodes)
    mutating = [_mutates_memo(n, keys) for n in nodes]
    written = {a for n, m in zip(nodes, mutating) if m for a in n.all_input_nodes}
    grad_enabled = True
    for node, mutates in zip(nodes, mutating):
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            grad_enabled = bool(node.args[0])
        if node in written and node.op != "get_attr":
            continue  # its value changes in place later: it is not interchangeable with a twin
        if mutates:  # a read after a mutation is not the same value as the read before it; an
            # attribute is the same tensor object, written in place or not
            seen = {k: v for k, v in seen.items() if v.op == "get_attr"}
            continue
        if node.op not in ("call_function", "call_method", "get_attr"):
            continue
        call = _cse_key(node, keys)
        if call is None:
            continue
        key = (grad_enabled and node.op != "get_attr", *call)
        if key in seen:
            _first_name(seen[key], node)
            node.replace_all_uses_with(seen[key])
            changed = True
        else:
            seen[key] = node
    return changed


def _cse_key(node: fx.Node, keys: dict | None) -> tuple | None:
    """``(op, target, *arguments)`` of ``node`` for ``cse``, or None (impure, or arguments that do
    not hash). Memoized in ``keys`` while the node's target and arguments are the same objects
    (``replace_all_uses_with`` gives a user new ones): later rounds of ``simplify`` read most
    keys again unchanged."""
    if keys is not None:
        hit = keys.get(node)
        if hit is not None and hit[0] is node.target and hit[1] is node.args and hit[2] is node.kwargs:
            return hit[3]
    key: tuple | None = None
    if not is_impure(node):
        try:
            key = (node.op, node.target, *_arguments(node))
            hash(key)
        except TypeError:
            key = None
    if keys is not None:
        keys[node] = (node.target, node.args, node.kwargs, key)
    return key


def _name_order(name: str) -> tuple[str, tuple[int, ...]]:
    """``norm_1_mean_2`` -> (``norm_mean``, (1, 2)): a name and the counters that made it unique."""
    return re.sub(r"_\d+(?=_|$)", "", name), tuple(int(n) for n in re.findall(r"_(\d+)(?=_|$)", name))


def _first_name(kept: fx.Node, twin: fx.Node) -> None:
    """Of twins named alike, the one kept takes the name given first: the program's ``norm``, not
    ``norm_2``, a copy of it that forward mode's code computes before the program's own."""
    (base, k), (twin_base, t) = _name_order(kept.name), _name_order(twin.name)
    if base == twin_base and (len(t), t) < (len(k), k):
        kept.name, twin.name = twin.name, kept.name


def _mutates_memo(node: fx.Node, keys: dict | None) -> bool:
    """``_mutates(node)``, memoized in ``keys`` (see ``cse``) while its target and arguments are the same objects."""
    if keys is None:
        return _mutates(node)
    hit = keys.get((node, "mutates"))
    if hit is not None and hit[0] is node.target and hit[1] is node.args and hit[2] is node.kwargs:
        return hit[3]
    found = _mutates(node)
    keys[(node, "mutates")] = (node.target, node.args, node.kwargs, found)
    return found


def _mutates(node: fx.Node) -> bool:
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable or (t in STATEFUL_NORMS and is_impure(node))
    return node.op == "call_method" and isinstance(t, str) and t.endswith("_")


def dce(gm: fx.GraphModule) -> bool:
    changed = False
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and not is_impure(node):
            gm.graph.erase_node(node)
            changed = True
    return changed


def output_masks(gm: fx.GraphModule) -> bool:
    """Backward kernels taking an ``output_mask`` (``convolution_backward``,
    ``native_layer_norm_backward``, ...) compute only the results something reads (the first
    convolution's input gradient is never asked for). Run after dead-code elimination."""
    changed = False
    for node in gm.graph.nodes:
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        names = [a.name for a in t._schema.arguments]
        if "output_mask" not in names or any(u.target is not operator.getitem for u in node.users):
            continue
        i = names.index("output_mask")
        mask = node.args[i] if i < len(node.args) else node.kwargs.get("output_mask")
        used = {u.args[1] for u in node.users}
        new = [bool(m) and k in used for k, m in enumerate(mask)]
        if not any(new) or new == [bool(m) for m in mask]:
            continue
        if i < len(node.args):
            node.args = node.args[:i] + (new,) + node.args[i + 1 :]
        else:
            node.kwargs = {**node.kwargs, "output_mask": new}
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            node.meta["val"] = type(val)(v if k >= len(new) or new[k] else None for k, v in enumerate(val))
        changed = True
    return changed


def simplify(gm: fx.GraphModule) -> fx.GraphModule:
    """Run every pass to a fixed point; returns ``gm`` (its graph changed in place).

    The caller recompiles ``gm`` once its last pass is done (code generation is slow on big graphs).
    """
    sizes_from_inputs(gm)  # symbolic sizes read from the inputs (graph/data_dependent.py)
    keys: dict = {}
    rw = _Rewriter(gm.graph)
    while True:
        changed = identities(gm, rw)
        changed |= cse(gm, keys)
        changed |= dce(gm)
        if not changed:
            break
    output_masks(gm)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    drop_unused_subgraphs(gm)
    for sub in subgraphs(gm):  # control flow's functions
        simplify(sub)
    gm.graph.lint()
    return gm
