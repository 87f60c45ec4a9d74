"""Forward mode's graph: the transposed VJP, for ``fxtools.jvp`` and for JVPs inside a program.

``jvp_graph(gm, wrt, order, n_main)`` is the flat JVP graph of a prepared flat graph: fxtools'
one forward mode (see ``transforms/forward.py`` for why it transposes the VJP rules).
``fxtools.jvp`` builds its module from it; ``resolve`` uses it for the forward mode a program
runs itself (``torch.func.jvp``, ``torch.autograd.forward_ad``, ``fxtools.jvp`` called inside
the function being differentiated), which capture records as ``dual`` / ``tangent`` markers
(``capture/dual.py``): each ``tangent(y, level)`` becomes the JVP of the ops between the level's
duals and ``y``, inlined where the program asked for it, and each dual its primal. The primal
ops are shared with the program (the copies the JVP graph makes are common subexpressions), a
tangent that is a known zero (``torch.zeros_like(r)``) is no tangent at all, and the later
transform differentiates the tangent code like any other: the exact second-order terms where the
loss does not ``detach`` it.
"""

from __future__ import annotations

import heapq
import itertools
from typing import cast

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from .. import registry
from ..capture import dual
from ..capture.decompose import expand, inline_decomposition
from ..capture.functionalize import functionalize
from ..capture.subclasses import is_dtensor_step
from ..errors import FxtoolsError, user_line_of
from ..graph import meta
from ..graph.data_dependent import is_dynamic, tie
from ..graph.nodes import fake_mode_of, is_float, is_impure
from ..passes.simplify import cse, dce, fill_value, simplify
from ..signature.naming import short_op
from . import control_flow
from .reverse import ReverseSpec, ancestors, reverse

aten = torch.ops.aten

__all__ = ["jvp_graph", "transpose_vjp", "tangent_names", "resolve"]


def _prepared(gm: fx.GraphModule) -> fx.GraphModule:
    """A flat ATen graph (from ``reverse``) made ready to be reversed again."""
    functionalize(gm)
    expand(gm)
    control_flow.prepare(gm)  # the VJP's own cond / scan, differentiated again
    return gm


def tangent_names(gm: fx.GraphModule) -> None:
    """``grad_grad_v`` (cotangent of a cotangent) is the tangent of ``v``: name it so.

    Other ``grad_`` names of the second pass are cotangents of backward intermediates, which
    mean nothing to a reader of forward-mode code: they are steps of a tangent, named after the
    tangent they compute from and their op (``tangent_h_mul``), not after a chain of steps.
    """
    stem: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name.startswith("grad_grad_"):
            stem[node] = "tangent_" + node.name[len("grad_grad_") :]
        if node.op != "call_function" or not node.name.startswith("grad_"):
            continue
        if node.name.startswith("grad_grad_"):
            node._rename("tangent_" + node.name[len("grad_grad_") :])
            stem[node] = node.name
        else:
            source = next((a for a in node.all_input_nodes if a in stem), None)
            stem[node] = stem[source] if source is not None else "tangent"
            node._rename(f"{stem[node]}_{short_op(node)}")


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


def _zeros(graph: fx.Graph, val, fake_mode):
    shape = [] if is_dynamic(val) else list(val.shape)  # a data-dependent one: _zeros_like_output
    node = graph.call_function(aten.zeros.default, (shape,), {"dtype": val.dtype})
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


def _outputs(gm: fx.GraphModule) -> list:
    return list(next(n for n in gm.graph.nodes if n.op == "output").args[0])


