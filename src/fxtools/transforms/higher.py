"""Second derivatives: ``hvp`` (Hessian-vector product) and ``hessian``.

Both are compositions of the first-order transforms, which is possible because every fxtools
transform returns an ordinary GraphModule of public PyTorch calls that fxtools can trace again:

- ``hvp(f, *args)`` is reverse over reverse: the VJP of ``fxtools.grad(f)`` with cotangent
  ``v``. Since the Hessian is symmetric, ``(∇f)ᵀ``'s VJP ``Hᵀ v`` is ``H v``. Reverse over
  reverse needs only the VJP rules (the backward ops of the first pass are ordinary ops with
  rules), and after simplification it reads like a hand-written double backward. It uses the
  readable rules whatever ``fxtools.rule_set`` is in effect.
- ``hessian(f, *args)`` is ``hvp`` batched over the standard basis with ``fxtools``' vmap (the
  batched graph of ``torch.func.vmap(hvp)``): one batched evaluation, not a loop over columns.
  The result is nested as ``torch.func.hessian``'s: for a differentiated argument with pytree
  structure ``S``, ``H`` has structure ``S`` of ``S``, ``H[i][j]`` of shape
  ``shape_i + shape_j``.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.utils import _pytree as pytree

from ..capture.trace import capture
from ..errors import DataDependentError, FxtoolsError
from ..graph.data_dependent import dynamic_nodes
from ..graph.nodes import is_float
from ..registry import rule_set
from .batching import refuse_data_dependent_batch, refuse_unbatchable_loop, trace_batched, vmappable
from .pipeline import Inputs, Transform, back, uses_pipeline
from .retrace import NodeNamer
from .reverse import ReverseSpec, reverse
from .vjp import argnums_tuple, argument_names, grads_structure, prepare

__all__ = ["hvp", "hessian"]


def _differentiated(args, argnums):
    return args[argnums] if isinstance(argnums, int) else tuple(args[i] for i in argnums)


HVP = Transform(
    "fxtools.hvp",
    loss=True,
    returns="hvp",
    extra=("v",),
)


@uses_pipeline(HVP)
def hvp(f, *args, argnums=0, dynamic_shapes=None) -> fx.GraphModule:
    """The Hessian-vector product of scalar ``f``: ``gm(*args, v) -> H @ v``.

    ``v`` has the structure of the differentiated argument (``args[argnums]``, or a tuple of
    them for a tuple ``argnums``), and so has the result. As
    ``torch.func.jvp(torch.func.grad(f, argnums), args, tangents)[1]`` with ``v`` as the tangent
    of the differentiated arguments, wherever PyTorch's gradient is the derivative of ``f``.
    Where it deliberately is not (``embedding`` skips its padding row, a value computed inside
    ``torch.no_grad()`` is a constant, which forward AD ignores), the two orders of
    differentiation differ, and this equals torch.func's reverse over reverse. The second pass
    differentiates the gradient's code with the "adjoint" rule set (docs/rules.md): ``index_put``
    with repeated indices is differentiated as the forward computes it, as torch.func.jvp does.
    """
    from .vjp import grad

    if not isinstance(args, tuple):
        args = tuple(args)
    nums = argnums_tuple(argnums, len(args))
    # Always the readable rules: fused backward kernels are first-order only (CPU flash
    # attention's backward has no derivative) and the second derivative should read as math.
    with rule_set("readable"):
        with fx_traceback.preserve_node_meta():  # g's nodes keep the user's lines, for the second pass's errors
            g = grad(f, *args, argnums=argnums, dynamic_shapes=dynamic_shapes)
        namer = NodeNamer(g, getattr(g, "guards", None))  # the second pass keeps the first's names
        cap, wrt = prepare(namer, args, nums, dynamic_shapes, made_by=HVP)
        namer.apply(cap.gm)
    # the second pass differentiates the gradient's code: with each op's adjoint where PyTorch's
    # gradient is not one (the "adjoint" set: index_put's repeated indices), as forward mode does
    with rule_set("adjoint"):
        rev = reverse(cap.gm, ReverseSpec(wrt, "cotangent"))
        flat, ct_index = rev.gm, rev.ct_index
    n_out = len(cap.out_leaves)
    # keep only H v: drop the gradient itself from the outputs
    out_node = next(n for n in flat.graph.nodes if n.op == "output")
    results = list(out_node.args[0])
    out_node.args = (tuple(results[n_out:]),)
    v_example = pytree.tree_unflatten([cap.out_leaves[i] if i in ct_index else None for i in range(n_out)], cap.out_spec)

    def build(flat_results):
        hv = grads_structure(cap, args, flat_results, nums)
        return hv[0] if isinstance(argnums, int) else hv

    role = {len(args): lambda path: "the vector v of the Hessian-vector product"}
    inputs = Inputs(args, extra=[("v", v_example)], roles=role, names=argument_names(f, args))
    gm = back(flat, cap, build, HVP, inputs, collapse_views=True)
    _name_results(gm)
    return gm


def _name_results(gm: fx.GraphModule) -> None:
    """The returned ``grad_<x>`` of a Hessian-vector product is ``hvp_<x>``."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for node in pytree.tree_leaves(out.args[0]):
        if isinstance(node, fx.Node) and node.op != "placeholder" and node.name.startswith("grad_"):
            node._rename("hvp_" + node.name[len("grad_") :])
    gm.recompile()


