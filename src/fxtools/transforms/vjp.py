"""The public transforms: ``vjp``, ``grad`` and ``value_and_grad``.

Each traces the user's function once on its example arguments (shapes and Python values are
specialised to them), differentiates the trace source-to-source, simplifies the result and
renders it with public PyTorch names. What comes back is an ordinary ``torch.fx.GraphModule``
whose calls first check that the arguments are what it was made for (``fxtools.signature.guards``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import rules  # noqa: F401  (registers fxtools' own rules)
from ..capture.trace import Captured
from ..graph import meta
from ..graph.nodes import ancestors, is_float
from ..signature.guards import OptionalTensor, cotangent_role
from ..signature.naming import arg_names
from .pipeline import Inputs, Transform, back, describe_leaf, differentiated, front, uses_pipeline
from .reverse import ReverseSpec, reverse, single_cotangent_name


def argnums_tuple(argnums, nargs):
    """``argnums`` (an int or a tuple of ints, negative counting from the end) as a tuple of indices."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(a, int) for a in nums):
        raise ValueError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}")
    for a in nums:
        if not -nargs <= a < nargs:
            raise ValueError(f"argnums {a} is out of range for a function of {nargs} positional arguments")
    return tuple(a % nargs for a in nums)


def prepare(f, args, argnums, dynamic_shapes=None, has_aux=False, *, made_by: Transform):
    """The shared front (``pipeline.front``) and which tensor leaves ``argnums`` differentiates."""
    cap = front(f, args, made_by=made_by, argnums=argnums, dynamic_shapes=dynamic_shapes, has_aux=has_aux)
    return cap, differentiated(cap, argnums)


class AuxSplit:
    """How a ``has_aux`` function's flat outputs divide: ``out`` leaves first, then ``aux``'s."""

    def __init__(self, out_spec, has_aux: bool):
        self.has_aux = has_aux
        self.main_spec = out_spec.child(0) if has_aux else out_spec
        self.aux_spec = out_spec.child(1) if has_aux else None
        self.n_main = self.main_spec.num_leaves

    def main(self, flat):
        return pytree.tree_unflatten(list(flat[: self.n_main]), self.main_spec)

    def aux(self, flat):
        assert self.aux_spec is not None
        return pytree.tree_unflatten(list(flat[self.n_main :]), self.aux_spec)


def grads_structure(cap: Captured, args, grads_flat, argnums):
    """Nest flat gradients (one per tensor leaf of a differentiated argument) like the
    differentiated arguments; non-float leaves get None."""
    it = iter(grads_flat)
    per_leaf = []
    for leaf, t, a in zip(cap.leaves, cap.tensor_leaf, cap.arg_of_leaf):
        g = next(it) if t and a in argnums else None
        per_leaf.append(g if is_float(leaf) else None)
    nested = pytree.tree_unflatten(per_leaf, cap.in_spec)
    return tuple(nested[a] for a in argnums)


def argument_names(f, args) -> list[str]:
    """One identifier per positional argument of ``f`` (a function or a module's ``forward``)."""
    return arg_names(f.forward if isinstance(f, torch.nn.Module) else f, len(args))


def mark_parts(flat_gm: fx.GraphModule, n_out: int) -> None:
    """Tag each op "forward" if an output value of ``f`` depends on it, else "backward" (for drawing)."""
    outs = [o for o in next(n for n in flat_gm.graph.nodes if n.op == "output").args[0][:n_out] if isinstance(o, fx.Node)]
    forward = ancestors(outs)
    for node in flat_gm.graph.nodes:
        if node.op in ("call_function", "call_method", "get_attr"):
            meta.PART.set(node, "forward" if node in forward else "backward")


def _finish(cap, flat_gm, args, build, made_by, extra_args=(), guard_extra=None):
    """The shared back, the forward and backward parts of ``flat_gm`` marked first (for ``fxtools.draw``)."""
    mark_parts(flat_gm, len(cap.out_leaves))
    roles = {len(args) + i: cotangent_role() for i, _ in enumerate(extra_args)}
    return back(flat_gm, cap, build, made_by, Inputs(args, extra=extra_args, guard_extra=guard_extra, roles=roles))


def _output_structure(cap, out_flat):
    return pytree.tree_unflatten(out_flat, cap.out_spec)


VJP = Transform(
    "fxtools.vjp",
    returns="out, grads",
    extra=("grad_out",),
)