def jvp_graph(gm: fx.GraphModule, wrt: list[bool], order: list[int], n_main: int) -> fx.GraphModule:
    """The flat JVP graph of ``gm`` (flat, prepared): ``(x..., t...) -> (out..., J t per main output)``.

    ``wrt[i]``: placeholder ``i`` is differentiated; ``order``: the float placeholders of ``wrt``
    whose tangents ``t`` are, in that order. The VJP of ``gm``, transposed, its cotangent inputs
    replaced by zeros (nothing depends on them). Outputs after the first ``n_main`` get no tangent.
    """
    _true_adjoints(gm)
    # The readable rules, as for hvp (the VJP is differentiated again, and fused backward kernels
    # are first-order only: CPU flash attention's backward has no derivative), with the adjoint of
    # the forward where PyTorch's gradient is not it (the "adjoint" set: index_put's repeated indices).
    with registry.rule_set("adjoint"):
        rev = reverse(gm, ReverseSpec(wrt, "cotangent"))
    vjp_flat, ct_index = rev.gm, rev.ct_index
    simplify(vjp_flat)
    x_ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_vals = [o.meta.get("val") if isinstance(o, fx.Node) else o for o in _outputs(gm)]
    wrt_x = [i for i, w in enumerate(wrt) if w]  # the placeholders with a gradient output, in order
    n_x, n_out = len(x_ph), len(out_vals)
    flat, tangent_of = transpose_vjp(vjp_flat, n_x, n_out)
    tangent_names(flat)

    # Rebuild: placeholders (x..., one tangent per float placeholder of ``order``), outputs (out..., J t...).
    old_ph = [n for n in flat.graph.nodes if n.op == "placeholder"]
    x_old, u_ph, t_ph = old_ph[:n_x], old_ph[n_x : n_x + len(ct_index)], old_ph[n_x + len(ct_index) :]
    graph = fx.Graph()
    env = {p: _placeholder(graph, p.name, p) for p in x_old}
    t_new = {i: _placeholder(graph, f"tangent_{x_old[i].name}", x_old[i]) for i in order}
    for k, p in enumerate(t_ph):
        env[p] = t_new[wrt_x[tangent_of[k]]]
    fake_mode = fake_mode_of(flat.graph)
    for p in u_ph:
        # J t does not depend on u (the VJP is linear in it); anything left reading u is dead
        # or multiplied away, and zero is as good a value as any.
        env[p] = _zeros(graph, p.meta["val"], fake_mode)
    mapped = graph.graph_copy(flat.graph, env)
    mapped = list(mapped) if isinstance(mapped, (tuple, list)) else [mapped]
    outs = mapped[:n_out]
    jt_of = dict(zip(ct_index, mapped[n_out + len(wrt_x) :]))
    out_tangents = [_out_tangent(graph, jt_of, outs, i, o) for i, o in enumerate(out_vals[:n_main])]
    graph.output((*outs, *out_tangents))
    flat_gm = fx.GraphModule(flat, graph)
    dce(flat_gm)  # (its placeholders are the primals and tangents: the cotangents became zeros above)
    for p, i in zip(u_ph, ct_index):
        out = outs[i]
        if is_dynamic(p.meta.get("val")) and isinstance(out, fx.Node):
            _zeros_like_output(graph, env[p], out)
    return flat_gm


def _zeros_like_output(graph: fx.Graph, z: fx.Node, out: fx.Node) -> None:
    """The zeros standing for the cotangent of ``out``, whose shape depends on data (``x[mask]``,
    ``repeat_interleave``): written ``zeros_like(out)`` and their sizes read from ``out`` (a raw
    SymInt is not code; the re-traced ``out`` has a fresh symbol, told equal to the cotangent's)."""
    if z.graph is not graph or not z.users:
        return
    tie(out.meta["val"], z.meta["val"])
    for user in [u for u in z.users if u.target is aten.sym_size.int]:
        user.args = (out, *user.args[1:])
    if z.users:
        with graph.inserting_after(out):
            like = graph.call_function(aten.zeros_like.default, (out,))
        like.meta["val"] = z.meta["val"]
        z.replace_all_uses_with(like)
    graph.erase_node(z)


