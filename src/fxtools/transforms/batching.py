"""``vmap(f, *args, in_dims, out_dims)``: ``f`` over a batch dimension, as batched PyTorch code.

How: PyTorch already knows how to batch every op (``torch.func.vmap``'s batching rules), so
fxtools traces ``torch.func.vmap(f)`` itself, with ``make_fx`` on FakeTensors. The trace is taken
below the functorch layer (not at the pre-dispatch level fxtools uses for differentiation, which
sits above vmap and would only see vmap's unbatched inner values), so what is recorded is the
batched ops: one ``mm`` on the whole batch, not a Python loop. The graph then goes through the
same clean-up as every fxtools result (functionalisation of vmap's in-place ``squeeze_``,
simplification, collapsing of reshape chains that end where they started, public names), and
is assembled to take the user's pytree arguments with their batch dimensions.

Composition: the result is an ordinary GraphModule, so ``fxtools.grad`` of it and ``vmap`` of an
``fxtools.grad`` module both work; per-sample gradients are
``fxtools.vmap(fxtools.grad(loss, params, x0, y0), params, xs, ys, in_dims=(None, 0, 0))``.

Limits (errors, never wrong results): vmap cannot batch data-dependent Python control flow,
``.item()``, or in-place updates of unbatched tensors by batched values (a BatchNorm in
training mode updating its running statistics); such programs raise ``FxtoolsError`` naming the
user's line and PyTorch's explanation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._functorch.eager_transforms import enable_inplace_requires_grad
from torch.fx.experimental import proxy_tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..capture import custom
from ..capture.trace import capture, is_data_dependent
from ..codegen.inplace import printed_in_place
from ..errors import DataDependentError, FxtoolsError, current_user_line, generated_frame, user_frame, user_line_of
from ..graph import meta
from ..graph.data_dependent import dynamic_nodes
from ..graph.nodes import is_reshaped_view, is_view_refusal, view_strides, written_args
from .pipeline import Inputs, Transform, back, front, uses_pipeline
from .retrace import NodeNamer
from .vjp import argument_names

__all__ = ["vmap", "trace_batched", "check_vmap_options", "describe", "n_chunks", "share_draws"]


def vmappable(f):
    """``f``, with the ``cond`` calls of a generated GraphModule turned into ``select_cond``, and
    its scatters into fresh tensors printed out of place (vmap refuses ``zeros.index_add_(...,
    batched)``, an unbatched tensor written with batched rows). Attributes stay shared.

    Its ``.view`` calls stay: fxtools drops ``.contiguous()`` before a ``.view`` when the example
    value is contiguous, and under vmap the same value may be a non-contiguous slice of a batched
    tensor; ``BatchedViews`` computes such a view as ``reshape`` where one sample allows it.
    """
    if not isinstance(f, fx.GraphModule):
        return f
    if not any(n.target is torch.ops.higher_order.cond or printed_in_place(n) for n in f.graph.nodes):
        return f
    return _code_copy(f, select=True)


def _code_copy(f: fx.GraphModule, select: bool = False) -> fx.GraphModule:
    """A GraphModule running ``f``'s code without its guards (``select``: ``cond`` as ``select_cond``)."""
    graph = fx.Graph()
    out = graph.graph_copy(f.graph, {})
    graph.output(out)
    if select:
        for n in graph.nodes:
            if n.target is torch.ops.higher_order.cond:
                n.target = select_cond
    gm = fx.GraphModule(f, graph, class_name=f.__class__.__name__)
    gm.meta.update(getattr(f, "meta", {}))
    if select:
        # a cond's branches run under vmap too: their scatters into fresh tensors, printed in place,
        # would write batched rows into an unbatched tensor (copies: ``f``'s own stay as they are)
        for n in graph.nodes:
            if n.op == "get_attr" and isinstance(sub := getattr(gm, n.target, None), fx.GraphModule):
                setattr(gm, n.target, vmappable(sub))
    return gm


_SHAPE_VIEWS: dict[Callable, Callable] = {torch.Tensor.view: torch.Tensor.reshape, torch.Tensor.view_as: torch.Tensor.reshape_as}