@uses_pipeline(VJP)
def vjp(f, *args, argnums=None, has_aux=False, dynamic_shapes=None) -> fx.GraphModule:
    """The vector-Jacobian product of ``f`` at example ``args``, as readable PyTorch code.

    Returns a GraphModule ``gm`` with ``out, grads = gm(*args, grad_out)``: ``out`` is
    ``f(*args)``; ``grad_out`` has the structure of ``out`` (pass ``None`` for leaves that are
    not floating point, such as the indices of ``torch.max(x, dim)``); ``grads`` has one entry
    per positional argument, each with that argument's pytree structure, holding
    ``J^T grad_out`` for floating-point tensor leaves and ``None`` for every other leaf.

    ``argnums`` (int or tuple, as on ``grad``) differentiates only those arguments: ``grads`` is
    then that argument's gradient (int) or a tuple of them (tuple). ``has_aux=True``: ``f``
    returns ``(out, aux)``, ``aux`` any pytree that carries no gradient (torch.func's
    convention); ``out, grads, aux = gm(*args, grad_out)``, ``grad_out`` mirroring ``out`` alone.

    ``dynamic_shapes`` (here and in every transform; torch.export's format, see ``fxtools.signature.sizes``)
    keeps the marked sizes symbolic: the module then serves every size in their range.
    """
    nums = tuple(range(len(args))) if argnums is None else argnums_tuple(argnums, len(args))
    cap, wrt = prepare(f, args, nums, dynamic_shapes, has_aux=has_aux, made_by=VJP)
    rev = reverse(cap.gm, ReverseSpec(wrt, "cotangent"))
    flat_gm, ct_index = rev.gm, rev.ct_index
    n_out = len(cap.out_leaves)
    split = AuxSplit(cap.out_spec, has_aux)
    main_leaves = cap.out_leaves[: split.n_main]
    ct_example = split.main([main_leaves[i] if i in ct_index else None for i in range(split.n_main)])

    def build(flat):
        grads = grads_structure(cap, args, flat[n_out:], nums)
        if isinstance(argnums, int):
            grads = grads[0]
        if has_aux:
            return split.main(flat[:n_out]), grads, split.aux(flat[:n_out])
        return _output_structure(cap, flat[:n_out]), grads

    # what grad_out may be: the output's shape at floating-point leaves (None too where no gradient
    # flows, as the code ignores it there), None elsewhere
    accepts = split.main([o if i in ct_index else OptionalTensor(o) if is_float(o) else None for i, o in enumerate(main_leaves)])
    outs = list(cap.gm.graph.output_node().args[0])[: split.n_main]
    ct_name = single_cotangent_name(outs[0]) if len(outs) == 1 else "grad_out"
    gm = _finish(cap, flat_gm, args, build, VJP, extra_args=[(ct_name, ct_example)], guard_extra=[accepts])
    meta.OUT_EXAMPLE.set(gm, split.main(cap.out_leaves))
    meta.AUX_SPEC.set(gm, split.aux_spec)
    return gm


def _grad_gm(f, args, argnums, with_value, dynamic_shapes=None, has_aux=False):
    made_by = VALUE_AND_GRAD if with_value else GRAD
    nums = argnums_tuple(argnums, len(args))
    cap, wrt = prepare(f, args, nums, dynamic_shapes, has_aux=has_aux, made_by=made_by)
    split = AuxSplit(cap.out_spec, has_aux)
    main = cap.out_leaves[: split.n_main]
    outs = [o for o in main if isinstance(o, torch.Tensor)]
    if len(main) != 1 or not outs or outs[0].numel() != 1 or not is_float(outs[0]):
        got = split.main([describe_leaf(v) for v in main])
        raise ValueError(
            "grad needs f to return a single floating-point tensor with one element "
            + ("(and its auxiliary data: has_aux=True) " if has_aux else "")
            + f"(got {got!r}); use fxtools.vjp for other outputs"
            + ("" if has_aux else ", or has_aux=True if f returns (loss, aux)")
        )
    flat_gm = reverse(cap.gm, ReverseSpec(wrt, "ones")).gm
    n_out = len(cap.out_leaves)

    def build(flat):
        grads = grads_structure(cap, args, flat[n_out:], nums)
        grads = grads[0] if isinstance(argnums, int) else grads
        value = split.main(flat[:n_out])
        if has_aux:
            aux = split.aux(flat[:n_out])
            return ((value, aux), grads) if with_value else (grads, aux)
        return (value, grads) if with_value else grads

    return _finish(cap, flat_gm, args, build, made_by)


GRAD = Transform(
    "fxtools.grad",
    loss=True,
    returns="grads",
)


@uses_pipeline(GRAD)
def grad(f, *args, argnums=0, has_aux=False, dynamic_shapes=None) -> fx.GraphModule:
    """The gradient of scalar-valued ``f`` at example ``args``: ``gm(*args) -> grads``.

    As ``torch.func.grad``: ``argnums`` (int or tuple) picks the arguments differentiated;
    for an int the result has that argument's structure, for a tuple it is a tuple of those.
    ``has_aux=True``: ``f`` returns ``(loss, aux)`` and ``gm(*args) -> (grads, aux)``.
    Other keyword arguments are example keyword arguments of ``f``, passed through and not
    differentiated, as torch.func passes them: ``fxtools.grad(f, x, scale=2.0)`` makes a module
    called as ``gm(x, scale=2.0)``.
    """
    return _grad_gm(f, args, argnums, with_value=False, dynamic_shapes=dynamic_shapes, has_aux=has_aux)


VALUE_AND_GRAD = Transform(
    "fxtools.value_and_grad",
    loss=True,
    returns="value, grads",
)


@uses_pipeline(VALUE_AND_GRAD)
def value_and_grad(f, *args, argnums=0, has_aux=False, dynamic_shapes=None) -> fx.GraphModule:
    """Like ``grad``, but ``gm(*args) -> (value, grads)``; with ``has_aux=True``,
    ``gm(*args) -> ((value, aux), grads)``, as ``jax.value_and_grad`` (``torch.func.grad_and_value``
    returns the same two items the other way round). Keyword arguments as on ``grad``."""
    return _grad_gm(f, args, argnums, with_value=True, dynamic_shapes=dynamic_shapes, has_aux=has_aux)
