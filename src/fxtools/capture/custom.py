"""User functions with their own VJP: ``fxtools.custom_vjp`` and ``torch.autograd.Function``.

While fxtools captures a program, a call of such a function becomes ONE node of the captured
graph. Its target is a ``CustomCall``: a callable that runs the function (so the graph still
runs, and a call nobody differentiates is just inlined) and carries the user's forward and
backward as the node's VJP rule (``CustomCall.vjp_rule``, also in ``node.meta``). Reverse
mode then calls that rule like any hand-written one: the user's torch calls are traced on
FakeTensors and become the generated code, which therefore never refers to the function object.

- ``fxtools.custom_vjp`` follows ``jax.custom_vjp``: ``fwd(*args) -> (out, residuals)``,
  ``bwd(residuals, ct) -> one cotangent (or None) per positional argument``; ``ct`` has the
  structure of ``out``.
- ``torch.autograd.Function.apply`` runs ``forward`` (old style with ``ctx``, or new style with
  ``setup_context``) and ``backward`` with a stand-in ``ctx`` supporting ``save_for_backward``,
  attributes, ``needs_input_grad``, ``mark_non_differentiable`` and ``set_materialize_grads``.

The node's tensor arguments are the tensor leaves of the call's arguments; every other leaf
(numbers, None, any object) is a constant kept in the ``CustomCall``. Its value is the single
output tensor, or the tuple of output tensor leaves. Cotangents an output does not receive are
zeros for the user's backward (autograd's ``materialize_grads``). Outputs marked
non-differentiable are detached in the captured graph and give the backward zeros.

Under ``fxtools.vmap`` (which differentiates nothing) calls just run the forward. Things fxtools
cannot honour raise ``CustomFunctionError`` naming the function and the user's line: in-place
Functions (``mark_dirty``), a Function's own ``vmap`` under ``fxtools.vmap`` or ``jvp`` under
``fxtools.jvp``, a function mutating its arguments or using a traced tensor it did not get as an
argument.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental import proxy_tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import FxtoolsError, current_user_line
from ..graph import meta
from ..registry import Rule, Transform
from .patching import patched

__all__ = ["custom_vjp", "custom_jvp", "CustomCall", "CustomFunctionError", "capturing", "transform"]


class CustomFunctionError(FxtoolsError):
    """A function with its own backward is used in a way fxtools cannot honour."""


@dataclasses.dataclass(frozen=True)
class _Building:
    """What the trace in progress does with custom functions."""

    capturing: bool = False  # capture is tracing: Function.apply goes through _function_apply
    record: bool = False  # custom calls become nodes (else they just run, as under vmap)
    transform: Transform | None = None  # the transform being built
    handlers: tuple = ()  # (Function class, handler or None): function_handlers


_STATE: contextvars.ContextVar[_Building] = contextvars.ContextVar(
    "fxtools_custom_functions",
    default=_Building(),  # noqa: B039 - frozen
)


@contextlib.contextmanager
def _building(**changes):
    token = _STATE.set(dataclasses.replace(_STATE.get(), **changes))
    try:
        yield
    finally:
        _STATE.reset(token)


@contextlib.contextmanager
def function_handlers(handlers: dict):
    """While capturing, call ``handler(apply, *args, **kwargs)`` for these ``torch.autograd.Function``
    classes instead of recording them (``apply`` runs the original, traced through); a handler of
    None traces the function's forward through (its ops get their own rules). For the autograd
    functions of tensor subclasses (``capture/subclasses.py``)."""
    with _building(handlers=tuple({**dict(_STATE.get().handlers), **handlers}.items())):
        yield


@contextlib.contextmanager
def capturing(record: bool):
    """While capture traces: make custom calls nodes (``record``) or just run them (vmap)."""
    function = torch.autograd.function.Function
    original = function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        return _function_apply(cls, original, args, kwargs)

    with patched(function, apply=classmethod(apply)), _building(capturing=True, record=record):
        yield


@contextlib.contextmanager
def transform(declared: Transform):
    """The transform being built (its record: ``forward_mode``, ``batches``), for what custom calls must refuse."""
    with _building(transform=declared):
        yield


@contextlib.contextmanager
def _not_capturing():
    with _building(capturing=False, record=False):
        yield


# ---------------------------------------------------------------------------------------------
# What a custom function is, independent of how the user wrote it


class _Kind:
    """A custom function as fxtools uses it.

    ``primal(*args, **kwargs) -> out``; ``fwd(*args, **kwargs) -> (out, state)``;
    ``nondiff(state, out_leaves) -> indices of output leaves carrying no gradient``;
    ``materialize(state) -> bool``; ``bwd(state, out, cts) -> one cotangent per positional
    argument``, where ``cts`` has one entry per output leaf (None where none arrives and
    ``materialize`` is false).
    """

    name: str

    def flatten_out(self, out):
        return pytree.tree_flatten(out)

    def nondiff(self, state, out_leaves):
        return set()

    def materialize(self, state):
        return True


class _VjpKind(_Kind):
    def __init__(self, fn: custom_vjp, where: str):
        assert fn.fwd is not None and fn.bwd is not None  # custom_vjp.__call__ refuses a function without rules
        self.fn, self.name, self.where = fn, fn.__name__, where
        self.rule_fwd, self.rule_bwd = fn.fwd, fn.bwd

    def primal(self, *args, **kwargs):
        return self.fn.fun(*args, **kwargs)

    def fwd(self, *args, **kwargs):
        result = self.rule_fwd(*args, **kwargs)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise CustomFunctionError(
                f"the forward of custom_vjp function {self.name} must return (output, residuals), got {type(result).__name__}"
            )
        return result

    def bwd(self, state, out, cts):
        _, spec = pytree.tree_flatten(out)
        return self.rule_bwd(state, pytree.tree_unflatten(list(cts), spec))


class _JvpKind(_Kind):
    """A ``custom_jvp`` function: its VJP is the transpose of the user's (linear) tangent map.

    The forward is the function itself; the backward differentiates ``t -> jvp(primals, t)[1]``,
    which is linear in ``t``, at ``t = 0`` with the cotangent as seed: that is the tangent map's
    transpose, as JAX derives reverse mode from a ``custom_jvp``. Traced, its torch calls become
    the generated backward; ``fxtools.jvp``, which transposes the backward again, gets the
    user's tangent map back.
    """

    def __init__(self, fn: custom_jvp, where: str):
        assert fn.jvp is not None  # custom_jvp.__call__ refuses a function without a rule
        self.fn, self.name, self.where = fn, fn.__name__, where
        self.rule_jvp = fn.jvp

    def primal(self, *args, **kwargs):
        return self.fn.fun(*args, **kwargs)

    def fwd(self, *args, **kwargs):
        if kwargs:
            raise CustomFunctionError(
                f"custom_jvp function {self.name} (at {self.where}) was called with keyword arguments; "
                "its jvp rule takes (primals, tangents) tuples of the positional arguments, so pass them positionally"
            )
        return self.fn.fun(*args), args

    def bwd(self, state, out, cts):
        primals = tuple(state)
        leaves, spec = pytree.tree_flatten(primals)
        diff = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())]
        out_leaves, out_spec = pytree.tree_flatten(out)
        mode = proxy_tensor.get_proxy_mode()
        before = set(mode.tracer.graph.nodes) if mode is not None else set()
        with torch.enable_grad():
            seeds = {i: torch.zeros_like(leaves[i]).requires_grad_(True) for i in diff}
            tangents = pytree.tree_unflatten([seeds.get(i) for i in range(len(leaves))], spec)
            result = self.rule_jvp(primals, tangents)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise CustomFunctionError(
                    f"the jvp rule of custom_jvp function {self.name} (at {self.where}) must return "
                    f"(primal_out, tangent_out), got {type(result).__name__}"
                )
            t_leaves, t_spec = pytree.tree_flatten(result[1])
            if t_spec != out_spec:
                raise CustomFunctionError(
                    f"the jvp rule of custom_jvp function {self.name} (at {self.where}) returned a tangent "
                    "whose structure differs from the function's output"
                )
            pairs = [
                (t, c)
                for t, c, o in zip(t_leaves, cts, out_leaves)
                if isinstance(t, torch.Tensor) and t.requires_grad and c is not None and isinstance(o, torch.Tensor)
            ]
            inputs = [seeds[i] for i in diff]
            grads = (
                torch.autograd.grad([t for t, _ in pairs], inputs, [c for _, c in pairs], allow_unused=True)
                if pairs and inputs
                else [None] * len(inputs)
            )
        if mode is not None:
            _drop_grad_mode_switches(mode.tracer.graph, before)  # enable_grad only served the transposition
        per_leaf: list = [None] * len(leaves)
        for i, g in zip(diff, grads):
            per_leaf[i] = g
        return pytree.tree_unflatten(per_leaf, spec)


class _Ctx:
    """Stand-in for the ``ctx`` of a ``torch.autograd.Function`` (see module docstring)."""

    def __init__(self, kind, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self.to_save = ()
        self._nondiff = []
        self._kind = kind

    def save_for_backward(self, *tensors):
        self.to_save = tensors

    def save_for_forward(self, *tensors):
        self.saved_for_forward = tensors

    @property
    def saved_tensors(self):
        return tuple(self.to_save)

    saved_variables = saved_tensors

    def mark_non_differentiable(self, *tensors):
        self._nondiff.extend(tensors)

    def set_materialize_grads(self, value: bool):
        self.materialize_grads = bool(value)

    def mark_dirty(self, *tensors):
        raise CustomFunctionError(
            f"the torch.autograd.Function {self._kind.name} (at {self._kind.where}) modifies its inputs in place "
            "(ctx.mark_dirty), which fxtools does not support; return a new tensor instead"
        )


def _unwrap_once_differentiable(fn):
    """``@once_differentiable`` runs the backward under ``no_grad``; fxtools traces the function it wraps."""
    code = getattr(fn, "__code__", None)
    if code is not None and "once_differentiable" in getattr(code, "co_qualname", "") and hasattr(fn, "__wrapped__"):
        return fn.__wrapped__
    return fn


class _FunctionKind(_Kind):
    def __init__(self, cls, where: str):
        self.cls, self.name, self.where = cls, cls.__qualname__, where
        self.setup_context = torch.autograd.function._is_setup_context_defined(cls.setup_context)

    def bind(self, args, kwargs):
        if not self.setup_context:
            return args, kwargs
        bound = inspect.signature(self.cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.args, bound.kwargs

    def primal(self, *args, **kwargs):
        return self.fwd(*args, **kwargs)[0]

    def fwd(self, *args, **kwargs):
        needs = tuple(isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()) for a in args)
        ctx = _Ctx(self, needs)
        if self.setup_context:
            out = self.cls.forward(*args, **kwargs)
            self.cls.setup_context(ctx, args, out)
        else:
            out = self.cls.forward(ctx, *args, **kwargs)
        return out, ctx

    def flatten_out(self, out):
        # autograd.Function outputs are a tensor or a tuple of them; nothing nested is flattened
        if isinstance(out, tuple):
            return list(out), pytree.tree_flatten(tuple(range(len(out))))[1]
        return [out], pytree.tree_flatten(0)[1]

    def nondiff(self, state, out_leaves):
        marked = {id(t) for t in state._nondiff}
        return {i for i, o in enumerate(out_leaves) if id(o) in marked}

    def materialize(self, state):
        return state.materialize_grads

    def bwd(self, state, out, cts):
        backward = _unwrap_once_differentiable(self.cls.backward)
        return backward(state, *cts)


# ---------------------------------------------------------------------------------------------
# The node target


class CustomCall:
    """Target of the captured node of one call: runs the function; carries its VJP rule.

    Called with the call's tensor leaves (the node's arguments), it rebuilds the arguments from
    them and the constants, and returns the node's value: the output tensor, or the tuple of
    output tensor leaves.
    """

    def __init__(self, kind: _Kind, leaves, spec, tensor_pos, shapes, out_spec, out_tensor_pos, single, where):
        self.kind, self.shapes = kind, shapes
        self.__name__ = self.__qualname__ = _snake(kind.name)
        self.__module__ = "fxtools.capture.custom"
        self.leaves, self.spec, self.tensor_pos = leaves, spec, tensor_pos
        self.out_spec, self.out_tensor_pos, self.single = out_spec, out_tensor_pos, single
        self.where = where
        self.vjp_rule = Rule(self._fwd, self._bwd, "custom")

    def __repr__(self):
        return f"<custom call of {self.kind.name}>"

    def arguments(self, tensors):
        full = list(self.leaves)
        for i, t in zip(self.tensor_pos, tensors):
            full[i] = t
        return pytree.tree_unflatten(full, self.spec)

    def node_value(self, out):
        leaves, spec = self.kind.flatten_out(out)
        tensors = [leaves[i] if i < len(leaves) else None for i in self.out_tensor_pos]
        if spec != self.out_spec or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise CustomFunctionError(
                f"{self.kind.name} (at {self.where}) returned outputs of another "
                "structure when fxtools traced its rule than when it captured the call"
            )
        return tensors[0] if self.single else tuple(tensors)

    def __call__(self, *tensors):
        args, kwargs = self.arguments(tensors)
        with _not_capturing():
            return self.node_value(self.kind.primal(*args, **kwargs))

    def _fwd(self, *tensors):
        args, kwargs = self.arguments(tensors)
        mode = proxy_tensor.get_proxy_mode()
        before = set(mode.tracer.graph.nodes) if mode is not None else set()
        with _not_capturing():
            out, state = self.kind.fwd(*args, **kwargs)
        if mode is not None:
            _drop_grad_mode_switches(mode.tracer.graph, before)
        return self.node_value(out), (state, out)

    def _bwd(self, aux, ct):
        state, out = aux
        leaves, _ = self.kind.flatten_out(out)
        ct = (ct,) if self.single else tuple(ct)
        nondiff = self.kind.nondiff(state, leaves)
        materialize = self.kind.materialize(state)
        cts = [None] * len(leaves)
        for i, c in zip(self.out_tensor_pos, ct):
            if i in nondiff:
                c = None
            if c is None and materialize:
                c = torch.zeros_like(leaves[i])
            cts[i] = c
        with _not_capturing():
            grads = self.kind.bwd(state, out, cts)
        return self._input_cotangents(grads)

    def _input_cotangents(self, grads):
        """One cotangent (or None) per tensor leaf of the arguments, from one per positional argument."""
        args, _ = pytree.tree_unflatten(list(self.leaves), self.spec)
        if not isinstance(grads, (tuple, list)):
            grads = (grads,)
        grads = tuple(grads)
        extra = grads[len(args) :]
        if len(grads) < len(args) or any(g is not None for g in extra):
            raise CustomFunctionError(
                f"the backward of {self.kind.name} (at {self.where}) returned {len(grads)} gradients for "
                f"{len(args)} inputs: return one per input (None where there is none)"
            )
        flat = []
        for arg, g in zip(args, grads[: len(args)]):
            n = len(pytree.tree_leaves(arg))
            if g is None:
                flat.extend([None] * n)
            else:
                leaves = pytree.tree_leaves(g, is_leaf=lambda x: x is None) if n != 1 else [g]
                if len(leaves) != n:
                    raise CustomFunctionError(
                        f"the backward of {self.kind.name} (at {self.where}) returned a gradient whose structure "
                        f"differs from its input's ({len(leaves)} leaves for {n})"
                    )
                flat.extend(leaves)
        flat.extend([None] * (len(self.leaves) - len(flat)))  # keyword arguments get none
        return tuple(self._fit(flat[i], shape) for i, shape in zip(self.tensor_pos, self.shapes))

    def _fit(self, g, shape):
        if g is None or not isinstance(g, torch.Tensor):
            return None
        if g.shape != shape:
            try:
                expandable = torch.broadcast_shapes(g.shape, shape) == g.shape  # autograd sums these
            except RuntimeError:
                expandable = False
            if not expandable:
                raise CustomFunctionError(
                    f"the backward of {self.kind.name} (at {self.where}) returned a gradient of shape "
                    f"{list(g.shape)} for an input of shape {list(shape)}"
                )
            g = g.sum_to_size(shape)
        return g


def _snake(name: str) -> str:
    """``StraightThroughRound`` -> ``straight_through_round`` (node names), ``STE`` -> ``ste``."""
    name = name.split(".")[-1].strip("_<>") or "custom"
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


# ---------------------------------------------------------------------------------------------
# Recording a call while capturing


class _NoForeignTracedTensors(TorchDispatchMode):
    """Reject ops inside a custom function that read a traced tensor it did not get as an argument."""

    def __init__(self, tracer, inputs, kind):
        super().__init__()
        self.tracer, self.inputs, self.kind = tracer, {id(t) for t in inputs}, kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in pytree.tree_leaves((args, kwargs or {})):
            if (
                isinstance(a, FakeTensor)
                and id(a) not in self.inputs
                and proxy_tensor.get_proxy_slot(a, self.tracer, None) is not None
            ):
                raise CustomFunctionError(
                    f"{self.kind.name} (at {self.kind.where}) uses a tensor it does not receive as an argument "
                    f"(read at {current_user_line()}; "
                    "a closed-over value that fxtools traces); pass it as an argument so that it gets "
                    "its gradient from the function's backward"
                )
        return func(*args, **(kwargs or {}))


def _drop_grad_mode_switches(graph, before) -> bool:
    """Erase the grad-mode switches a forward traced into ``graph``; False if it traced anything else.

    Autograd runs a Function's forward under ``no_grad`` whatever it says, and what matters for
    differentiation is its backward; a ``no_grad`` block in the forward must not make fxtools treat
    the traced forward ops as constants when it differentiates them again (``hvp``).
    """
    added = [n for n in graph.nodes if n not in before]
    switches = [n for n in added if n.target is torch._C._set_grad_enabled and not n.users]
    for node in reversed(switches):
        graph.erase_node(node)
    return len(switches) == len(added)


def _storage(t):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a tensor without storage aliases nothing
        return None


def _record(kind: _Kind, args, kwargs):
    """Add one node calling ``kind`` to the graph being captured and return its traced outputs."""
    mode = proxy_tensor.get_proxy_mode()
    where = kind.where
    if mode is None:
        with _not_capturing():
            return kind.primal(*args, **kwargs)
    tracer = mode.tracer
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensor_pos = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
    tensors = [leaves[i] for i in tensor_pos]
    consts = [None if i in tensor_pos else a for i, a in enumerate(leaves)]
    before = set(tracer.graph.nodes)
    versions = [t._version for t in tensors]
    with proxy_tensor.disable_proxy_modes_tracing(), _not_capturing(), _NoForeignTracedTensors(tracer, tensors, kind):
        out, state = kind.fwd(*args, **kwargs)
    if not _drop_grad_mode_switches(tracer.graph, before):
        raise CustomFunctionError(f"internal error: running {kind.name} (at {where}) added nodes to the graph")
    if [t._version for t in tensors] != versions:
        raise CustomFunctionError(
            f"{kind.name} (at {where}) modifies an argument in place, which fxtools does not support "
            "for functions with their own backward; return a new tensor instead"
        )
    out_leaves, out_spec = kind.flatten_out(out)
    out_tensor_pos = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)]
    if not out_tensor_pos:
        return out
    nondiff = kind.nondiff(state, out_leaves)
    in_storages = {_storage(t) for t in tensors} - {None}
    vals = []
    with proxy_tensor.disable_proxy_modes_tracing():
        for i in out_tensor_pos:
            o = out_leaves[i]
            vals.append(o.clone() if _storage(o) in in_storages else o)  # a fresh value, not an alias
    single = len(out_leaves) == 1 and not isinstance(out, (tuple, list, dict)) and out_tensor_pos == [0]
    out_consts = [None if i in out_tensor_pos else o for i, o in enumerate(out_leaves)]
    call = CustomCall(kind, consts, spec, tensor_pos, [t.shape for t in tensors], out_spec, out_tensor_pos, single, where)
    proxy = tracer.create_proxy("call_function", call, tuple(tracer.unwrap_proxy(t) for t in tensors), {}, name=call.__name__)
    value = vals[0] if single else tuple(vals)
    proxy_tensor.track_tensor_tree(value, proxy, constant=None, tracer=tracer)
    node = proxy.node
    meta.RULE.set(node, call.vjp_rule)
    meta.CUSTOM.set(node, kind.name)
    result = list(out_consts)
    for i, v in zip(out_tensor_pos, vals):
        result[i] = v.detach() if i in nondiff else v
    return pytree.tree_unflatten(result, out_spec)


# the transform while a nested torch.func transform is traced (capture/nested.py)
NESTED = Transform("torch.func")


def _forward_is_its_derivative(cls) -> bool:
    """Functions whose backward is just the derivative of their forward: PyTorch's own
    ``ModIndex`` (``bias[h]`` inside a flex_attention ``score_mod``)."""
    return cls.__module__ == "torch._dynamo._trace_wrapped_higher_order_op" and cls.__name__ == "ModIndex"


def _nested_error(what: str, where: str) -> CustomFunctionError:
    return CustomFunctionError(
        f"{what} (at {where}) has its own backward and is called inside a torch.func transform "
        "(vmap, grad, ...) inside the function fxtools differentiates. fxtools traces such a "
        "transform op by op and would differentiate the forward's ops, not the backward; call the "
        "function outside the transform (a batched call, or fxtools.vmap of fxtools.grad)"
    )


def _function_apply(cls, original, args, kwargs):
    """``Function.apply`` while fxtools captures."""
    kind = _FunctionKind(cls, current_user_line())
    base = torch.autograd.Function
    if not _STATE.get().capturing:
        return original.__get__(None, cls)(*args, **kwargs)
    handlers = dict(_STATE.get().handlers)
    if cls in handlers:
        handler = handlers[cls]

        def apply(*args, **kwargs):
            with _not_capturing():
                return original.__get__(None, cls)(*args, **kwargs)

        return apply(*args, **kwargs) if handler is None else handler(apply, *args, **kwargs)
    building = _STATE.get().transform
    if building is NESTED:
        if not _forward_is_its_derivative(cls):
            raise _nested_error(f"the torch.autograd.Function {kind.name}", kind.where)
        args, kwargs = kind.bind(args, kwargs)
        with _not_capturing():
            return kind.primal(*args, **kwargs)
    if (building is not None and building.batches) or not _STATE.get().record:
        if cls.vmap is not base.vmap:
            raise CustomFunctionError(
                f"the torch.autograd.Function {kind.name} (at {kind.where}) defines its own vmap rule, "
                "which fxtools.vmap does not use; fxtools would batch its forward instead. Remove the "
                "vmap staticmethod (or set generate_vmap_rule=True) if batching the forward is right"
            )
        args, kwargs = kind.bind(args, kwargs)
        with _not_capturing():
            return kind.primal(*args, **kwargs)
    if building is not None and building.forward_mode and cls.jvp is not base.jvp:
        raise CustomFunctionError(
            f"the torch.autograd.Function {kind.name} (at {kind.where}) defines its own jvp, which "
            f"{building.name} does not use (it transposes the backward instead); remove the jvp staticmethod "
            "if its backward is the rule to use"
        )
    args, kwargs = kind.bind(args, kwargs)
    return _record(kind, args, kwargs)


# ---------------------------------------------------------------------------------------------
# The decorator


class custom_vjp:  # noqa: N801 - named like jax.custom_vjp
    """A function with a hand-written VJP, as ``jax.custom_vjp``::

        @fxtools.custom_vjp
        def clip(x, lo, hi):
            return x.clamp(lo, hi)
        def clip_fwd(x, lo, hi):
            return x.clamp(lo, hi), (x, lo, hi)      # output, residuals
        def clip_bwd(res, ct):
            x, lo, hi = res
            return ct * ((x >= lo) & (x <= hi)), None, None   # one per argument
        clip.defvjp(clip_fwd, clip_bwd)

    Called eagerly (or under ``torch.autograd``) it just runs the function. Under fxtools the
    call is one node whose rule is ``(clip_fwd, clip_bwd)``: their torch calls become the
    generated code. ``ct`` has the structure of the output, with zeros where no cotangent
    arrives; non-tensor arguments are constants and get ``None``.
    """

    def __init__(self, fun):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.fwd: Callable[..., Any] | None = None
        self.bwd: Callable[..., Any] | None = None

    def defvjp(self, fwd, bwd):
        self.fwd, self.bwd = fwd, bwd
        return self

    def __call__(self, *args, **kwargs):
        if not (_STATE.get().capturing and _STATE.get().record):
            return self.fun(*args, **kwargs)
        if _STATE.get().transform is NESTED:
            raise _nested_error(f"custom_vjp function {self.__name__}", current_user_line())
        if self.fwd is None:
            raise CustomFunctionError(
                f"custom_vjp function {self.__name__} (at {current_user_line()}) has no rule: call .defvjp(fwd, bwd) first"
            )
        return _record(_VjpKind(self, current_user_line()), args, kwargs)


class custom_jvp:  # noqa: N801 - named like jax.custom_jvp
    """A function with a hand-written JVP, as ``jax.custom_jvp``::

        @fxtools.custom_jvp
        def softplus(x):
            return torch.log1p(torch.exp(x))
        @softplus.defjvp
        def softplus_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return softplus(x), t * torch.sigmoid(x)

    ``jvp(primals, tangents)`` gets tuples of the positional arguments and their tangents
    (``None`` for arguments that are not floating-point tensors) and returns ``(out,
    tangent_out)``; the tangent must be linear in ``tangents``. ``fxtools.jvp`` uses it, and
    reverse mode (``vjp``, ``grad``, ``split``, ``hvp``) uses its transpose, derived by
    fxtools, so one rule serves both modes. Called eagerly (or under ``torch.autograd``) the
    function just runs; under fxtools the value is the function's own output (JAX takes it from
    the jvp rule; the two must agree).
    """

    def __init__(self, fun):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.jvp: Callable[..., Any] | None = None

    def defjvp(self, jvp):
        self.jvp = jvp
        return jvp

    def __call__(self, *args, **kwargs):
        if not (_STATE.get().capturing and _STATE.get().record):
            return self.fun(*args, **kwargs)
        if self.jvp is None:
            raise CustomFunctionError(
                f"custom_jvp function {self.__name__} (at {current_user_line()}) has no rule: call .defjvp(jvp) first"
            )
        return _record(_JvpKind(self, current_user_line()), args, kwargs)