class BatchedViews(TorchFunctionMode):
    """While vmap's batched trace runs: a ``.view`` (``view_as``) its batched operand's layout
    refuses is computed as ``.reshape`` (a copy), its nodes marked ``meta.RESHAPED_VIEW``.

    A batched value's layout is not one sample's: PyTorch's batching rules lay results out as
    suits the whole batch (``v.unsqueeze(1) * (A @ x)`` is transposed per sample under vmap,
    contiguous in eager), so ``torch.func.vmap`` refuses views that a loop over samples runs.
    Whether one sample allows the view is decided afterwards (``check_one_sample``): where eager
    refuses it too, the transform refuses, naming the user's line. ``seen`` lists the user's
    line of each view computed as ``reshape``."""

    def __init__(self, where: Callable[[], str | None] | None = None):
        super().__init__()
        self.seen: list[str] = []
        self.where = where  # the line being run, when a generated module is batched (NodeNamer)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reshape = _SHAPE_VIEWS.get(func)
        if reshape is None or (func is torch.Tensor.view and _dtype_view(args, kwargs)):
            return func(*args, **kwargs)
        if not _refused_by_kernel(func, args, kwargs):
            try:
                return func(*args, **kwargs)
            except (RuntimeError, ValueError) as exc:
                if not is_view_refusal(exc):
                    raise
        line = (self.where() if self.where is not None else None) or current_user_line()
        mode = proxy_tensor.get_innermost_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        last = graph._root.prev if graph is not None else None
        out = reshape(*args, **kwargs)
        if graph is not None:
            made = last.next
            while made is not graph._root:
                meta.RESHAPED_VIEW.set(made, line)
                made = made.next
        self.seen.append(line)
        return out


