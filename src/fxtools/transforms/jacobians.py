"""``jacrev``, ``jacfwd`` and ``linearize``: torch.func's Jacobian transforms as generated code.

Jacobians, batched
------------------
``jacrev(f, *args)`` is the ``vjp`` module of ``f`` mapped (``fxtools.vmap``'s tracing below
torch.func.vmap) over the rows of an identity matrix: one cotangent per output element, all in
one batch, so the generated code is the VJP code with a leading batch dimension (a ``mm`` where
the VJP has a ``mv``), not a Python loop over basis vectors. ``jacfwd`` maps the ``jvp`` module
over the identity's rows as tangents (one per input element) the same way. The basis is
built in the code itself (``torch.eye`` on the inputs' device), cut into one block per output
(jacrev) or input (jacfwd) leaf, and the results are cut and reshaped into torch.func's
structure: for every output leaf, the argument's pytree (int ``argnums``) or a tuple of them
(tuple ``argnums``), with leaves of shape ``out.shape + in.shape``.

``chunk_size`` bounds memory as in torch.func: the batch is processed that many basis vectors
at a time (one block of code per chunk).

Linearize
---------
``linearize(f, *args)`` computes ``f(*args)`` once and returns ``(out, jvp_gm)``, as
``torch.func.linearize``: ``jvp_gm(*tangents)`` is the ``jvp`` code with everything that does not
depend on the tangents already computed. Those values (the residuals: ``cos(x)`` for ``sin``)
are attributes of ``jvp_gm``, read as ``self.cos``; its code is only the linear map.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.utils import _pytree as pytree

from ..codegen.show import remember_inputs
from ..errors import DataDependentError
from ..graph import meta
from ..graph.data_dependent import dynamic_nodes, is_dynamic
from ..graph.nodes import is_float
from ..passes.simplify import simplify
from ..signature.guards import install, tangent_role
from .batching import check_vmap_options, refuse_data_dependent_batch, trace_batched, vmappable
from .forward import jvp
from .pipeline import Transform, built_by, emit, uses_pipeline
from .retrace import NodeNamer
from .vjp import argnums_tuple, argument_names, vjp

__all__ = ["jacrev", "jacfwd", "linearize"]


def _describe(path, v) -> str:
    what = f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
    return f"{path} ({what})"


def _float_leaves(tree, what, name):
    """The leaves of ``tree``; every tensor leaf must be floating point (complex: torch.func's
    Jacobians are of real functions)."""
    paths_leaves, spec = pytree.tree_flatten_with_path(tree)
    for path, v in paths_leaves:
        if what == "output" and not isinstance(v, torch.Tensor):
            raise ValueError(
                f"{name} needs f to return tensors only (as torch.func.{name.split('.')[-1]}), but "
                f"{_describe(what + pytree.keystr(path), v)} is not a tensor; return other values "
                f"as auxiliary data: f returns (out, aux) and {name}(f, *args, has_aux=True)"
            )
        if isinstance(v, torch.Tensor) and not (v.is_floating_point() and not v.is_complex()):
            raise ValueError(
                f"{name} needs real floating-point {what}, but {_describe(what + pytree.keystr(path), v)} is not; "
                f"return (or differentiate) only floating-point tensors, as for torch.func.{name.split('.')[-1]}"
            )
    return [v for _, v in paths_leaves], spec


def _basis(total: int, blocks, like: torch.Tensor):
    """The rows of ``eye(total)`` cut into one block per example tensor in ``blocks`` (None for
    non-tensors), each shaped ``[total, *shape]``: basis vectors of those tensors, batched."""
    eye = torch.eye(total, dtype=like.dtype, device=like.device)
    out: list[torch.Tensor | None] = []
    offset = 0
    for b in blocks:
        if not isinstance(b, torch.Tensor):
            out.append(None)
            continue
        n = b.numel()
        piece = eye[:, offset : offset + n] if (offset, n) != (0, total) else eye
        piece = piece if piece.dtype == b.dtype else piece.to(b.dtype)
        out.append(piece.reshape(total, *b.shape))
        offset += n
    return out


def _cut(batched: torch.Tensor, offset: int, n: int, total: int, shape, to: int = 0):
    """The block ``offset:offset+n`` of ``batched`` along its first (batch) dimension, moved to
    dimension ``to`` and shaped ``shape``."""
    if (offset, n) != (0, total):
        batched = batched.narrow(0, offset, n)
    if to:
        batched = batched.movedim(0, to)
    return batched.reshape(shape)


def _sign(fn, namer, n_args: int) -> None:
    """Give ``fn`` the first ``n_args`` parameters of the module ``namer`` runs (the argument names
    of the generated code)."""
    signature = namer.__signature__
    fn.__signature__ = signature.replace(parameters=list(signature.parameters.values())[:n_args])


def _first_tensor(leaves, name, what):
    """The tensor whose dtype and device the basis takes (blocks of other dtypes are cast)."""
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    if not tensors:
        raise ValueError(f"{name} needs at least one floating-point tensor among the {what}")
    return tensors[0]


JACREV = Transform("fxtools.jacrev")


@uses_pipeline(JACREV)
def jacrev(f, *args, argnums=0, has_aux=False, chunk_size=None) -> fx.GraphModule:
    """The Jacobian of ``f`` at example ``args`` by reverse mode: ``gm(*args) -> jacobian``.

    As ``torch.func.jacrev(f, argnums, chunk_size=...)(*args)``: for each output leaf (of shape
    ``O``), the differentiated argument's structure (int ``argnums``) or a tuple of them (tuple
    ``argnums``), with ``O + I``-shaped leaves for each input leaf of shape ``I``. Generated as
    the ``vjp`` code batched over all output elements at once (no loop over basis vectors).
    Random ops (dropout) draw once, for every basis vector, as torch.func.jacrev's forward does.
    ``has_aux=True``: ``f`` returns ``(out, aux)`` and ``gm(*args) -> (jacobian, aux)``, as torch.func's.
    """
    check_vmap_options("error", chunk_size)
    args = tuple(args)
    nums = argnums_tuple(argnums, len(args))
    with fx_traceback.preserve_node_meta():  # its nodes keep the user's lines, for batching errors to name
        vjp_gm = vjp(f, *args, argnums=argnums, has_aux=has_aux)
    out_leaves, out_spec = _float_leaves(meta.OUT_EXAMPLE.get(vjp_gm), "output", JACREV.name)
    like = _first_tensor(out_leaves, JACREV.name, "outputs")
    total = sum(v.numel() for v in out_leaves if isinstance(v, torch.Tensor))

    def again():
        return vjp(f, *args, argnums=argnums, has_aux=has_aux)

    works = "fxtools.jacfwd, fxtools.vjp and fxtools.jvp of the same function work"
    if is_dynamic(total):  # the Jacobian's rows would be a data-dependent batch size
        refuse_data_dependent_batch(JACREV, again, "over an output whose size", works)
    namer = NodeNamer(vmappable(vjp_gm), vjp_gm.guards)
    ct_dims = pytree.tree_unflatten([0 if isinstance(v, torch.Tensor) else None for v in out_leaves], out_spec)
    in_dims = (*(None,) * len(args), ct_dims)
    # randomness="same": one draw shared by every basis vector, as torch.func.jacrev's forward,
    # which runs once before its vjp is batched (the same numbers after the same seed)
    out_dims: Any = (0, 0, None) if has_aux else (0, 0)  # aux does not depend on the cotangent
    mapped = torch.func.vmap(namer, in_dims=in_dims, out_dims=out_dims, chunk_size=chunk_size, randomness="same")
    n_args = len(args)

    def jacobian(*a):
        basis = _basis(total, out_leaves, like)
        ct = pytree.tree_unflatten(basis, out_spec)
        _, grads, *aux = mapped(*a[:n_args], ct)
        grad_leaves = pytree.tree_leaves(grads, is_leaf=lambda x: x is None)
        # torch.func's structure: the arguments' own containers (the VJP's are fx's immutable ones)
        differentiated = a[nums[0]] if isinstance(argnums, int) else tuple(a[i] for i in nums)
        in_leaves, grad_spec = pytree.tree_flatten(differentiated, is_leaf=lambda x: x is None)
        per_out = []
        offset = 0
        for o in out_leaves:
            if not isinstance(o, torch.Tensor):
                per_out.append(None)
                continue
            n = o.numel()
            blocks = [
                _cut(g, offset, n, total, (*o.shape, *x.shape)) if isinstance(g, torch.Tensor) else None
                for g, x in zip(grad_leaves, in_leaves)
            ]
            per_out.append(pytree.tree_unflatten(blocks, grad_spec))
            offset += n
        return (
            (pytree.tree_unflatten(per_out, out_spec), *_own(aux, vjp_gm))
            if has_aux
            else pytree.tree_unflatten(per_out, out_spec)
        )

    _sign(jacobian, namer, n_args)
    chunks = -(-total // chunk_size) if chunk_size is not None else None
    try:
        return trace_batched(jacobian, args, names_of=f, namer=namer, made_by=JACREV, same_draws=chunks)
    except DataDependentError:
        if not dynamic_nodes(vjp_gm):
            raise
        refuse_data_dependent_batch(JACREV, again, "its VJP, in which a size", works)
        raise


JACFWD = Transform("fxtools.jacfwd")


@uses_pipeline(JACFWD)
def jacfwd(f, *args, argnums=0, has_aux=False, randomness="error", chunk_size=None) -> fx.GraphModule:
    """The Jacobian of ``f`` at example ``args`` by forward mode: ``gm(*args) -> jacobian``.

    As ``torch.func.jacfwd(f, argnums, randomness=...)(*args)`` (the structure is ``jacrev``'s).
    Generated as the ``jvp`` code batched over all input elements at once (no loop over basis
    vectors); ``randomness`` as for ``vmap`` (``"same"``: one draw for every basis vector).
    ``has_aux=True``: ``f`` returns ``(out, aux)`` and ``gm(*args) -> (jacobian, aux)``, as torch.func's.
    """
    check_vmap_options(randomness, chunk_size)
    args = tuple(args)
    nums = argnums_tuple(argnums, len(args))
    differentiated = tuple(args[i] for i in nums)
    in_leaves, in_spec = _float_leaves(differentiated, "input", JACFWD.name)
    in_leaves = [v if isinstance(v, torch.Tensor) else None for v in in_leaves]
    like = _first_tensor(in_leaves, JACFWD.name, "differentiated arguments")
    total = sum(v.numel() for v in in_leaves if isinstance(v, torch.Tensor))
    with fx_traceback.preserve_node_meta():  # its nodes keep the user's lines, for batching errors to name
        jvp_gm = jvp(f, *args, argnums=nums, has_aux=has_aux)
    namer = NodeNamer(vmappable(jvp_gm), jvp_gm.guards)
    tangent_dims = pytree.tree_unflatten([0 if isinstance(v, torch.Tensor) else None for v in in_leaves], in_spec)
    n_args = len(args)
    out_dims: Any = (0, 0, None) if has_aux else (0, 0)  # aux does not depend on the tangents
    mapped = torch.func.vmap(
        namer, in_dims=(*(None,) * n_args, *tangent_dims), out_dims=out_dims, chunk_size=chunk_size, randomness=randomness
    )
    out_leaves, out_spec = _float_leaves(meta.OUT_EXAMPLE.get(jvp_gm), "output", JACFWD.name)

    def jacobian(*a):
        basis = _basis(total, in_leaves, like)
        tangents = pytree.tree_unflatten(basis, in_spec)
        _, out_tangent, *aux = mapped(*a[:n_args], *tangents)
        tangent_leaves = pytree.tree_leaves(out_tangent, is_leaf=lambda x: x is None)
        per_out = []
        for o, t in zip(out_leaves, tangent_leaves):
            if not isinstance(o, torch.Tensor):
                per_out.append(None)
                continue
            blocks, offset = [], 0
            for x in in_leaves:
                if not isinstance(x, torch.Tensor):
                    blocks.append(None)
                    continue
                blocks.append(_cut(t, offset, x.numel(), total, (*o.shape, *x.shape), o.dim()))
                offset += x.numel()
            per_arg = pytree.tree_unflatten(blocks, in_spec)
            per_out.append(per_arg[0] if isinstance(argnums, int) else per_arg)
        return (
            (pytree.tree_unflatten(per_out, out_spec), *_own(aux, jvp_gm))
            if has_aux
            else pytree.tree_unflatten(per_out, out_spec)
        )

    _sign(jacobian, namer, n_args)
    chunks = -(-total // chunk_size) if chunk_size is not None and randomness == "same" else None
    return trace_batched(jacobian, args, names_of=f, namer=namer, made_by=JACFWD, same_draws=chunks)


def _own(aux: list, gm: fx.GraphModule) -> list:
    """``[aux]`` as an Interpreter over ``gm`` returned it, in the function's own containers
    (``OrderedDict``, a dict inside a namedtuple), as torch.func returns aux."""
    return [pytree.tree_unflatten(pytree.tree_leaves(a), meta.AUX_SPEC.get(gm)) for a in aux]


LINEARIZE = Transform(
    "fxtools.linearize",
    returns="tangent_out",
    keywords=False,
)


@uses_pipeline(LINEARIZE)
def linearize(f, *args) -> tuple[object, fx.GraphModule]:
    """``f(*args)`` and its linear map at ``args``: ``out, jvp_gm = linearize(f, *args)``.

    As ``torch.func.linearize``: ``jvp_gm(*tangents)`` (one tangent per positional argument, with
    its structure; ``None`` at non-float leaves) returns ``J @ tangents`` with ``out``'s
    structure. ``f`` runs once, here; ``jvp_gm``'s code is the tangent part of ``fxtools.jvp``'s,
    reading what it needs of the point (the residuals) from attributes set now.
    """
    args = tuple(args)
    full = jvp(f, *args)
    tangent_examples = [pytree.tree_map(lambda v: v if is_float(v) else None, a) for a in args]
    placeholders = [n for n in full.graph.nodes if n.op == "placeholder"]
    tangent_ph = placeholders[len(args) :]
    dependent = _tangent_dependent(full.graph, tangent_ph)
    out, values = _run_point(full, dependent, (*args, *_zeros_like(tangent_examples)))
    gm = _linear_part(full.graph, tangent_ph, dependent, values)
    simplify(gm)
    built = built_by(full)
    gm = emit(gm, None, LINEARIZE, front=built.front if built is not None else None, remember=False)
    gm = install(
        gm,
        LINEARIZE.name,
        [p.name for p in tangent_ph],
        tangent_examples,
        roles={i: tangent_role(n) for i, n in enumerate(argument_names(f, args))},
    )
    return out, remember_inputs(gm)


def _tangent_dependent(graph: fx.Graph, tangent_ph: list[fx.Node]) -> set[fx.Node]:
    """The tangent placeholders and every op that reads one of them, directly or not."""
    dependent = set(tangent_ph)
    for node in graph.nodes:
        if node.op in ("call_function", "call_method") and any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _zeros_like(trees: list) -> list:
    return [pytree.tree_map(lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v, t) for t in trees]


def _run_point(full: fx.GraphModule, dependent: set[fx.Node], inputs: tuple):
    """Run the jvp module once at the point (zero tangents): its output, and the value of every
    node that does not depend on the tangents (the residuals the linear map reads)."""
    values: dict[fx.Node, object] = {}

    class _Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n not in dependent:
                values[n] = out
            return out

    cast(Any, full).guards.check(inputs)
    with torch.no_grad():  # the generated code runs without autograd, as every fxtools module
        out, _ = _Record(full).run(*inputs)
    return pytree.tree_unflatten(pytree.tree_leaves(out), pytree.tree_structure(meta.OUT_EXAMPLE.get(full))), values


def _linear_part(graph: fx.Graph, tangent_ph: list[fx.Node], dependent: set[fx.Node], values: dict) -> fx.GraphModule:
    """The ops of ``graph`` that depend on the tangents, reading every other value as an
    attribute holding its value at the point (``self.cos``)."""
    new = fx.Graph()
    env: dict[fx.Node, object] = {}
    lin = torch.nn.Module()
    for p in tangent_ph:
        q = new.placeholder(p.name)
        q.meta.update(p.meta)
        env[p] = q

    def residual(n: fx.Node) -> Any:
        if n not in env:
            value = values[n]
            if isinstance(value, (torch.Tensor, torch.nn.Module)):
                if isinstance(value, torch.Tensor):
                    lin.register_buffer(n.name, value)
                else:  # a branch or step function of cond / scan / while_loop
                    lin.add_module(n.name, value)
                node = new.get_attr(n.name)
                node.meta.update(n.meta)
                value = node
            env[n] = value
        return env[n]

    def read(a: fx.Node) -> fx.Node:
        return cast(fx.Node, env[a] if a in dependent else residual(a))

    for node in graph.nodes:
        if node in dependent and node.op != "placeholder":
            env[node] = new.node_copy(node, read)
    output = next(n for n in graph.nodes if n.op == "output")
    _, tangent_out = output.args[0]
    new.output(fx.node.map_arg(tangent_out, read))
    return fx.GraphModule(lin, new, class_name="Linearized")
