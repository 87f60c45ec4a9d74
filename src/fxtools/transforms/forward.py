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
from torch.utils import _pytree as pytree

from ..capture import custom
from ..capture.decompose import expand
from ..capture.functionalize import functionalize
from ..errors import FxtoolsError
from ..graph import meta
from ..graph.nodes import fake_mode_of, is_float
from ..passes.simplify import dce, simplify
from ..signature.guards import tangent_role
from ..signature.naming import short_op
from . import control_flow
from .pipeline import USERS, back, uses_pipeline
from .reverse import ReverseSpec, reverse
from .vjp import AuxSplit, argnums_tuple, prepare

aten = torch.ops.aten

__all__ = ["jvp", "transpose_vjp", "tangent_names"]


def _prepared(gm: fx.GraphModule) -> fx.GraphModule:
    """A flat ATen graph (from ``reverse``) made ready to be reversed again."""
    functionalize(gm)
    expand(gm)
    control_flow.prepare(gm)  # the VJP's own cond / scan, differentiated again
    return gm


def tangent_names(gm: fx.GraphModule) -> None:
    """``grad_grad_v`` (cotangent of a cotangent) is the tangent of ``v``: name it so.

    Other ``grad_`` names of the second pass are cotangents of backward intermediates, which
    mean nothing to a reader of forward-mode code: they are named after their first input and op.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.name.startswith("grad_"):
            continue
        if node.name.startswith("grad_grad_"):
            node._rename("tangent_" + node.name[len("grad_grad_") :])
        else:  # named after the value it is computed from (renamed already) and its op: tangent_x_mul
            first = next((a for a in node.all_input_nodes if a.op != "get_attr"), None)
            base = "tangent" if first is None or first.op == "placeholder" else first.name  # placeholders are renamed later
            node._rename(f"{base}_{short_op(node)}")


def transpose_vjp(vjp_gm: fx.GraphModule, n_in: int, n_out: int):
    """Transpose the flat VJP graph ``(x..., u...) -> (out..., J^T u...)``.

    ``vjp_gm`` has ``n_in`` primal placeholders followed by cotangent placeholders ``u``, and
    returns ``n_out`` primal outputs followed by one gradient (or None) per primal input.
    Returns ``(gm, tangent_of)``: ``gm`` takes ``(x..., u..., t...)`` and returns
    ``(out..., J^T u..., J t per u)``, and ``tangent_of[k]`` is the primal input index whose
    tangent is the k-th ``t`` placeholder.
    """
    placeholders = [n for n in vjp_gm.graph.nodes if n.op == "placeholder"]
    n_u = len(placeholders) - n_in
    wrt = [False] * n_in + [True] * n_u
    rev = reverse(_prepared(vjp_gm), ReverseSpec(wrt, "cotangent"))
    flat, ct_index = rev.gm, rev.ct_index
    for i in ct_index:
        if i < n_out:
            raise FxtoolsError("internal error: a primal output depends on the cotangent")
    return flat, [i - n_out for i in ct_index]


def _zeros(graph: fx.Graph, val, fake_mode, name="zeros"):
    node = graph.call_function(aten.zeros.default, (list(val.shape),), {"dtype": val.dtype})
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = torch.zeros(val.shape, dtype=val.dtype)
    return node


# Ops whose PyTorch gradient is deliberately not the adjoint of their forward, with the
# arguments that make it so: ``embedding``'s gradient skips the padding row (so training leaves
# it alone) and may be scaled by word frequency, but its forward reads every row plainly. Forward
# mode, like torch.func.jvp, gives the derivative of the forward: those arguments are reset
# (they change only the gradient, never the value).
_GRADIENT_ONLY_ARGS = {aten.embedding.default: {2: -1, 3: False}}  # padding_idx, scale_grad_by_freq


def _true_adjoints(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        reset = _GRADIENT_ONLY_ARGS.get(node.target) if node.op == "call_function" else None
        if reset:
            args = list(node.args)
            for i, value in reset.items():
                if i < len(args):
                    args[i] = value
            node.args = tuple(args)


@uses_pipeline(
    "fxtools.jvp",
    requires="front: a prepared graph with VJP rules (forward mode transposes the VJP)",
    ensures="gm(*args, *tangents) -> (out, out_tangent), out_tangent nested as out",
    forward_mode=True,
)
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
    """
    args = tuple(args)
    nums = tuple(range(len(args))) if argnums is None else argnums_tuple(argnums, len(args))
    if len(set(nums)) != len(nums):
        raise ValueError(f"argnums {argnums!r} names an argument twice")
    with custom.transform(USERS["fxtools.jvp"]):  # a Function's own jvp would be ignored: refuse it
        cap, wrt = prepare(f, args, nums, dynamic_shapes, has_aux=has_aux, made_by="fxtools.jvp")
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
    gm = back(
        flat_gm, cap, build, made_by="fxtools.jvp", args=args, extra_args=tangent_examples, roles=roles, collapse_views=True
    )
    meta.OUT_EXAMPLE.set(gm, split.main(list(cap.out_leaves)))
    return gm


