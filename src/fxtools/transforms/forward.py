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
from ..codegen.assemble import assemble
from ..codegen.render import render
from ..codegen.show import remember_inputs
from ..errors import FxtoolsError
from ..graph import meta
from ..graph.nodes import fake_mode_of, is_float
from ..passes.simplify import dce, simplify
from ..passes.views import collapse_view_chains
from ..signature import closures, sizes
from ..signature.guards import install, tangent_role
from ..signature.naming import short_op
from . import control_flow
from .calling import transform
from .reverse import ReverseSpec, reverse
from .vjp import AuxSplit, _names, argnums_tuple, prepare

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


def tidy_names(gm: fx.GraphModule) -> None:
    """``tangent_out_1`` -> ``tangent_out`` when the shorter name is free (after fusions)."""
    import re

    taken = {n.name for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        m = re.fullmatch(r"((?:tangent|grad|hvp)_\w+?)_\d+", node.name)
        if m and m.group(1) not in taken:
            node.name = m.group(1)  # the graph namespace still lists it; harmless: names are unique
            taken.add(node.name)


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


@transform("fxtools.jvp")
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
    if not isinstance(args, tuple):
        args = tuple(args)
    nums = tuple(range(len(args))) if argnums is None else argnums_tuple(argnums, len(args))
    if len(set(nums)) != len(nums):
        raise ValueError(f"argnums {argnums!r} names an argument twice")
    with custom.transform("fxtools.jvp"):  # a Function's own jvp would be ignored: refuse it
        cap, wrt = prepare(f, args, nums, dynamic_shapes, has_aux=has_aux, made_by="fxtools.jvp")
    cap.f = f
    split = AuxSplit(cap.out_spec, has_aux)
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
    fake_mode = fake_mode_of(flat.graph)
    graph = fx.Graph()
    env = {}
    new_x = []
    for p in x_ph:
        q = graph.placeholder(p.name)
        q.meta["val"] = p.meta.get("val")
        env[p] = q
        new_x.append(q)
    float_x = [i for a in nums for i, v in enumerate(x_vals) if x_arg[i] == a and is_float(v)]
    t_new = {}
    for i in float_x:
        q = graph.placeholder(f"tangent_{x_ph[i].name}")
        q.meta["val"] = x_ph[i].meta.get("val")
        t_new[i] = q
    for k, p in enumerate(t_ph):
        env[p] = t_new[wrt_x[tangent_of[k]]]
    for p in u_ph:
        # J t does not depend on u (the VJP is linear in it); anything left reading u is dead
        # or multiplied away, and zero is as good a value as any.
        env[p] = _zeros(graph, p.meta["val"], fake_mode, "zeros")
    mapped = graph.graph_copy(flat.graph, env)
    mapped = list(mapped) if isinstance(mapped, (tuple, list)) else [mapped]
    outs = mapped[:n_out]
    jt = mapped[n_out + len(wrt_x) :]
    out_tangents = []
    it = iter(jt)
    jt_of = {i: next(it) for i in ct_index}
    for i, o in enumerate(cap.out_leaves[: split.n_main]):  # aux gets no tangent
        if i in jt_of:
            out_tangents.append(jt_of[i])
        elif is_float(o):
            src = outs[i]
            if isinstance(src, fx.Node):
                z = graph.call_function(aten.zeros_like.default, (src,))
                z.meta["val"] = src.meta.get("val")
            else:
                z = torch.zeros_like(o)
            out_tangents.append(z)
        else:
            out_tangents.append(None)
    graph.output((*outs, *out_tangents))
    flat_gm = fx.GraphModule(flat, graph)
    dce(flat_gm)
    for n in flat_gm.graph.nodes:
        if n.op == "placeholder" and n.name.startswith("grad_") and n.users:
            raise FxtoolsError("internal error: the JVP depends on the cotangent of the VJP")

    names = _names(f, args)
    tangent_examples = [(f"tangent_{names[a]}", pytree.tree_map(lambda v: v if is_float(v) else None, args[a])) for a in nums]

    def build(flat_results):
        tan = split.main(flat_results[n_out:])
        if has_aux:
            return split.main(flat_results[:n_out]), tan, split.aux(flat_results[:n_out])
        return pytree.tree_unflatten(flat_results[:n_out], cap.out_spec), tan

    gm = finish(
        flat_gm,
        names,
        args,
        cap,
        build,
        tangent_examples,
        leaf_x_only=True,
        made_by="fxtools.jvp",
        roles={len(args) + i: tangent_role(names[a]) for i, a in enumerate(nums)},
    )
    meta.OUT_EXAMPLE.set(gm, split.main(list(cap.out_leaves)))
    return gm


def finish(flat_gm, names, args, cap, build, extra_args, leaf_x_only=False, made_by="fxtools", roles=None) -> fx.GraphModule:
    """Assemble the user-facing module, simplify, render; ``made_by`` and ``roles`` describe
    it to its guards (``fxtools.signature.guards``)."""
    gm = assemble(flat_gm, names, args, cap.tensor_leaf, cap.names, build, extra_args)
    simplify(gm)
    while collapse_view_chains(gm):
        simplify(gm)
    sizes.check(cap.symbolic, gm)
    tidy_names(gm)
    render(gm)
    sizes.name_sizes(gm, cap.symbolic)
    gm.graph.lint()
    gm.recompile()
    examples = [*args, *(v for _, v in extra_args)]
    install(gm, made_by, [*names, *(n for n, _ in extra_args)], sizes.concrete(cap, examples), roles=roles)
    sizes.guard_symbolic(gm.guards, cap, examples)
    closures.attach(gm, cap.reads, made_by)
    return remember_inputs(gm)