def _refused_by_kernel(func, args, kwargs) -> bool:
    """Whether eager's view kernel refuses this ``.view`` / ``.view_as`` of a tensor with these
    (int) sizes and strides, which FakeTensor's may allow: a size-1 dimension between the merged
    ones (strides ``(4, 12, 4, 1)`` viewed as ``[3, 8]``) is viewed by FakeTensor, whose strides
    then say nothing of the real tensor's (``graph.nodes.view_strides``: ATen's rule)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return False
    if func is torch.Tensor.view_as:
        other = args[1] if len(args) > 1 else kwargs.get("other")
        shape = list(other.shape) if isinstance(other, torch.Tensor) else None
    else:
        rest = args[1:] if len(args) > 1 else (kwargs.get("size"),)
        shape = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
    if shape is None or not all(type(v) is int for v in [*x.shape, *x.stride(), *shape]):
        return False  # symbolic: the trace decides, as it did
    return view_strides(x.shape, x.stride(), shape) is None


def _dtype_view(args, kwargs) -> bool:
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    return isinstance(dtype, torch.dtype)


def _one_sample(args: tuple, in_dims) -> tuple:
    """The first sample of vmap's batched arguments: each batched tensor indexed at 0 along its
    batch dimension, in the layout eager gives that sample (a view of the argument)."""
    from torch._functorch.vmap import _broadcast_to_and_flatten

    flat, spec = pytree.tree_flatten(args)
    dims = _broadcast_to_and_flatten(in_dims, spec) or [None] * len(flat)
    return pytree.tree_unflatten([x.select(d, 0) if d is not None else x for x, d in zip(flat, dims)], spec)


def check_one_sample(f, args: tuple, in_dims, seen: list[str], made_by: Transform) -> None:
    """Refuse, naming the user's line, a batch whose one sample's ``.view`` eager PyTorch refuses.

    Called when the batched trace computed views as ``reshape`` (``BatchedViews``, ``seen``: their
    lines): ``f`` is traced again on the first sample, in its own layout, as eager runs it; a
    generated module (whose ``.view`` calls rely on its example's layout) runs on a layout its code
    cannot view as its guards run it, by the module built for that layout (``layout_variant``)."""
    sample = _one_sample(args, in_dims)
    namer = NodeNamer(_code_copy(f)) if isinstance(f, fx.GraphModule) else None
    try:
        capture(namer or f, sample, record_stack_traces=False, pre_dispatch=False)
        return
    except Exception as exc:  # noqa: BLE001 - re-raised naming the user's line
        error = _view_cause(exc)
    if namer is not None and is_view_refusal(error) and getattr(f, "layout_variant", None) is not None:
        try:
            f.layout_variant(sample)
            return
        except Exception as exc:  # noqa: BLE001 - the function itself cannot run on this layout
            error = _view_cause(exc)
    if is_view_refusal(error):
        where = user_frame(error.__traceback__)
        if namer is not None and namer.current is not None:
            where = user_line_of(namer.current) or where
        message = str(error).strip().splitlines()[0]
        raise FxtoolsError(
            f"{made_by} cannot batch {describe(f)}: the .view at {where or seen[0]} refuses one sample's layout, as eager "
            f"PyTorch does ({message}). Use .reshape (a copy where the layout needs one), or .contiguous() before the .view"
        ) from error
    raise FxtoolsError(
        f"{made_by} cannot batch {describe(f)}: the .view at {seen[0]} refuses the batched layout, and whether one "
        f"sample's layout allows it could not be decided (tracing one sample failed: {type(error).__name__}: "
        f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}). Use .reshape there"
    ) from error


def _view_cause(exc: BaseException) -> BaseException:
    """``exc``, or the view refusal a capture raised it from (``capture.trace.view_refused``)."""
    cause = exc.__cause__
    return cause if isinstance(exc, FxtoolsError) and cause is not None and is_view_refusal(cause) else exc


def refuse_writes_through_reshaped_views(gm: fx.GraphModule) -> None:
    """A view computed as ``reshape`` (``BatchedViews``) is a copy where eager's is an alias: a
    later in-place write to either would reach the other in eager and not here. Refused, naming
    the view's line."""
    copies: dict = {}
    for node in gm.graph.nodes:
        if is_reshaped_view(node):
            for x in (node, *node.all_input_nodes):
                val = x.meta.get("val")
                if isinstance(val, torch.Tensor):
                    copies.setdefault(StorageWeakRef(val.untyped_storage()), meta.RESHAPED_VIEW.get(node))
            continue
        if not copies or node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target._schema.is_mutable:
            continue
        for w in written_args(node.target, node.args, node.kwargs):
            val = w.meta.get("val") if isinstance(w, fx.Node) else None
            line = copies.get(StorageWeakRef(val.untyped_storage())) if isinstance(val, torch.Tensor) else None
            if line is not None:
                raise FxtoolsError(
                    f"fxtools.vmap cannot batch a write in place ({user_line_of(node) or 'an unknown line'}) to a view that the "
                    f"batched layout cannot view ({line}): computed as a copy, it would not share the write as eager's view "
                    "does. Make the write before the .view, or write to a copy (.clone()) and read that"
                )


def reshape_views_as_reshape(gm: fx.GraphModule) -> None:
    """A view computed as ``reshape`` traces as ``clone`` then ``view``: printed as the ``reshape`` it is."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if not (is_reshaped_view(node) and node.target in (aten.view.default, aten._unsafe_view.default)):
            continue
        copy = node.args[0]
        if (
            isinstance(copy, fx.Node)
            and is_reshaped_view(copy)
            and copy.target is aten.clone.default
            and len(copy.users) == 1
            and isinstance(copy.args[0], fx.Node)
        ):
            node.target = aten.reshape.default
            node.args = (copy.args[0], *node.args[1:])
            gm.graph.erase_node(copy)
    gm.recompile()


def select_cond(pred, true_fn, false_fn, operands):
    """Control flow's ``cond`` under vmap, as its batching rule computes it for a batched predicate:
    both branches, chosen by ``torch.where`` (PyTorch's rule fails when nothing it is given is
    batched, as the forward cond of a batched vjp)."""
    return tuple(torch.where(pred, a, b) for a, b in zip(true_fn(*operands), false_fn(*operands)))


def _in_dims_for(in_dims, args):
    if isinstance(in_dims, int) or in_dims is None:
        return in_dims
    in_dims = tuple(in_dims)
    if len(in_dims) != len(args):
        raise ValueError(f"in_dims has {len(in_dims)} entries for {len(args)} positional arguments")
    return in_dims


_RANDOMNESS = ("error", "different", "same")


VMAP = Transform(
    "fxtools.vmap",
    batches=True,
)


@uses_pipeline(VMAP)
def vmap(f, *args, in_dims=0, out_dims=0, randomness="error", chunk_size=None, dynamic_shapes=None) -> fx.GraphModule:
    """``f`` mapped over a batch dimension of its arguments, as one batched GraphModule.

    As ``torch.func.vmap(f, in_dims, out_dims, randomness, chunk_size)``: ``args`` are example
    arguments *with* their batch dimension (at ``in_dims``; ``None`` for an unbatched argument,
    which may be any pytree); ``gm(*args)`` returns ``f``'s outputs stacked along ``out_dims``.
    Shapes (including the batch size) are specialised to the example.

    ``randomness`` says what random ops in ``f`` (dropout) draw: ``"error"`` refuses them,
    ``"different"`` draws for each sample separately, ``"same"`` draws once for the whole batch;
    the generated code draws exactly what ``torch.func.vmap`` draws with that flag, from the
    generator's state when it runs (the same numbers after the same ``torch.manual_seed``).
    ``chunk_size``: the batch is computed ``chunk_size`` samples at a time (one block of code per
    chunk, the chunks concatenated), as torch.func does to bound memory.
    """
    if not isinstance(args, tuple):
        args = tuple(args)
    check_vmap_options(randomness, chunk_size)
    namer = NodeNamer(vmappable(f), getattr(f, "guards", None)) if isinstance(f, fx.GraphModule) else None
    views = BatchedViews(where=(lambda: user_line_of(namer.current) if namer.current is not None else None) if namer else None)
    per_sample = namer or f

    @functools.wraps(per_sample)  # its signature names the arguments (dynamic_shapes, code)
    def one_sample(*a, **kw):
        with views:
            return per_sample(*a, **kw)

    batched = torch.func.vmap(
        one_sample, in_dims=_in_dims_for(in_dims, args), out_dims=out_dims, randomness=randomness, chunk_size=chunk_size
    )
    chunks = n_chunks(f, in_dims, args, chunk_size) if randomness == "same" and chunk_size is not None else None

    def check_views() -> None:
        if views.seen:
            check_one_sample(f, args, _in_dims_for(in_dims, args), views.seen, VMAP)

    return trace_batched(
        batched,
        args,
        names_of=f,
        namer=namer,
        made_by=VMAP,
        dynamic_shapes=dynamic_shapes,
        same_draws=chunks,
        check_views=check_views,
    )


def n_chunks(f, in_dims, args, chunk_size) -> int:
    """How many chunks of ``chunk_size`` samples torch.func.vmap runs for these arguments."""
    from torch._functorch.vmap import _process_batched_inputs

    batch_size = _process_batched_inputs(_in_dims_for(in_dims, args), args, f)[0]
    return -(-batch_size // chunk_size)


def _is_random(node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def share_draws(gm: fx.GraphModule, chunks: int) -> None:
    """``randomness="same"`` with ``chunk_size``: torch.func.vmap resets the generator before
    each chunk, so every chunk draws the numbers the first one drew. The trace has one draw per
    chunk instead: the k-th draw of every chunk becomes the first chunk's k-th draw (one draw,
    leaving the generator where torch.func leaves it)."""
    draws = [n for n in gm.graph.nodes if n.op == "call_function" and _is_random(n)]
    if chunks <= 1 or not draws:
        return
    per_chunk = len(draws) // chunks
    same = len(draws) % chunks == 0 and all(
        d.target is draws[i % per_chunk].target
        and getattr(d.meta.get("val"), "shape", None) == getattr(draws[i % per_chunk].meta.get("val"), "shape", None)
        for i, d in enumerate(draws)
    )
    if not same:
        raise FxtoolsError(
            "fxtools.vmap cannot reproduce randomness='same' with chunk_size here: the chunks do not draw "
            "the same random numbers in the same order. Use chunk_size=None (one chunk), or randomness='different'"
        )
    for i, d in enumerate(draws[per_chunk:], start=per_chunk):
        d.replace_all_uses_with(draws[i % per_chunk])
        gm.graph.erase_node(d)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def check_vmap_options(randomness, chunk_size) -> None:
    if randomness not in _RANDOMNESS:
        raise ValueError(f"randomness must be one of {', '.join(map(repr, _RANDOMNESS))}, got {randomness!r}")
    if chunk_size is not None and not (isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size > 0):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")


def describe(f) -> str:
    """How messages name the function being transformed: its name, or what made a generated module
    (never its code, which ``str`` of a GraphModule would give)."""
    guards = getattr(f, "guards", None)
    if isinstance(f, fx.GraphModule):
        return f"the {guards.made_by} module" if guards is not None else f"the GraphModule {type(f).__name__}"
    if isinstance(f, torch.nn.Module):
        return type(f).__name__
    return getattr(f, "__name__", None) or type(f).__name__


def refuse_data_dependent_batch(made_by: Transform, build, what: str, works: str):
    """Refuse batching the module ``build()`` makes when a size in it depends on tensor data
    (``x[mask]``, ``repeat_interleave`` by a tensor): name the op that makes that size and the
    user's line (``build`` runs again keeping the nodes' stack traces), or, inside a generated
    module, its line of code. ``what``: what is batched, up to its data-dependent size; ``works``: which transforms of the same function do run."""
    with fx_traceback.preserve_node_meta():
        gm = build()
    node = next((n for n in dynamic_nodes(gm) if n.op == "call_function"), None)
    op = getattr(getattr(node, "target", None), "__name__", "an op")
    where = (user_line_of(node) or _generated_line_of(node)) if node is not None else None
    raise DataDependentError(
        f"{made_by} cannot batch {what} depends on tensor data: {op} at {where or 'an unknown line'} makes it ({works})"
    )


def refuse_unbatchable_loop(made_by: Transform, build, exc: Exception, works: str) -> None:
    """Refuse batching the module ``build()`` makes if it holds a ``scan`` or ``while_loop``
    (PyTorch cannot batch them, a known gap) whose batching raised ``exc``: name the loop's user
    line (``build`` runs again keeping the nodes' stack traces). Returns if there is none."""
    loops = (torch.ops.higher_order.scan, torch.ops.higher_order.while_loop)
    with fx_traceback.preserve_node_meta():
        gm = build()
    node = next((n for n in gm.graph.nodes if n.target in loops), None)
    if node is None:
        return
    where = user_line_of(node) or _generated_line_of(node) or "an unknown line"
    raise FxtoolsError(
        f"{made_by} cannot batch the {node.target.__name__} at {where}: PyTorch's {node.target.__name__} cannot "
        f"be batched ({works})"
    ) from exc


def _generated_line_of(node) -> str | None:
    """'line N of generated code: code' of the innermost generated module's frame (an fxtools
    module called by the program) in ``node``'s stack trace."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    found = None
    for i, line in enumerate(lines):
        if line.strip().startswith('File "<eval_with_key'):
            lineno = line.split("line ")[1].split(",")[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File") else ""
            found = f"line {lineno} of a generated module's code: {code}"
    return found


def trace_batched(
    fn,
    args,
    names_of=None,
    namer=None,
    made_by: Transform | None = None,
    dynamic_shapes=None,
    same_draws=None,
    check_views: Callable[[], None] | None = None,
) -> fx.GraphModule:
    """Trace ``fn`` (which may call torch.func transforms) into a readable GraphModule.

    ``same_draws``: the number of chunks of a ``randomness="same"`` vmap (see ``share_draws``).
    ``check_views``: called once traced, before the graph is prepared (``vmap``: the views
    ``BatchedViews`` computed as ``reshape`` must be views eager allows one sample)."""
    f = fn if names_of is None else names_of
    made_by = VMAP if made_by is None else made_by

    def after_capture(gm: fx.GraphModule) -> None:
        if namer is not None:
            namer.apply(gm)
        if check_views is not None:
            check_views()
        refuse_writes_through_reshaped_views(gm)

    try:
        # requires_grad_ allowed, as eager vmap allows it on unbatched tensors (copy.deepcopy(module))
        with custom.transform(VMAP), enable_inplace_requires_grad(True):
            cap = front(
                fn,
                args,
                made_by=made_by,
                dynamic_shapes=dynamic_shapes,
                batched=True,
                after_capture=after_capture,
            )
    except FxtoolsError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised naming the user's line
        if is_data_dependent(exc):
            raise
        where = user_frame(exc.__traceback__) or generated_frame(exc.__traceback__)
        if where is None and namer is not None and namer.current is not None:
            where = user_line_of(namer.current) or f"where it computes {namer.current.name}"
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = ""
        if "expected to contain only concrete" in message and dynamic_shapes is not None:
            hint = (
                " PyTorch's batching rule of this op needs concrete sizes, and a size marked dynamic is "
                "symbolic here: leave that size static (no dynamic_shapes entry; a module per size), "
                "or compute the shape from the input (x.reshape(x.shape[0] * 2, -1) rather than a number)."
            )
        elif "randomness" in message:
            hint = (
                " Random ops (dropout) need randomness='different' (each sample draws its own numbers) "
                "or randomness='same' (one draw for the whole batch), as in torch.func.vmap."
                if made_by.batches
                else f" {made_by} batches over its basis vectors, which must all see the same random numbers: "
                "differentiate a function without random ops (a model in eval mode), or use fxtools.vjp / fxtools.jvp."
            )
        raise FxtoolsError(
            f"{made_by} cannot batch {describe(f)} ({'at ' if where and ':' in where else ''}{where or 'at an unknown line of user code'}): "
            f"{type(exc).__name__}: {message}.{hint}"
        ) from exc
    if same_draws is not None:
        share_draws(cap.gm, same_draws)
    reshape_views_as_reshape(cap.gm)

    def build(flat):
        return pytree.tree_unflatten(flat, cap.out_spec)

    return back(cap.gm, cap, build, made_by, Inputs(args, names=argument_names(f, args)), collapse_views=True)