def _jvp_graph(cap, wrt: list[bool], nums: tuple, n_main: int) -> fx.GraphModule:
    """The flat JVP graph ``(x..., tangents of nums' float leaves...) -> (out..., J t per main output)``:
    the VJP of ``cap``, transposed, its cotangent inputs replaced by zeros (nothing depends on them)."""
    _true_adjoints(cap.gm)
    rev = reverse(cap.gm, ReverseSpec(wrt, "cotangent"))
    vjp_flat, ct_index = rev.gm, rev.ct_index
    simplify(vjp_flat)
    x_vals = [leaf for leaf, t in zip(cap.leaves, cap.tensor_leaf) if t]
    x_arg = [a for a, t in zip(cap.arg_of_leaf, cap.tensor_leaf) if t]
    wrt_x = [i for i, w in enumerate(wrt) if w]  # the tensor leaves with a gradient output, in order
    n_x, n_out = len(x_vals), len(cap.out_leaves)
    flat, tangent_of = transpose_vjp(vjp_flat, n_x, n_out)
    tangent_names(flat)

    # Rebuild: placeholders (x..., one tangent per float tensor leaf), outputs (out..., J t...).
    old_ph = [n for n in flat.graph.nodes if n.op == "placeholder"]
    x_ph, u_ph, t_ph = old_ph[:n_x], old_ph[n_x : n_x + len(ct_index)], old_ph[n_x + len(ct_index) :]
    graph = fx.Graph()
    env = {p: _placeholder(graph, p.name, p) for p in x_ph}
    float_x = [i for a in nums for i, v in enumerate(x_vals) if x_arg[i] == a and is_float(v)]
    t_new = {i: _placeholder(graph, f"tangent_{x_ph[i].name}", x_ph[i]) for i in float_x}
    for k, p in enumerate(t_ph):
        env[p] = t_new[wrt_x[tangent_of[k]]]
    fake_mode = fake_mode_of(flat.graph)
    for p in u_ph:
        # J t does not depend on u (the VJP is linear in it); anything left reading u is dead
        # or multiplied away, and zero is as good a value as any.
        env[p] = _zeros(graph, p.meta["val"], fake_mode, "zeros")
    mapped = graph.graph_copy(flat.graph, env)
    mapped = list(mapped) if isinstance(mapped, (tuple, list)) else [mapped]
    outs = mapped[:n_out]
    jt_of = dict(zip(ct_index, mapped[n_out + len(wrt_x) :]))
    out_tangents = [_out_tangent(graph, jt_of, outs, i, o) for i, o in enumerate(cap.out_leaves[:n_main])]  # aux gets none
    graph.output((*outs, *out_tangents))
    flat_gm = fx.GraphModule(flat, graph)
    dce(flat_gm)
    for n in flat_gm.graph.nodes:
        if n.op == "placeholder" and n.name.startswith("grad_") and n.users:
            raise FxtoolsError("internal error: the JVP depends on the cotangent of the VJP")
    return flat_gm


def _placeholder(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    q = graph.placeholder(name)
    q.meta["val"] = like.meta.get("val")
    return q


def _out_tangent(graph: fx.Graph, jt_of: dict, outs: list, i: int, o):
    """The tangent of output ``i``: its ``J t``, zeros for a float output no tangent reaches, else None."""
    if i in jt_of:
        return jt_of[i]
    if not is_float(o):
        return None
    src = outs[i]
    if not isinstance(src, fx.Node):
        return torch.zeros_like(o)
    z = graph.call_function(aten.zeros_like.default, (src,))
    z.meta["val"] = src.meta.get("val")
    return z
