"""``torch.func`` transforms (vmap, grad, vjp, jvp, jacrev, jacfwd, hessian) inside captured code.

fxtools captures at PyTorch's pre-dispatch level, which sits above functorch: a transform nested
in the function would only show its unbatched inner values there (or, for ``torch.func.grad``,
trace to a wrong graph). So while capturing, each call of a transform is traced on its own,
*below* functorch (``make_fx`` without pre-dispatch, sharing the outer trace's FakeTensor mode),
the way ``fxtools.vmap`` batches: what is recorded is what functorch runs, i.e. batched ops for
``vmap`` (one ``mm`` on the whole batch, not a loop) and the backward's ATen ops for ``grad``.
That graph is then replayed op by op on the outer trace's values, so the captured program holds
ordinary ATen ops that every later stage (rules, ``jvp``, ``split``, ``compile``) differentiates
like any others. Tensors the transformed function closes over (values computed earlier in the
function, parameters) come out of the inner trace as constants; replayed, they are the outer
values themselves, so gradients flow through them.

Caught at the points every public spelling goes through: ``vmap_impl`` (``torch.vmap``,
``torch.func.vmap``, the vmaps inside ``jacrev``/``jacfwd`` and ``flex_attention``),
``grad_and_value_impl`` (``grad``, ``grad_and_value``), ``_vjp_with_argnums`` (``vjp``,
``jacrev``) and ``_jvp_with_argnums`` (``jvp``). A functorch level entered any other way (say
``torch.func.linearize``) raises ``NestedTransformError`` naming the user's line, as does a
transform whose inner trace fails (with functorch's reason). A function with its own backward
(``torch.autograd.Function``, ``fxtools.custom_vjp``) called inside such a transform is refused
(``capture/custom.py``): the transform's ops would carry the forward's derivative, not its backward.

Dynamo's graphs (the ``torch.compile`` backend) spell a transform out as functorch's level
bookkeeping around the user's ops; ``functorch_regions`` makes each such region one call traced
the same way. ``fxtools.vmap`` traces below functorch already and only shares ``out_of_place_views``.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental import proxy_tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import FxtoolsError, current_user_line, is_data_dependent, user_frame
from ..passes.views import collapse_view_chains
from . import custom, dual
from .patching import patched

__all__ = [
    "NestedTransformError",
    "capturing_program",
    "functorch_regions",
    "nested_transforms",
    "out_of_place_views",
    "run_below_functorch",
]


class NestedTransformError(FxtoolsError):
    """A ``torch.func`` transform inside a function fxtools differentiates that it cannot trace."""


_BELOW: contextvars.ContextVar[int] = contextvars.ContextVar("fxtools_traced_below_functorch", default=0)


# Set while fxtools captures a program (``nested_transforms``): its trace may run below autograd
# (an autocast region, DTensors), where the program's transforms are traced as at pre-dispatch.
_PROGRAM: contextvars.ContextVar[bool] = contextvars.ContextVar("fxtools_capturing_a_program", default=False)


def _below() -> bool:
    """Whether the running code is already traced below functorch (inside a transform's trace)."""
    return _BELOW.get() > 0


@contextlib.contextmanager
def _tracing_below():
    token = _BELOW.set(_BELOW.get() + 1)
    try:
        yield
    finally:
        _BELOW.reset(token)


def _refusal(transform: str) -> NestedTransformError:
    return NestedTransformError(
        f"a torch.func {transform} transform (at {current_user_line()}) is nested inside the function fxtools "
        "is differentiating, reached by a path fxtools cannot trace (it supports torch.func.vmap, grad, "
        "grad_and_value, vjp, jvp, jacrev, jacfwd and hessian there). Write the computation with those, "
        "or compose fxtools' own transforms instead, e.g. fxtools.vmap(fxtools.grad(f, ...), ...), fxtools.jvp "
        "or fxtools.hvp."
    )


@contextlib.contextmanager
def _outside_pre_dispatch():
    """Hide the outer trace's pre-dispatch modes while a transform is traced below functorch:
    they would record functorch's own bookkeeping (``_vmap_increment_nesting``, grad mode
    switches, the inner ops' views) into the outer graph."""
    from torch._ops import _get_dispatch_mode_pre_dispatch, _set_mode_pre_dispatch, unset_mode_pre_dispatch

    key = torch._C._TorchDispatchModeKey.PROXY
    proxy = unset_mode_pre_dispatch(key) if _get_dispatch_mode_pre_dispatch(key) is not None else None
    stack = torch.overrides._get_current_function_mode_stack()
    kept = [m for m in stack if not isinstance(m, proxy_tensor.PreDispatchTorchFunctionMode)]
    _set_function_modes(stack, kept)
    try:
        yield
    finally:
        _set_function_modes(kept, stack)
        if proxy is not None:
            _set_mode_pre_dispatch(proxy)


def _set_function_modes(current: list, new: list) -> None:
    for _ in current:
        torch._C._pop_torch_function_stack()
    for mode in new:
        torch._C._push_on_torch_function_stack(mode)


def _sub_tracer(parent):
    return proxy_tensor._MakefxTracer(
        parent.decomposition_table,
        "fake",
        parent._allow_non_fake_inputs,
        False,  # below functorch: batched and backward ops, not the transform's inner view
        parent.record_module_stack,
        parent._allow_fake_constant,
        parent._error_on_data_dependent_ops,
        parent_tracer=parent,
    )


class _DevicesFromInputs(TorchDispatchMode):
    """Gives ops that PyTorch's C++ autograd asks for on the ``meta`` device the device of the
    transform's inputs. Under FakeTensors, functorch's wrappers of forward-mode tensors can report
    the ``meta`` device of the fake storage to autograd's C++ (``validate_outputs``'s ``grad.to``,
    ``_new_zeros_with_same_feature_meta``'s zeros, ``silu``'s double backward): ``vmap(hessian(f))``
    of a SiLU network, or of any network at a transposed input, then mixed devices and failed.
    Only while the transform's inputs share one device other than ``meta``; a tensor created on
    ``meta`` inside such a transform is then created on that device too."""

    def __init__(self, inputs):
        super().__init__()
        devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
        self.device = devices.pop() if len(devices) == 1 and "meta" not in {d.type for d in devices} else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.device is not None:
            args = pytree.tree_map_only(torch.Tensor, _fake_view, args)
        device = kwargs.get("device")
        if self.device is not None and device is not None and torch.device(device).type == "meta":
            kwargs = {**kwargs, "device": self.device}
        return func(*args, **kwargs)


def _fake_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or, for a plain ``meta`` tensor that is a view of a FakeTensor, the same view of
    that FakeTensor. PyTorch's C++ autograd, batched by ``vmap`` over a closed-over tensor that
    requires grad (``vmap(hessian(u))`` of a network of parameters, a sine's or a softplus's second
    derivative), can view a gradient's fake value below the fake mode: the view is then a plain
    tensor on the fake storage's ``meta`` device, which the fake mode refuses to convert (it is
    not a leaf) when autograd moves it to its device (``validate_outputs``'s ``grad.to``)."""
    base = t._base
    if type(t) is torch.Tensor and t.device.type == "meta" and isinstance(base, FakeTensor):
        return base.as_strided(t.shape, t.stride(), t.storage_offset())
    return t


def run_below_functorch(transform: str, fn, args: tuple, where: str | None = None):
    """``fn(*args)`` (which calls a torch.func transform), traced below functorch and replayed in
    the running trace as plain ATen ops; called directly when already below functorch."""
    parent = proxy_tensor._CURRENT_MAKE_FX_TRACER
    if _below() or parent is None or not (parent.pre_dispatch or _PROGRAM.get()):
        return fn(*args)
    where = where or current_user_line()
    flat, in_spec = pytree.tree_flatten(args)
    is_tensor = [isinstance(x, torch.Tensor) for x in flat]
    out_info: dict[str, Any] = {}

    def flat_fn(*tensors):
        it = iter(tensors)
        full = [next(it) if t else x for x, t in zip(flat, is_tensor)]
        with _DevicesFromInputs(tensors):
            out = fn(*pytree.tree_unflatten(full, in_spec))
        leaves, out_info["spec"] = pytree.tree_flatten(out)
        out_info["leaves"] = leaves
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    sub = _sub_tracer(parent)
    try:
        with _tracing_below(), custom.transform(custom.NESTED), _outside_pre_dispatch(), sub._init_modes_from_parent(parent):
            sub.fx_tracer.record_stack_traces = parent.fx_tracer.record_stack_traces
            _note_grad_mode(sub.fx_tracer)
            inner = sub._trace_inner(flat_fn, *[x for x, t in zip(flat, is_tensor) if t])
    except FxtoolsError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised naming the user's line
        if is_data_dependent(exc):
            raise
        inside = user_frame(exc.__traceback__)
        inside = f" (inside it, at {inside})" if inside and inside != where else ""
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise NestedTransformError(
            f"fxtools cannot trace the torch.func {transform} at {where}{inside}: {type(exc).__name__}: {reason}"
        ) from exc
    out_of_place_views(inner)
    while collapse_view_chains(inner):
        pass
    inner.graph.eliminate_dead_code()
    results = iter(_replay(inner, [x for x, t in zip(flat, is_tensor) if t]))
    leaves = [next(results) if isinstance(x, torch.Tensor) else x for x in out_info["leaves"]]
    return pytree.tree_unflatten(leaves, out_info["spec"])


_NO_GRAD = "fxtools_no_grad"  # on an inner node: recorded while grad mode was off


def _note_grad_mode(tracer) -> None:
    """Mark the nodes ``tracer`` records while grad mode is off: the program's ``no_grad`` blocks
    inside the transformed function (below functorch no grad-mode switch is recorded)."""
    create_node = tracer.create_node

    def create_node_noting_grad_mode(*args, **kwargs):
        node = create_node(*args, **kwargs)
        if not torch.is_grad_enabled():
            node.meta[_NO_GRAD] = True
        return node

    tracer.create_node = create_node_noting_grad_mode


def _replay(inner: fx.GraphModule, tensors: list) -> list:
    """Run ``inner``'s ops in the running (outer) trace; its nodes keep the inner user lines. Ops
    the transform ran under ``no_grad`` run under it again: the outer trace records the switch,
    and their values are constants of the outer derivative, as in torch.func."""
    mode = proxy_tensor.get_innermost_proxy_mode()
    graph = mode.tracer.graph if mode is not None else None

    class Replay(fx.Interpreter):
        def run_node(self, n):
            if n.meta.get(_NO_GRAD) and torch.is_grad_enabled():
                with torch.no_grad():
                    return self.run_node(n)
            last = graph._root.prev if graph is not None else None
            out = super().run_node(n)
            trace = n.meta.get("stack_trace")
            if graph is not None and trace and n.op == "call_function" and n.target is not operator.getitem:
                node = graph._root.prev
                while node is not last and node.op != "root":
                    node.meta["stack_trace"] = trace
                    node = node.prev
            return out

    return list(Replay(inner).run(*tensors))


aten = torch.ops.aten
_INPLACE_VIEWS = {
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.default: aten.squeeze.default,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}


def out_of_place_views(gm: fx.GraphModule) -> None:
    """vmap's batching rules reshape their own fresh results in place (``mm(...)._unsafe_view(...)
    .squeeze_(1)``); when nothing else reads the tensor, that is the out-of-place view."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _INPLACE_VIEWS:
            src = node.args[0]
            if isinstance(src, fx.Node) and len(src.users) == 1 and src.op == "call_function":
                node.target = _INPLACE_VIEWS[node.target]


def _vmap_impl(original):
    def vmap_impl(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs):
        def call(args, kwargs):
            return original(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs)

        return run_below_functorch("vmap", call, (args, kwargs))

    return vmap_impl


def _grad_and_value_impl(original):
    def grad_and_value_impl(func, argnums, has_aux, args, kwargs):
        def call(args, kwargs):
            return original(func, argnums, has_aux, args, kwargs)

        return run_below_functorch("grad", call, (args, kwargs))

    return grad_and_value_impl


def _vjp_with_argnums(original):
    def vjp_with_argnums(func, *primals, argnums=None, has_aux=False):
        if _below() or proxy_tensor._CURRENT_MAKE_FX_TRACER is None:
            return original(func, *primals, argnums=argnums, has_aux=has_aux)

        def forward(primals):
            result = original(func, *primals, argnums=argnums, has_aux=has_aux)
            return (result[0], result[2]) if has_aux else result[0]

        # the vjp function runs the forward again in its own trace: the two copies are one after
        # common-subexpression elimination
        def vjp_fn(*cotangents, **kwargs):
            def backward(primals, cotangents):
                return original(func, *primals, argnums=argnums, has_aux=has_aux)[1](*cotangents, **kwargs)

            return run_below_functorch("vjp", backward, (primals, cotangents))

        result = run_below_functorch("vjp", forward, (primals,))
        return (result[0], vjp_fn, result[1]) if has_aux else (result, vjp_fn)

    return vjp_with_argnums


def capturing_program() -> bool:
    """Whether fxtools is capturing the program itself (not a transform traced below functorch)."""
    return _at_top()


def _at_top() -> bool:
    parent = proxy_tensor._CURRENT_MAKE_FX_TRACER
    return not _below() and parent is not None and (parent.pre_dispatch or _PROGRAM.get())


def _jvp_with_argnums(original):
    def jvp_with_argnums(func, primals, tangents, argnums=None, *, strict=False, has_aux=False):
        if _at_top():  # forward mode in the program: fxtools' own (capture/dual.py)
            return dual.jvp(func, primals, tangents, argnums, strict=strict, has_aux=has_aux)
        return original(func, primals, tangents, argnums, strict=strict, has_aux=has_aux)

    return jvp_with_argnums


def _linearize(original):
    def linearize(func, *primals):
        if _at_top():
            raise _refusal("linearize")
        return original(func, *primals)

    return linearize


@contextlib.contextmanager
def nested_transforms():
    """While active, torch.func transforms are traced below functorch and replayed (see the module
    docstring); functorch levels entered any other way raise ``NestedTransformError``."""
    # Dynamo's table of functorch's context managers holds the functions it finds when imported:
    # import it before they are wrapped below, or a later torch.compile of torch.func.jvp fails
    import torch._dynamo.variables.torch  # noqa: F401
    import torch._functorch.apis as apis
    import torch._functorch.eager_transforms as eager
    import torch._functorch.vmap as vmap
    import torch.func

    wrappers = [
        (apis, "vmap_impl", _vmap_impl),
        (eager, "grad_and_value_impl", _grad_and_value_impl),
        (eager, "_vjp_with_argnums", _vjp_with_argnums),
        (eager, "_jvp_with_argnums", _jvp_with_argnums),
        # torch.func.linearize runs forward_ad under its own make_fx, which would trace a wrong graph
        (eager, "linearize", _linearize),
        (torch.func, "linearize", _linearize),
    ]
    levels = [
        (vmap, "vmap_increment_nesting", "vmap"),
        (eager, "grad_increment_nesting", "grad/vjp"),
        (eager, "jvp_increment_nesting", "jvp"),
    ]
    replaced = [(module, name, wrap(getattr(module, name))) for module, name, wrap in wrappers]
    replaced += [(module, name, _guarded_level(getattr(module, name), transform)) for module, name, transform in levels]
    token = _PROGRAM.set(True)
    try:
        with contextlib.ExitStack() as stack:
            for module, name, replacement in replaced:
                stack.enter_context(patched(module, **{name: replacement}))
            with dual.forward_ad_levels(_at_top):  # torch.autograd.forward_ad: fxtools' forward mode too
                yield
    finally:
        _PROGRAM.reset(token)


def _guarded_level(original, transform: str):
    def enter(*args, **kwargs):
        if not _below():
            raise _refusal(transform)
        return original(*args, **kwargs)

    return enter


# ---------------------------------------------------------------------------------------------
# Dynamo's graphs (the torch.compile backend)

_ENTER = {
    "_vmap_increment_nesting": "vmap",
    "_grad_increment_nesting": "grad",
    "_jvp_increment_nesting": "jvp",
    "_enter_dual_level": "jvp",
    "_saved_tensors_hooks_disable": "grad",
}
_EXIT = {"_vmap_decrement_nesting", "_grad_decrement_nesting", "_jvp_decrement_nesting", "_exit_dual_level"}
_EXIT_ALSO = {"_saved_tensors_hooks_enable"}


def _functorch_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", None)
    return name if name in _ENTER or name in _EXIT or name in _EXIT_ALSO or name == "lazy_load_decompositions" else None


def functorch_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Each torch.func transform in a Dynamo graph as one call traced by ``run_below_functorch``.

    Dynamo spells a transform out as functorch's own bookkeeping around the user's ops
    (``_vmap_increment_nesting``, ``_add_batch_dim``, the ops, ``_remove_batch_dim``,
    ``_vmap_decrement_nesting``), which means nothing above functorch. Every outermost such
    region becomes a submodule run by ``run_functorch_region``: below functorch while fxtools
    captures (batched ops, the backward's ops), as it is otherwise. The bodies of higher-order ops
    (a ``torch.utils.checkpoint`` region holding a ``torch.func.jvp``) are outlined in turn.
    """
    for sub in list(gm.children()):
        if isinstance(sub, fx.GraphModule):
            functorch_regions(sub)
    nodes = list(gm.graph.nodes)
    regions, depth, start = [], 0, 0
    for i, node in enumerate(nodes):
        name = _functorch_name(node)
        if name in _ENTER:
            if depth == 0:
                start = i
                while start > 0 and _functorch_name(nodes[start - 1]) == "lazy_load_decompositions":
                    start -= 1
            depth += 1
        elif name in _EXIT or (name in _EXIT_ALSO and depth > 0):
            depth -= 1
            if depth == 0:
                end = i + 1
                while end < len(nodes) and _functorch_name(nodes[end]) in _EXIT_ALSO:
                    end += 1
                regions.append(nodes[start:end])
    for k, region in enumerate(regions):
        _outline(gm, region, f"functorch_region_{k}")
    if regions:
        gm.recompile()
    return gm


def _outline(gm: fx.GraphModule, region: list[fx.Node], name: str) -> None:
    from ..errors import user_line_of

    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in region:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    gm.add_submodule(name, fx.GraphModule(gm, graph))
    kind = next(_ENTER[_functorch_name(n) or ""] for n in region if _functorch_name(n) in _ENTER)
    where = next((w for w in map(user_line_of, region) if w), None)
    with gm.graph.inserting_after(region[-1]):
        body = gm.graph.get_attr(name)
    with gm.graph.inserting_after(body):
        call = gm.graph.call_function(run_functorch_region, (kind, where, body, *inputs))
    call.meta["stack_trace"] = next((n.meta["stack_trace"] for n in region if n.meta.get("stack_trace")), None)
    last = call
    for i, o in enumerate(outputs):
        with gm.graph.inserting_after(last):
            last = gm.graph.call_function(operator.getitem, (call, i))
        last.meta = dict(o.meta)
        o.replace_all_uses_with(last)
    for n in reversed(region):
        gm.graph.erase_node(n)


def run_functorch_region(kind: str, where: str | None, body: fx.GraphModule, *inputs):
    """A region of functorch calls from a Dynamo graph (``functorch_regions``); forward mode alone
    is recorded with fxtools' markers (``capture/dual.py``), as ``torch.func.jvp`` is."""
    if kind == "jvp" and _at_top() and dual.is_jvp_region(body):
        return tuple(dual.run_jvp_region(body, inputs))
    return run_below_functorch(kind, body, inputs, where)