def _scalar_output(f, args) -> bool:
    """Whether ``f`` returns one 0-dimensional floating-point tensor (a capture on FakeTensors)."""
    out = capture(f, args).out_leaves
    return len(out) == 1 and is_float(out[0]) and out[0].dim() == 0


def _jacfwd_of_jacrev(f, args, argnums) -> fx.GraphModule:
    """The Hessian of any ``f`` as ``torch.func.hessian`` defines it: ``jacfwd(jacrev(f))``, for each
    output leaf of shape ``O`` and input leaves of shapes ``I``, ``J``: ``O + I + J``."""
    from .jacobians import jacfwd, jacrev

    return jacfwd(jacrev(f, *args, argnums=argnums), *args, argnums=argnums)


HESSIAN = Transform(
    "fxtools.hessian",
    loss=True,
)


@uses_pipeline(HESSIAN)
def hessian(f, *args, argnums=0) -> fx.GraphModule:
    """The Hessian of ``f`` with respect to ``args[argnums]``: ``gm(*args) -> H``.

    A function returning anything but one 0-dimensional tensor gets ``jacfwd(jacrev(f))``'s
    structure, as torch.func.hessian: ``out.shape + shape + shape`` per output leaf.

    As ``torch.func.hessian(f, argnums)``: for a tensor argument of shape ``S``, ``H`` has shape
    ``S + S``; for a pytree argument, ``H[i][j]`` (nested as the argument) has shape
    ``shape_i + shape_j``. Computed as ``hvp`` batched over the standard basis.
    """
    if not isinstance(args, tuple):
        args = tuple(args)
    if not _scalar_output(f, args):
        return _jacfwd_of_jacrev(f, args, argnums)
    hv_gm = hvp(f, *args, argnums=argnums)
    hv = vmappable(hv_gm)
    diff = _differentiated(args, argnums)
    leaves, spec = pytree.tree_flatten(diff)
    floats = [x for x in leaves if is_float(x)]
    if not floats:
        raise ValueError("hessian needs floating-point tensors in the differentiated arguments")
    dtype = floats[0].dtype
    sizes = [x.numel() if is_float(x) else 0 for x in leaves]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    total = sum(sizes)

    def hessian_of(*a):
        eye = torch.eye(total, dtype=dtype)
        basis = [eye[:, o : o + n].reshape(total, *x.shape) if is_float(x) else None for x, o, n in zip(leaves, offsets, sizes)]
        v = pytree.tree_unflatten(basis, spec)
        columns = torch.func.vmap(hv, in_dims=(None,) * len(a) + (0,))(*a, v)
        cols = pytree.tree_leaves(columns) if not isinstance(columns, torch.Tensor) else [columns]
        it = iter(cols)
        cols = [next(it) if is_float(x) else None for x in leaves]
        rows = []
        for xi, ci, ni in zip(leaves, cols, sizes):
            if ci is None:
                rows.append(None)
                continue
            row = []
            for xj, oj, nj in zip(leaves, offsets, sizes):
                if not is_float(xj):
                    row.append(None)
                    continue
                block = ci[oj : oj + nj].reshape(nj, ni).transpose(0, 1)
                row.append(block.reshape(*xi.shape, *xj.shape))
            rows.append(pytree.tree_unflatten(row, spec))
        return pytree.tree_unflatten(rows, spec)

    import inspect

    try:
        hessian_of.__signature__ = inspect.signature(f.forward if isinstance(f, torch.nn.Module) else f)
    except (TypeError, ValueError):
        pass
    hessian_of.__name__ = getattr(f, "__name__", "hessian")
    again = functools.partial(hvp, f, *args, argnums=argnums)
    try:
        return trace_batched(hessian_of, args, names_of=f, made_by=HESSIAN)
    except FxtoolsError as exc:
        if isinstance(exc, DataDependentError) and dynamic_nodes(hv_gm):
            refuse_data_dependent_batch(
                HESSIAN, again, "its Hessian-vector product, in which a size", "fxtools.hvp of the same function works"
            )
        refuse_unbatchable_loop(HESSIAN, again, exc, "fxtools.hvp, fxtools.grad and fxtools.jvp of the same function work")
        raise