def _placeholder(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    q = graph.placeholder(name)
    q.target = q.name  # the signature reads targets: the user's own ``tangent_x`` keeps its name, ours gets ``_1``
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


# ---------------------------------------------------------------------------------------------
# Forward mode a program runs itself


def _is(node: fx.Node, target) -> bool:
    return node.op == "call_function" and node.target is target


def _value(marker: fx.Node) -> fx.Node:
    """A marker's first argument: a dual's primal, the value a tangent is of."""
    return cast(fx.Node, marker.args[0])


def _level(marker: fx.Node) -> int:
    return cast(int, marker.args[2 if _is(marker, dual.dual) else 1])


def resolve(gm: fx.GraphModule) -> bool:
    """Replace forward mode's markers in ``gm`` (a prepared captured graph) by fxtools' own forward
    mode (see the module docstring); whether there were any."""
    graph = gm.graph
    if not any(_is(n, dual.dual) or _is(n, dual.tangent) for n in graph.nodes):
        return False
    program = set(graph.nodes)
    while True:
        group = _next_group(graph)
        if not group:
            break
        _compute_tangents(gm, group)
    for node in [n for n in graph.nodes if _is(n, dual.dual)]:
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
    cse(gm)  # the JVP's copies of the primal ops are the program's own
    dce(gm)
    _interleave(graph, program)
    expand(gm)  # the tangent code as the next transform differentiates it
    control_flow.prepare(gm)
    gm.recompile()
    return True


def _interleave(graph: fx.Graph, program: set[fx.Node]) -> None:
    """Move each op of the JVPs' code up to just after the computed values it reads, as forward
    mode runs; an op of inputs alone (a weight's transpose) goes just before its first reader.

    Inlined where the program asked for the tangent (after the whole primal), the tangent of a
    layer would be computed far from the layer's own ops; next to them, the values both read are
    still hot, and a compiler fuses the two (one pass computes GELU's value and slope). The
    program's own ops keep their order; the JVP's keep theirs among themselves. An op moves only
    within code of its own grad mode: moved into a ``no_grad`` block (the tangent's direction computed
    there), it would be a constant of the reverse pass.
    """
    index = {n: i for i, n in enumerate(graph.nodes)}
    mode_of = _grad_modes(graph)
    movable = {n for n in graph.nodes if n not in program and n.op in ("call_function", "get_attr") and not is_impure(n)}
    free: set[fx.Node] = set()
    for n in graph.nodes:
        if n in movable and mode_of[n] and all(i.op == "placeholder" or i in free for i in n.all_input_nodes):
            free.add(n)  # (one in a no_grad block stays in one: it waits for the program's next)
    waiting = {n: sum(1 for i in n.all_input_nodes if i not in free) for n in movable - free}
    ready: dict[bool, list] = {True: [], False: []}
    for n, count in waiting.items():
        if not count:
            ready[mode_of[n]].append((index[n], n))
    for heap in ready.values():
        heapq.heapify(heap)
    order: list[fx.Node] = []
    done: set[fx.Node] = set()

    def emit(n: fx.Node) -> None:
        for i in n.all_input_nodes:
            if i in free and i not in done:
                emit(i)
        order.append(n)
        done.add(n)
        for u in n.users:
            if u in waiting and n not in free:
                waiting[u] -= 1
                if not waiting[u]:
                    heapq.heappush(ready[mode_of[u]], (index[u], u))

    for n in list(graph.nodes):
        if n in movable:
            continue
        emit(n)
        here = ready[mode_of[n]]
        while here and n.op not in ("placeholder", "output"):
            emit(heapq.heappop(here)[1])
    if len(order) != len(index):
        raise FxtoolsError("internal error: forward mode's code could not be placed beside the program's")
    for prev, n in itertools.pairwise(order):
        if prev.next is not n:
            prev.append(n)


def _next_group(graph: fx.Graph) -> list[fx.Node]:
    """The first ``tangent`` markers of one level that can be computed together: the first one and
    the level's others whose value is computed before it (one jvp call's outputs)."""
    markers = [n for n in graph.nodes if _is(n, dual.tangent)]
    if not markers:
        return []
    first = markers[0]
    before = set()
    for n in graph.nodes:
        if n is first:
            break
        before.add(n)
    return [first] + [m for m in markers[1:] if m.args[1] == first.args[1] and m.args[0] in before]


def _region(graph: fx.Graph, level: int, ys: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The level's duals with a nonzero tangent, and the nodes between them and ``ys`` in graph order."""
    active = [n for n in graph.nodes if _is(n, dual.dual) and n.args[2] == level and fill_value(n.args[1]) != 0]
    down = set(active)
    forward_on = _forward_modes(graph)
    for n in graph.nodes:
        if n in down or n.op == "output" or (n.op == "call_function" and registry.is_nondifferentiable(n.target)):
            continue  # (a random draw, ``detach``: a constant of the JVP)
        if not forward_on[n]:
            continue  # inference mode, ``fwAD._set_fwd_grad_enabled(False)``: no tangent, as in PyTorch
        inputs = [n.args[0]] if _is(n, dual.dual) else n.all_input_nodes
        if any(i in down for i in inputs):
            down.add(n)
    up = ancestors(ys)
    region = [n for n in graph.nodes if n in down and n in up]
    for n in region:
        if _is(n, dual.tangent):
            raise FxtoolsError(
                f"forward mode opened at {dual.level_line(level)} uses the tangent of another level (at "
                f"{user_line_of(n) or 'an unknown line'}) before that level's tangents are complete; "
                "take the inner JVP inside a function passed to the outer torch.func.jvp"
            )
    return [d for d in active if d in up], region


def _compute_tangents(gm: fx.GraphModule, markers: list[fx.Node]) -> None:
    """Replace ``markers`` (tangents of one level) by the JVP of their region, inlined before the first."""
    graph = gm.graph
    level = _level(markers[0])
    ys = [_value(m) for m in markers]
    active, region = _region(graph, level, ys)
    if _lower_draws(gm, region):
        ys = [_value(m) for m in markers]
        active, region = _region(graph, level, ys)
    mode_of = _grad_modes(graph)
    off = {n for n in region if not mode_of[n] and not _is(n, dual.dual)}
    sources = _sources(active)
    made: set[fx.Node] = set()
    of: dict[fx.Node, fx.Node] = {}
    if off:
        # Values computed under no_grad, and their tangents, are constants of the reverse pass (as in
        # eager forward_ad + autograd): the tangents of those the grad-mode code reads are computed
        # first, in a no_grad block of their own, and are that code's sources.
        cut = [n for n in region if n in off and (n in ys or any(u not in off and u in region for u in n.users))]
        with graph.inserting_before(markers[0]):
            graph.call_function(torch._C._set_grad_enabled, (False,))
        cut_active, cut_region = _region(graph, level, cut)
        cut_tangents, cut_made = _tangents_of(gm, level, cut, _sources(cut_active), cut_region, markers[0])
        with graph.inserting_before(markers[0]):
            graph.call_function(torch._C._set_grad_enabled, (mode_of[markers[0]],))
        made |= cut_made
        of = dict(zip(cut, cut_tangents))
        for b, t in of.items():
            if t in cut_made and b not in ys:
                t._rename(f"tangent_{b.name}")
        region = [n for n in region if n not in off]
        sources += [(b, b, t) for b, t in of.items()]
    rest = [y for y in ys if y not in of]
    results, main_made = _tangents_of(gm, level, rest, sources, region, markers[0]) if rest else ([], set())
    made |= main_made
    by_y = {**dict(zip(rest, results)), **of}
    for m in markers:
        t = by_y[_value(m)]
        name = m.name
        m.replace_all_uses_with(t)
        graph.erase_node(m)
        if t in made:
            made.discard(t)
            t.name = name  # ``dudt``, the user's name: the erased marker's, unique and still reserved


def _tangents_of(gm: fx.GraphModule, level: int, ys: list[fx.Node], sources, region: list[fx.Node], before: fx.Node):
    """The tangents of ``ys`` (the JVP of ``region`` from ``sources``), inlined before ``before``;
    returns their nodes and the set of nodes made. ``sources``: ``(node, primal, tangent)``."""
    sub, inputs, tangents = _region_graph(gm, region, sources, ys, level)
    wrt = [i < len(tangents) for i in range(len(inputs))]
    # fused backward kernels (fxtools.compile's rule set) have no VJP of their own to transpose
    readable = "readable" if registry.active_rule_set() == "fused" else None
    with fx_traceback.preserve_node_meta(), registry.rule_set(readable):
        flat = jvp_graph(sub, wrt, list(range(len(tangents))), len(ys))
    return _inline(gm, flat, inputs + tangents, before, len(ys))


def _sources(duals: list[fx.Node]) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """``(dual, primal, tangent)`` for each of ``duals``."""
    return [(d, _value(d), cast(fx.Node, d.args[1])) for d in duals]


def _grad_modes(graph: fx.Graph) -> dict[fx.Node, bool]:
    """Each node's grad mode: the graph's ``_set_grad_enabled`` nodes switch it, starting from on."""
    mode_of, grad = {}, True
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            grad = bool(n.args[0])
        mode_of[n] = grad
    return mode_of


def _forward_modes(graph: fx.Graph) -> dict[fx.Node, bool]:
    """Whether forward AD is on at each node: off in inference mode and after
    ``fwAD._set_fwd_grad_enabled(False)`` (the ``_set_grad_enabled`` nodes' ``meta.FORWARD_GRAD``),
    on through ``no_grad``."""
    mode_of, state = {}, True
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            state = bool(meta.FORWARD_GRAD.get(n, state))
        mode_of[n] = state
    return mode_of


def _region_graph(gm, region: list[fx.Node], sources: list, ys: list[fx.Node], level: int):
    """The region as a flat graph: placeholders for the sources' primals (differentiated: the active
    duals, values whose tangents are computed already), then for what it reads from outside
    (constant for this JVP); returns it, the outer nodes its placeholders stand for, and the
    sources' tangents."""
    inside = set(region)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def placeholder(outer: fx.Node) -> fx.Node:
        p = sub.placeholder(f"arg{len(inputs)}")
        p._rename(outer.name)  # tangent steps are named after it
        p.meta["val"] = outer.meta.get("val")
        inputs.append(outer)
        return p

    for key, primal, _ in sources:
        env[key] = placeholder(primal)
    for n in region:
        reads = [] if n in env else [_value(n)] if _is(n, dual.dual) else n.all_input_nodes
        for a in reads:
            if a not in inside and a not in env:
                env[a] = placeholder(a) if a.op != "get_attr" or _is_tensor(gm, a) else _module_attr(sub, gm, a)
    for n in region:
        if n in env:
            continue
        if _is(n, dual.dual):  # another level's, or a zero tangent: its value is its primal
            env[n] = env[_value(n)]
            continue
        env[n] = sub.node_copy(n, env.__getitem__)
        if _updates_statistics(n):  # the program's own call updates them, once
            env[n].args = tuple(None if i in _STATISTICS else a for i, a in enumerate(env[n].args))
    for y in ys:
        if y not in env:  # no tangent reaches it (a random draw of the duals' values): zero
            env[y] = placeholder(y)
    sub.output([env[y] for y in ys])
    sub_gm = fx.GraphModule(_Attrs(gm, sub), sub)
    _refuse_random(region, level)
    return sub_gm, inputs, [t for _, _, t in sources]


def _is_tensor(gm, node: fx.Node) -> bool:
    return isinstance(getattr(gm, str(node.target)), torch.Tensor)


def _module_attr(sub: fx.Graph, gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """A submodule (control flow's function) the region calls, read as in ``gm``."""
    copy = sub.get_attr(str(node.target))
    copy.meta.update(node.meta)
    return copy


class _Attrs(torch.nn.Module):
    """The submodules the region graph reads, under their names in the program's module."""

    def __init__(self, gm: fx.GraphModule, graph: fx.Graph):
        super().__init__()
        for n in graph.nodes:
            if n.op == "get_attr":
                setattr(self, str(n.target), getattr(gm, str(n.target)))


_STATISTICS = (3, 4)  # the running mean and variance batch norms update in training
_UPDATING = {aten.batch_norm.default, aten.instance_norm.default, aten.native_batch_norm.default}


def _updates_statistics(node: fx.Node) -> bool:
    return node.target in _UPDATING and is_impure(node) and all(isinstance(node.args[i], fx.Node) for i in _STATISTICS)


def _draws(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (or has another effect a copy would repeat) and
    carries a tangent (a draw alone, ``bernoulli``, is a constant of the JVP)."""
    return (
        node.op == "call_function"
        and not _is(node, dual.dual)
        and is_impure(node)
        and not registry.is_nondifferentiable(node.target)
    )


def _lower_draws(gm: fx.GraphModule, region: list[fx.Node]) -> bool:
    """Random ops of the region (dropout, attention with dropout) replaced in the program by their
    rule's forward: the draw (``bernoulli``, as eager PyTorch draws it), then ops of the primal and
    the mask. The draw is a constant of the JVP, so the tangent applies the primal's mask."""
    changed = False
    for n in region:
        rule = registry.readable_rule(n.target) if _draws(n) else None
        if rule is not None and inline_decomposition(gm, n, lambda *a, rule=rule, **k: rule.fwd(*a, **k)[0]):
            changed = True
    return changed


def _refuse_random(region: list[fx.Node], level: int) -> None:
    """A random op between duals and a tangent would draw again for the tangent's copy; a step
    of a DTensor program (tensor parallel) has the global program's rule, whose transpose is not
    the local program's JVP (the all-reduce summing a replicated value's gradient would sum its
    tangent over the ranks): both refused, naming the op's line and the JVP's."""
    for n in region:
        if is_dtensor_step(n):
            op = getattr(n.target, "__name__", str(n.target))
            raise FxtoolsError(
                f"fxtools cannot take the JVP at {dual.level_line(level)} through {op} (at "
                f"{user_line_of(n) or 'an unknown line'}), a step of a tensor-parallel (DTensor) program: "
                "forward mode through DTensor's collectives and the edges of its region is not supported yet "
                "(eager's torch.func.jvp fails on DTensors too). Take the JVP of a module that is not "
                "tensor-parallel, or train it with FSDP2 or DDP, which work (docs/jvp_losses.md)."
            )
    for n in region:
        if _draws(n) and not _updates_statistics(n):
            op = getattr(n.target, "__name__", str(n.target))
            raise FxtoolsError(
                f"{op} (at {user_line_of(n) or 'an unknown line'}) draws random numbers inside the function whose JVP "
                f"is taken at {dual.level_line(level)}; fxtools cannot give the JVP the same random draw yet. Draw "
                "outside the jvp and pass the mask in (or use eval mode / p=0 for dropout)."
            )


def _inline(gm: fx.GraphModule, flat: fx.GraphModule, feeds: list[fx.Node], before: fx.Node, n_out: int):
    """Copy ``flat``'s ops into ``gm`` before ``before``, its placeholders read from ``feeds``;
    returns the nodes of its tangent outputs and the set of nodes made."""
    graph = gm.graph
    env = dict(zip([n for n in flat.graph.nodes if n.op == "placeholder"], feeds))
    where = before.meta.get("stack_trace")
    results: list = []
    made: set[fx.Node] = set()
    with graph.inserting_before(before):
        for n in flat.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                results = list(n.args[0])[n_out:]
                continue
            if n.op == "get_attr":
                env[n] = graph.get_attr(_attr_name(gm, getattr(flat, str(n.target)), str(n.target)))
                env[n].meta.update(n.meta)
                continue
            env[n] = graph.node_copy(n, env.__getitem__)
            if not env[n].meta.get("stack_trace"):
                env[n].meta["stack_trace"] = where
            made.add(env[n])
    out = [env[r] if isinstance(r, fx.Node) else r for r in results]
    if any(not isinstance(r, fx.Node) for r in out):
        raise FxtoolsError("internal error: a tangent of forward mode inside the program is not a value")
    return out, made


def _attr_name(gm: fx.GraphModule, value, name: str) -> str:
    """The name of ``value`` among ``gm``'s attributes, given one if it has none."""
    for key, v in list(gm.__dict__.get("_buffers", {}).items()) + list(gm.__dict__.get("_modules", {}).items()):
        if v is value:
            return key
    for key, v in vars(gm).items():
        if v is value:
            return key
    new, i = name, 0
    while hasattr(gm, new):
        i += 1
        new = f"{name}_{i}"
    setattr(gm, new, value)
    return new
