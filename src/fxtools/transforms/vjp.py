"""The public transforms: ``vjp``, ``grad`` and ``value_and_grad``.

Each traces the user's function once on its example arguments (shapes and Python values are
specialised to them), differentiates the trace source-to-source, simplifies the result and
renders it with public PyTorch names. What comes back is an ordinary ``torch.fx.GraphModule``
whose calls first check that the arguments are what it was made for (``fxtools.codegen.guards``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import rules  # noqa: F401  (registers fxtools' own rules)
from ..capture.functionalize import functionalize
from ..capture.trace import Captured, capture, check_supported
from ..codegen import sizes
from ..codegen.assemble import assemble
from ..codegen.draw import PART_KEY
from ..codegen.guards import OptionalTensor, cotangent_role, install
from ..codegen.naming import arg_names
from ..codegen.render import render
from ..codegen.show import remember_inputs
from ..passes.simplify import simplify
from ..rules.decompose import expand
from . import control_flow
from .reverse import ReverseSpec, ancestors, is_float, reverse


def _argnums_tuple(argnums, nargs):
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not -nargs <= a < nargs:
            raise ValueError(f"argnums {a} is out of range for a function of {nargs} positional arguments")
    return tuple(a % nargs for a in nums)


def prepare(f, args, argnums, dynamic_shapes=None):
    if not isinstance(args, tuple):
        args = tuple(args)
    cap = capture(f, args, dynamic_shapes=dynamic_shapes)
    sizes.check(cap.symbolic, cap.gm)  # the program itself specialised a marked size
    functionalize(cap.gm)
    expand(cap.gm)
    control_flow.prepare(cap.gm)
    check_supported(cap.gm)
    nums = set(argnums)
    wrt = [cap.arg_of_leaf[i] in nums for i, t in enumerate(cap.tensor_leaf) if t]
    return cap, wrt


def grads_structure(cap: Captured, args, grads_flat, argnums):
    """Nest flat gradients like the differentiated arguments; non-float leaves get None."""
    it = iter(grads_flat)
    tensor_leaves = [leaf for leaf, t in zip(cap.leaves, cap.tensor_leaf) if t]
    per_leaf = []
    ti = 0
    for leaf, t, a in zip(cap.leaves, cap.tensor_leaf, cap.arg_of_leaf):
        if t:
            g = next(it) if a in argnums else None
            ti += 1
        else:
            g = None
        per_leaf.append(g if is_float(leaf) else None)
    del tensor_leaves
    nested = pytree.tree_unflatten(per_leaf, cap.in_spec)
    return tuple(nested[a] for a in argnums)


def _names(f, args):
    return arg_names(f.forward if isinstance(f, torch.nn.Module) else f, len(args))


def mark_parts(flat_gm: fx.GraphModule, n_out: int) -> None:
    """Tag each op "forward" if an output value of ``f`` depends on it, else "backward" (for drawing)."""
    outs = [o for o in next(n for n in flat_gm.graph.nodes if n.op == "output").args[0][:n_out] if isinstance(o, fx.Node)]
    forward = ancestors(outs)
    for node in flat_gm.graph.nodes:
        if node.op in ("call_function", "call_method", "get_attr"):
            node.meta[PART_KEY] = "forward" if node in forward else "backward"


def _finish(cap, flat_gm, args, build, made_by, extra_args=(), guard_extra=None):
    mark_parts(flat_gm, len(cap.out_leaves))
    names = _names(cap_f(cap), args)
    gm = assemble(flat_gm, names, args, cap.tensor_leaf, cap.names, build, extra_args)
    simplify(gm)
    sizes.check(cap.symbolic, gm)
    render(gm)
    sizes.name_sizes(gm, cap.symbolic)
    gm.graph.lint()
    gm.recompile()
    roles = {len(args) + i: cotangent_role() for i, _ in enumerate(extra_args)}
    extra = guard_extra if guard_extra is not None else [v for _, v in extra_args]
    examples = [*args, *extra]
    install(gm, made_by, [*names, *(n for n, _ in extra_args)], sizes.concrete(cap, examples), roles=roles)
    sizes.guard_symbolic(gm.guards, cap, examples)
    return remember_inputs(gm)


def cap_f(cap):
    return cap.__dict__.get("f")


def _output_structure(cap, out_flat):
    return pytree.tree_unflatten(out_flat, cap.out_spec)


def vjp(f, *args, dynamic_shapes=None) -> fx.GraphModule:
    """The vector-Jacobian product of ``f`` at example ``args``, as readable PyTorch code.

    Returns a GraphModule ``gm`` with ``out, grads = gm(*args, grad_out)``: ``out`` is
    ``f(*args)``; ``grad_out`` has the structure of ``out`` (pass ``None`` for leaves that are
    not floating point, such as the indices of ``torch.max(x, dim)``); ``grads`` has one entry
    per positional argument, each with that argument's pytree structure, holding
    ``J^T grad_out`` for floating-point tensor leaves and ``None`` for every other leaf.

    ``dynamic_shapes`` (here and in every transform; torch.export's format, see ``fxtools.codegen.sizes``)
    keeps the marked sizes symbolic: the module then serves every size in their range.
    """
    argnums = tuple(range(len(args)))
    cap, wrt = prepare(f, args, argnums, dynamic_shapes)
    cap.f = f
    flat_gm, ct_index, _ = reverse(cap, ReverseSpec(wrt, "cotangent"))
    n_out = len(cap.out_leaves)
    ct_example = pytree.tree_unflatten([cap.out_leaves[i] if i in ct_index else None for i in range(n_out)], cap.out_spec)

    def build(flat):
        out = _output_structure(cap, flat[:n_out])
        return out, grads_structure(cap, args, flat[n_out:], argnums)

    # what grad_out may be: the output's shape at floating-point leaves (None too where no gradient
    # flows, as the code ignores it there), None elsewhere
    accepts = pytree.tree_unflatten(
        [o if i in ct_index else OptionalTensor(o) if is_float(o) else None for i, o in enumerate(cap.out_leaves)], cap.out_spec
    )
    return _finish(cap, flat_gm, args, build, "fxtools.vjp", extra_args=[("grad_out", ct_example)], guard_extra=[accepts])


def _grad_gm(f, args, argnums, with_value, dynamic_shapes=None):
    nums = _argnums_tuple(argnums, len(args))
    cap, wrt = prepare(f, args, nums, dynamic_shapes)
    cap.f = f
    outs = [o for o in cap.out_leaves if isinstance(o, torch.Tensor)]
    if len(cap.out_leaves) != 1 or not outs or outs[0].numel() != 1 or not is_float(outs[0]):
        raise ValueError(
            "grad needs f to return a single floating-point tensor with one element "
            f"(got {pytree.tree_unflatten(cap.out_leaves, cap.out_spec)!r}); use fxtools.vjp for other outputs"
        )
    flat_gm, _, _ = reverse(cap, ReverseSpec(wrt, "ones"))

    def build(flat):
        grads = grads_structure(cap, args, flat[1:], nums)
        grads = grads[0] if isinstance(argnums, int) else grads
        return (_output_structure(cap, flat[:1]), grads) if with_value else grads

    return _finish(cap, flat_gm, args, build, "fxtools.value_and_grad" if with_value else "fxtools.grad")


def grad(f, *args, argnums=0, dynamic_shapes=None) -> fx.GraphModule:
    """The gradient of scalar-valued ``f`` at example ``args``: ``gm(*args) -> grads``.

    As ``torch.func.grad``: ``argnums`` (int or tuple) picks the arguments differentiated;
    for an int the result has that argument's structure, for a tuple it is a tuple of those.
    """
    return _grad_gm(f, args, argnums, with_value=False, dynamic_shapes=dynamic_shapes)


def value_and_grad(f, *args, argnums=0, dynamic_shapes=None) -> fx.GraphModule:
    """Like ``grad``, but ``gm(*args) -> (value, grads)``."""
    return _grad_gm(f, args, argnums, with_value=True, dynamic_shapes=dynamic_shapes)
