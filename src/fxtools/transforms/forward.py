"""Forward mode: ``jvp(f, *args)``, the Jacobian-vector product, as readable PyTorch code.

How: the transpose trick, reusing the VJP rules
-------------------------------------------------
fxtools has one rule per op, for reverse mode. Rather than write (and keep correct) a second
rule per op for forward mode, ``jvp`` uses the fact that the VJP graph

    u -> (f(x), J(x)^T u)

is *linear* in the cotangent ``u``. Differentiating that graph with respect to ``u`` (reverse
mode again, with cotangent ``t`` on its ``J^T u`` outputs) gives the transpose of ``J^T``,
that is ``J t``: the JVP. Because the second pass only differentiates the backward ops that
``u`` flows through (the forward ops do not depend on ``u``) and the result does not depend on
``u`` at all, dead-code elimination leaves exactly the forward computation plus one linear
op per backward op: for ``sin`` the VJP ``ct * cos(x)`` transposes to ``t * cos(x)``.

Why this and not forward rules: every op fxtools can differentiate in reverse mode (its own
rules, PyTorch decompositions, rules derived from PyTorch's derivative formulas, the user's
``register_vjp`` and ``custom_vjp`` rules) is then supported in forward mode with no extra
table, and the two modes cannot disagree. The cost is paid once, when the code is generated;
the generated code is what one would write by hand after simplification.

Naming: a cotangent of a cotangent is a tangent, so the value the second pass calls
``grad_grad_v`` (the cotangent of ``v``'s cotangent) is the tangent of ``v`` and is named
``tangent_v``. Tangent arguments are ``tangent_<arg>`` (pytrees as for ``vjp``).

No pass fuses ``a + b * c`` into ``torch.addcmul(a, b, c)``: PyTorch's kernel may compute it
with one rounding (a fused multiply-add), so it differs from ``a + b * c`` in the last bit for
about one input in four, and stays finite where ``b * c`` overflows. A clean-up is exact or not
applied (``tests/test_transforms.py``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.utils import _pytree as pytree

from ..capture import custom, dual, nested
from ..capture.trace import forward_grad_modes
from ..graph import meta
from ..graph.nodes import is_float
from ..signature.guards import tangent_role
from .pipeline import Inputs, Transform, back, uses_pipeline
from .tangents import jvp_graph, tangent_names, transpose_vjp
from .vjp import AuxSplit, argnums_tuple, prepare

aten = torch.ops.aten

__all__ = ["jvp", "transpose_vjp", "tangent_names"]


JVP = Transform(
    "fxtools.jvp",
    forward_mode=True,
    returns="out, tangent_out",
    extra=("tangent_x",),
)


@uses_pipeline(JVP)
def jvp(f, *args, argnums=None, has_aux=False, dynamic_shapes=None) -> fx.GraphModule:
    """The Jacobian-vector product of ``f`` at example ``args``, as readable PyTorch code.

    Returns a GraphModule ``gm`` with ``out, out_tangent = gm(*args, *tangents)``: there is one
    tangent per positional argument, with that argument's pytree structure (pass ``None`` at
    leaves that are not floating-point tensors, such as class indices); ``out`` is ``f(*args)``
    and ``out_tangent`` has its structure, holding ``J @ tangents`` at floating-point leaves and
    ``None`` elsewhere. As ``torch.func.jvp(f, args, tangents)``.

    ``argnums`` (int or tuple, as on ``grad``): tangents only for those arguments, in that
    order (the others are held constant): ``gm(*args, *tangents_of_argnums)``. ``has_aux=True``:
    ``f`` returns ``(out, aux)`` and ``out, out_tangent, aux = gm(...)``, as torch.func.jvp's.

    Called inside a function fxtools differentiates (a training loss), it returns a callable
    taking the same arguments, whose JVP becomes part of that function's graph
    (``docs/jvp_losses.md``).
    """
    args = tuple(args)
    nums = tuple(range(len(args))) if argnums is None else argnums_tuple(argnums, len(args))
    if len(set(nums)) != len(nums):
        raise ValueError(f"argnums {argnums!r} names an argument twice")
    if nested.capturing_program() or torch.compiler.is_dynamo_compiling():  # forward mode in the program's graph
        return dual.JvpCall(f, len(args), nums, has_aux)  # type: ignore[return-value]
    with custom.transform(JVP):  # a Function's own jvp would be ignored: refuse it
        cap, wrt = prepare(f, args, nums, dynamic_shapes, has_aux=has_aux, made_by=JVP)
    split = AuxSplit(cap.out_spec, has_aux)
    flat_gm = _jvp_graph(cap, wrt, nums, split.n_main)
    names, n_out = cap.arg_names, len(cap.out_leaves)
    tangent_examples = [(f"tangent_{names[a]}", pytree.tree_map(lambda v: v if is_float(v) else None, args[a])) for a in nums]

    def build(flat_results):
        tan = split.main(flat_results[n_out:])
        if has_aux:
            return split.main(flat_results[:n_out]), tan, split.aux(flat_results[:n_out])
        return pytree.tree_unflatten(flat_results[:n_out], cap.out_spec), tan

    roles = {len(args) + i: tangent_role(names[a]) for i, a in enumerate(nums)}
    gm = back(flat_gm, cap, build, JVP, Inputs(args, extra=tangent_examples, roles=roles), collapse_views=True)
    meta.OUT_EXAMPLE.set(gm, split.main(list(cap.out_leaves)))
    meta.AUX_SPEC.set(gm, split.aux_spec)
    return gm


def _jvp_graph(cap, wrt: list[bool], nums: tuple, n_main: int) -> fx.GraphModule:
    """The flat JVP graph ``(x..., tangents of nums' float leaves...) -> (out..., J t per main output)``."""
    x_vals = [leaf for leaf, t in zip(cap.leaves, cap.tensor_leaf) if t]
    x_arg = [a for a, t in zip(cap.arg_of_leaf, cap.tensor_leaf) if t]
    order = [i for a in nums for i, v in enumerate(x_vals) if x_arg[i] == a and is_float(v)]
    forward_grad_modes(cap.gm)  # tangents flow through no_grad, as in torch.func.jvp
    # the VJP's nodes keep their op's user line, for an error of the second pass to name it (an
    # op whose backward has no derivative: ``ctc_loss``)
    with fx_traceback.preserve_node_meta():
        return jvp_graph(cap.gm, wrt, order, n_main)
