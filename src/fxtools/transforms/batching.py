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

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._functorch.eager_transforms import enable_inplace_requires_grad
from torch.utils import _pytree as pytree

from ..capture import custom
from ..capture.trace import is_data_dependent
from ..codegen.inplace import printed_in_place
from ..errors import DataDependentError, FxtoolsError, user_frame, user_line_of
from ..graph.data_dependent import dynamic_nodes
from .pipeline import Inputs, Transform, back, front, uses_pipeline
from .retrace import NodeNamer
from .vjp import argument_names

__all__ = ["vmap", "trace_batched", "check_vmap_options", "describe", "n_chunks", "share_draws"]


def vmappable(f):
    """``f``, with ``.view`` calls of a generated GraphModule turned into ``.reshape`` (and its
    ``cond`` calls into ``select_cond``), and its scatters into fresh tensors printed out of place
    (vmap refuses ``zeros.index_add_(..., batched)``, an unbatched tensor written with batched rows).

    fxtools drops ``.contiguous()`` before a ``.view`` when the example value is contiguous; under
    vmap the same value may be a non-contiguous slice of a batched tensor, where only
    ``reshape`` (a view when possible, a copy otherwise) is valid. Attributes stay shared.
    """
    if not isinstance(f, fx.GraphModule):
        return f
    if not any(_view(n) or n.target is torch.ops.higher_order.cond or printed_in_place(n) for n in f.graph.nodes):
        return f
    graph = fx.Graph()
    out = graph.graph_copy(f.graph, {})
    graph.output(out)
    for n in graph.nodes:
        if _view(n):
            n.target = "reshape"
        elif n.target is torch.ops.higher_order.cond:
            n.target = select_cond
    gm = fx.GraphModule(f, graph, class_name=f.__class__.__name__)
    gm.meta.update(getattr(f, "meta", {}))
    return gm


def _view(node) -> bool:
    return node.op == "call_method" and node.target == "view"


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
    batched = torch.func.vmap(
        namer or f, in_dims=_in_dims_for(in_dims, args), out_dims=out_dims, randomness=randomness, chunk_size=chunk_size
    )
    chunks = n_chunks(f, in_dims, args, chunk_size) if randomness == "same" and chunk_size is not None else None
    return trace_batched(batched, args, names_of=f, namer=namer, made_by=VMAP, dynamic_shapes=dynamic_shapes, same_draws=chunks)


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
    fn, args, names_of=None, namer=None, made_by: Transform | None = None, dynamic_shapes=None, same_draws=None
) -> fx.GraphModule:
    """Trace ``fn`` (which may call torch.func transforms) into a readable GraphModule.

    ``same_draws``: the number of chunks of a ``randomness="same"`` vmap (see ``share_draws``)."""
    f = fn if names_of is None else names_of
    made_by = VMAP if made_by is None else made_by
    try:
        # requires_grad_ allowed, as eager vmap allows it on unbatched tensors (copy.deepcopy(module))
        with custom.transform(VMAP), enable_inplace_requires_grad(True):
            cap = front(
                fn,
                args,
                made_by=made_by,
                dynamic_shapes=dynamic_shapes,
                batched=True,
                after_capture=namer.apply if namer is not None else None,
            )
    except FxtoolsError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised naming the user's line
        if is_data_dependent(exc):
            raise
        where = user_frame(exc.__traceback__)
        if where is None and namer is not None and namer.current is not None:
            where = f"where it computes {namer.current.name}"
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

    def build(flat):
        return pytree.tree_unflatten(flat, cap.out_spec)

    return back(cap.gm, cap, build, made_by, Inputs(args, names=argument_names(f, args)), collapse_views=True)
