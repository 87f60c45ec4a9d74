"""Taylor mode: ``jet`` (univariate Taylor polynomials) and ``laplacian`` (collapsed Taylor mode).

How: the program is captured once (``vjp.prepare``: capture, functionalize, expand), ops without
a Taylor rule are replaced by PyTorch's decompositions, and one forward walk over the captured
graph replaces every op that depends on the differentiated argument by its Taylor rule
(``rules/taylor.py``). The walk runs under ``make_fx`` on FakeTensors, below torch.func (the
first-order terms of the Laplacian carry a leading dimension of ``D`` directions, and the rules
apply linear ops to it with ``torch.vmap``, traced as the batched ops), so what is recorded is
plain PyTorch. The result goes through the shared back end (``forward.finish``: pytree
signature, simplification, names, public spellings, guards).

Names: each value ``h`` of the program keeps its name; its terms are ``h_grad`` (the ``D``
first-order terms), ``h_lap`` (the summed second-order term) or ``h_d1 ... h_dK`` (the jet's
derivatives along the curve).

Collapsed Taylor mode (Dangel et al., 2025; the "forward Laplacian" of Li et al., 2023): the
Laplacian ``sum_i d^2 f / dx_i^2`` is the sum over the directions ``e_i`` of second derivatives
along them. Pushing the value, the ``D`` first-order terms and only their *summed* second-order
term through the program costs one forward pass whose first-order part is ``D`` wide, where the
trace of the Hessian costs ``D`` Hessian-vector products.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.functionalize import functionalize
from ..capture.nested import out_of_place_views
from ..errors import FxtoolsError, MissingRuleError, user_line_of
from ..graph import meta
from ..graph.nodes import ancestors, is_float
from ..registry import differentiable_nodes
from ..rules import taylor as rules
from .batching import trace_batched, vmappable
from .pipeline import Inputs, Transform, back, uses_pipeline
from .retrace import Namer, NodeNamer, Retracer, copy_constants
from .rows import rows_independent
from .vjp import argnums_tuple, prepare

aten = torch.ops.aten

__all__ = ["bilaplacian", "divergence", "jet", "laplacian"]

_DISTRIBUTIONS = ("rademacher", "normal")


def _prepare(f, args, argnums, made_by, several=False):
    """Capture ``f`` once; the indices of the differentiated placeholders (one tensor, or with
    ``several`` every tensor leaf of the arguments ``argnums`` names); rule-less ops decomposed."""
    if not several and not isinstance(argnums, int):
        raise ValueError(f"{made_by} differentiates one argument: argnums must be an int, got {argnums!r}")
    nums = argnums_tuple(argnums, len(args))
    for num in nums:
        for leaf in pytree.tree_leaves(args[num]):
            _check_real(leaf, num, made_by, several)
    cap, wrt = prepare(f, args, nums, made_by=made_by)
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    x_indices = [i for i, w in enumerate(wrt) if w]
    _decompose_ruleless(cap.gm, [placeholders[i] for i in x_indices], made_by)
    _name_value(cap.gm, f)
    return cap, x_indices


def _check_real(x, num, made_by, several):
    if isinstance(x, torch.Tensor) and x.is_complex():
        raise ValueError(
            f"{made_by} differentiates real inputs: args[{num}] is {x.dtype}; pass its real and "
            "imaginary parts (torch.view_as_real) as a real tensor"
        )
    if not is_float(x):
        what = "floating-point tensors (or pytrees of them)" if several else "a floating-point tensor"
        raise ValueError(
            f"{made_by} needs args[{num}] to be {what} (got {type(x).__name__}); "
            "pass the input of the differential operator there"
        )


def _name_value(gm: fx.GraphModule, f) -> None:
    """The function's value is named for what it is, ``u`` for ``def u(x)`` (``out`` for a lambda or a
    module), not ``loss`` as the capture names a scalar a gradient starts from; its parts with it."""
    name = getattr(f, "__name__", None)
    base = name if isinstance(name, str) and name.isidentifier() else "out"
    code = getattr(f, "__code__", None)
    if code is not None and "loss" in code.co_varnames:  # the user's own name
        return
    for node in gm.graph.nodes:
        if node.op == "call_function" and (node.name == "loss" or node.name.startswith("loss_")):
            node._rename(base + node.name[len("loss") :])


def _needed(gm: fx.GraphModule, x_nodes: list) -> set[fx.Node]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    reach = ancestors(list(output.args[0]))
    return {n for n in differentiable_nodes(gm, set(x_nodes)) if n in reach}


def _lacks_rule(node) -> bool:
    return node.op == "call_function" and node.target is not operator.getitem and not rules.has_rule(node.target)


def _decompose_ruleless(gm: fx.GraphModule, x_nodes: list, made_by: str) -> None:
    """Ops the Taylor terms reach that have no Taylor rule: PyTorch's decompositions, until none is left;
    an op with neither is refused, with the user's line."""
    left = rules.expand(gm, lambda: [n for n in _needed(gm, x_nodes) if _lacks_rule(n)])
    if left:
        node = left[0]
        raise MissingRuleError(
            f"{made_by}: no Taylor rule for {node.target} (called from {user_line_of(node) or 'an unknown line'}), "
            "and PyTorch gives no decomposition of it into ops with rules. Rewrite that line with "
            "elementary ops, or add a rule to fxtools/rules/taylor.py."
        )


def _run(node, args, kwargs, made_by):
    """One op on Taylor values, by its rule; a rule's refusal names the op and the user's line."""
    try:
        return rules.apply(node.target, args, kwargs, called=not meta.DECOMPOSED.get(node, False))
    except (NotImplementedError, KeyError) as exc:
        raise FxtoolsError(
            f"{made_by}: cannot push Taylor terms through {node.target} "
            f"(called from {user_line_of(node) or 'an unknown line'}): {exc}"
        ) from exc


def _name_terms(namer, value, name, weak):
    """``h``, and its terms ``h_grad``, ``h_lap`` (the forward Laplacian's) or ``h_d1 ... h_dK``."""
    if isinstance(value, (list, tuple)):
        return
    if isinstance(value, rules.Collapsed) and value.order == 2:
        namer(value.value, name, weak=weak)
        namer(value.grad, f"{name}_grad", weak=weak)
        namer(value.lap, f"{name}_lap", weak=weak)
    elif rules.is_taylor(value):
        for k, t in enumerate(value.terms):
            namer(t, name if k == 0 else f"{name}_d{k}", weak=weak)
    else:
        namer(value, name, weak=weak)


class _Walk(Retracer):
    """Taylor mode's template: the captured graph run once on Taylor values (``rules/taylor.py``),
    its ops that the differentiated inputs reach pushed through their Taylor rules, the others on
    plain values. ``seed(xs, *extras)`` makes the Taylor values of the differentiated inputs
    ``xs``; ``outputs_of(value, i)`` lists the terms returned for output ``i``."""

    verb = "push Taylor terms through"
    pre_dispatch = False

    def __init__(self, cap, x_indices, seed, outputs_of, made_by):
        super().__init__(cap.gm)
        self.x_indices, self.seed, self.outputs_of, self.made_by = x_indices, seed, outputs_of, made_by
        self.xs = [self.placeholders[i] for i in x_indices]
        self.need = _needed(cap.gm, self.xs)
        self.namer = Namer()

    def template(self, *flat):
        inputs, more = flat[: len(self.placeholders)], flat[len(self.placeholders) :]
        self.env = dict(zip(self.placeholders, inputs))
        with self.namer.owner(self.xs[0].name):
            seeded = self.seed([inputs[i] for i in self.x_indices], *more)
        for x, value in zip(self.xs, seeded):
            self.env[x] = value
            _name_terms(self.namer, value, x.name, False)
        self.run_nodes()
        results = [self.env[o] if isinstance(o, fx.Node) else o for o in self.out_nodes]
        terms = []
        for i, r in enumerate(results):
            terms += self.outputs_of(r, i)
        return (*[rules.value_of(r) for r in results], *terms)

    def call_function(self, node) -> None:  # (node.target: an op, not a method name)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.env.__getitem__)
        if node.target is torch._C._set_grad_enabled:
            return
        with self.namer.owner(node.name):
            if node.target is operator.getitem:
                self.env[node] = args[0][args[1]]
            elif node in self.need and any(map(rules.is_taylor, pytree.tree_leaves((args, kwargs), is_leaf=rules.is_taylor))):
                self.env[node] = _run(node, args, kwargs, self.made_by)
            else:
                self.env[node] = node.target(*rules.value_of(list(args)), **{k: rules.value_of(v) for k, v in kwargs.items()})
        _name_terms(self.namer, self.env[node], node.name, meta.INTERMEDIATE.on(node))


def _trace(cap, x_indices, seed, extras, extra_names, outputs_of, made_by):
    """The flat graph ``(captured inputs..., extras...) -> (outputs..., their terms...)``, traced
    from ``_Walk``'s template (see there for ``seed`` and ``outputs_of``)."""
    walk = _Walk(cap, x_indices, seed, outputs_of, made_by)
    gm = walk.trace(extras)
    names = [p.name for p in walk.placeholders] + list(extra_names)
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
        node._rename(name)
    copy_constants(cap.gm, gm)
    walk.namer.apply(gm.graph)
    out_of_place_views(gm)  # the batched ops' in-place squeeze_ (traced below torch.func)
    functionalize(gm)
    _fold_identity_products(gm)
    _fold_row_identity_products(gm)
    scale_the_smaller_factor(gm)
    products_as_written(gm)
    return gm


def _vector_matrix(node):
    """``(a, b)`` when ``node`` is ``squeeze(mm(unsqueeze(a, 0), b), 0)``: ``a @ b`` for a vector ``a``."""
    if node.target not in (aten.squeeze.dim, aten.squeeze.dims) or node.args[1] not in (0, [0]):
        return None
    mm = node.args[0]
    if not isinstance(mm, fx.Node) or mm.target is not aten.mm.default or len(mm.users) != 1:
        return None
    a = mm.args[0]
    if isinstance(a, fx.Node) and a.target is aten.unsqueeze.default and a.args[1] == 0 and a.args[0].meta["val"].dim() == 1:
        return a.args[0], mm.args[1]
    return None


def _product(node):
    return node.args if node.target in (aten.mm.default, aten.mv.default, aten.dot.default) else None


def products_as_written(gm: fx.GraphModule) -> None:
    """Products as the user writes them, ``x @ W1``: the decompositions of ``matmul`` that tracing
    below torch.func records (``unsqueeze``/``mm``/``squeeze`` for a vector-matrix product, ``mm``,
    ``mv``, ``dot``) become one ``matmul`` each, keeping their names."""
    for operands_of in (_vector_matrix, _product):
        for node in list(gm.graph.nodes):
            operands = operands_of(node)
            if operands is None:
                continue
            node.target, node.args, node.kwargs = aten.matmul.default, tuple(operands), {}
    gm.graph.eliminate_dead_code()
    gm.recompile()


_ORDER_KEEPING = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.clone.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
}


def _fold_identity_products(gm: fx.GraphModule) -> None:
    """``torch.mm(eye, w)`` -> ``w``: the first linear layer's first-order terms along the standard
    basis are its weight's rows, not a product with the identity (saves a ``D x D x width`` product)."""

    def is_eye(a, n):  # eye(n), reshaped by ops that keep the order of elements
        while isinstance(a, fx.Node) and a.target in _ORDER_KEEPING and a.meta["val"].numel() == n * n:
            a = a.args[0]
        return isinstance(a, fx.Node) and a.target is aten.eye.default and list(a.args) == [n]

    for node in list(gm.graph.nodes):
        if node.target is not aten.mm.default:
            continue
        a, b = node.args
        va, vb, out = a.meta.get("val"), b.meta.get("val"), node.meta.get("val")
        if va is None or vb is None or out is None or va.dtype != vb.dtype:
            continue
        if is_eye(a, vb.shape[0]) and out.shape == vb.shape:
            node.replace_all_uses_with(b)
        elif is_eye(b, va.shape[1]) and out.shape == va.shape:
            node.replace_all_uses_with(a)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _column_scaled(a):
    """``(a, s, c)`` when ``a``, seen through views to its shape, is ``s * c`` for a matrix ``c`` whose
    columns a vector ``s`` scales (each value of ``a`` read by its one user only)."""
    while isinstance(a, fx.Node) and a.target in _ORDER_KEEPING and len(a.users) == 1:
        a = a.args[0]
    if not (isinstance(a, fx.Node) and a.target is aten.mul.Tensor and len(a.users) == 1):
        return None
    x, y = a.args
    for s, c in ((x, y), (y, x)):
        vs, vc = getattr(s, "meta", {}).get("val"), getattr(c, "meta", {}).get("val")
        if vs is not None and vc is not None and vs.dim() == 1 and vc.dim() == 2 and vs.shape[0] == vc.shape[1] > 1:
            return (a, s, c) if vs.dtype == vc.dtype == a.meta["val"].dtype else None
    return None


def scale_the_smaller_factor(gm: fx.GraphModule) -> None:
    """``(s * c) @ m`` -> ``c @ (s[:, None] * m)`` when ``c`` (``D x K``, its columns scaled by ``s``)
    has more rows than ``m`` (``K x N``) has columns: the same product, scaling ``K * N`` numbers
    instead of ``D * K``. A pointwise op's first-order terms are its derivative times the input's,
    so with more directions than a layer's width the next layer's weight is scaled per point, not
    the ``D x width`` terms (batched, one ``width x width`` matrix per point instead of ``D x width``)."""
    for node in list(gm.graph.nodes):
        if node.target is not aten.mm.default:
            continue
        scaled, m = _column_scaled(node.args[0]), node.args[1]
        vm, out = getattr(m, "meta", {}).get("val"), node.meta.get("val")
        if scaled is None or vm is None or out is None or vm.dtype != out.dtype:
            continue
        terms, s, c = scaled
        if c.meta["val"].shape[0] <= vm.shape[1]:
            continue
        with gm.graph.inserting_before(node):
            column = gm.graph.call_function(aten.unsqueeze.default, (s, -1))
            column.meta["val"] = s.meta["val"].unsqueeze(-1)
            factor = gm.graph.call_function(aten.mul.Tensor, (column, m))
            factor.meta["val"] = column.meta["val"] * vm
        column._rename(f"{s.name}_column")
        factor._rename(f"{terms.name}_factor")
        node.args = (c, factor)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _same_shape_source(a):
    """``a`` without the views that keep its shape."""
    while isinstance(a, fx.Node) and a.target in (*_ORDER_KEEPING, aten.expand.default) and isinstance(a.args[0], fx.Node):
        src = a.args[0].meta.get("val")
        if src is None or a.meta.get("val") is None or tuple(src.shape) != tuple(a.meta["val"].shape):
            break
        a = a.args[0]
    return a


def _row_basis(a) -> int | None:
    """``n`` when ``a`` is ``eye(n)`` viewed as ``(n, 1, n)`` and expanded over the rows (``_row_directions``)."""
    a = _same_shape_source(a)
    if not (isinstance(a, fx.Node) and a.target is aten.expand.default):
        return None
    v = a.args[0]
    if not (isinstance(v, fx.Node) and v.target in _ORDER_KEEPING and isinstance(v.args[0], fx.Node)):
        return None
    eye = v.args[0]
    n = eye.args[0] if eye.target is aten.eye.default and len(eye.args) == 1 else None
    if not isinstance(n, int) or list(v.meta["val"].shape) != [n, 1, n]:
        return None
    return n


def _fold_row_identity_products(gm: fx.GraphModule) -> None:
    """``bmm(rows' basis, w.expand(n, n, k))`` -> ``w.view(n, 1, k).expand(n, B, k)``: the first
    layer's first-order terms along one row's basis are its weight's rows, in every row."""
    for node in list(gm.graph.nodes):
        if node.target is not aten.bmm.default:
            continue
        a, b = node.args[0], _same_shape_source(node.args[1])
        n = _row_basis(a)
        if n is None or not (isinstance(b, fx.Node) and b.target is aten.expand.default):
            continue
        w = b.args[0]
        if not isinstance(w, fx.Node):
            continue
        wv = getattr(gm, str(w.target)) if w.op == "get_attr" else w.meta.get("val")
        out = node.meta.get("val")
        if wv is None or out is None or wv.dim() != 2 or wv.shape[0] != n or wv.dtype != out.dtype:
            continue
        with gm.graph.inserting_before(node):
            rows = gm.graph.call_function(aten.view.default, (w, [n, 1, wv.shape[1]]))
            rows.meta["val"] = wv.view(n, 1, wv.shape[1])
            spread = gm.graph.call_function(aten.expand.default, (rows, list(out.shape)))
            spread.meta["val"] = rows.meta["val"].expand(*out.shape)
        name = node.name
        node._rename(f"{name}_product")
        rows._rename(f"{name}_rows")
        spread._rename(name)
        node.replace_all_uses_with(spread)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _zeros_for(value):
    return torch.zeros_like(value)


def _term_like(value, k, order, directions):
    """Zeros shaped as the ``k``-th term of ``value``'s jet: with a leading dimension of ``directions``
    below the highest term of a collapsed jet."""
    if directions is None or k == order:
        return torch.zeros_like(value)
    return torch.zeros((directions, *value.shape), dtype=value.dtype, device=value.device)


def _arg_of(cap, x_indices):
    """The argument each differentiated placeholder belongs to."""
    of_placeholder = [a for a, t in zip(cap.arg_of_leaf, cap.tensor_leaf) if t]
    return [of_placeholder[i] for i in x_indices]


def _x_example(cap, x_indices):
    return [leaf for leaf, t in zip(cap.leaves, cap.tensor_leaf) if t][x_indices[0]]


def _check_sigma(sigma, x, made_by):
    n = x.numel()
    if not isinstance(sigma, torch.Tensor) or sigma.dim() != 2 or sigma.shape[0] != n:
        got = tuple(sigma.shape) if isinstance(sigma, torch.Tensor) else type(sigma).__name__
        raise ValueError(
            f"{made_by}: sigma must be a 2-d tensor of shape ({n}, R), one row per element of the input "
            f"(C = sigma @ sigma.T weights the second derivatives), got {got}"
        )
    if sigma.dtype != x.dtype:
        raise ValueError(f"{made_by}: sigma has dtype {sigma.dtype}, the input {x.dtype}: pass sigma.to({x.dtype})")


LAPLACIAN = Transform("fxtools.laplacian")


@uses_pipeline(LAPLACIAN)
def laplacian(f, *args, argnums=0, sigma=None, samples=None, distribution="rademacher") -> fx.GraphModule:
    """The Laplacian of ``f`` with respect to ``args[argnums]``, by collapsed Taylor mode, as code.

    Returns a GraphModule with ``out, lap = gm(*args)``: ``out`` is ``f(*args)`` and ``lap`` has its
    structure, holding ``sum_i d^2 out / dx_i^2`` (``x = args[argnums]``, ``i`` over all its
    elements) for every element of every floating-point output. One forward pass carries each
    value ``h``, its first-order terms along the ``D = x.numel()`` directions (``h_grad``, shape
    ``(D, *h.shape)``) and the sum of its second-order terms (``h_lap``).

    ``sigma``: a ``(D, R)`` tensor; then ``gm(*args, sigma)`` computes the weighted operator
    ``sum_ij C_ij d^2 out / dx_i dx_j`` with ``C = sigma @ sigma.T`` (the directions are sigma's
    columns), for any ``sigma`` of that shape at call time.

    ``samples=S``: Hutchinson's estimate ``mean_s v_s^T H v_s`` with ``S`` random directions drawn
    at each call from PyTorch's generator (seed it with ``torch.manual_seed``), ``distribution``
    ``"rademacher"`` (entries +-1) or ``"normal"``. Unbiased; exact only as ``S`` grows. With
    ``sigma`` too, the directions are ``sigma @ v_s`` (``v_s`` of size ``R``): the weighted
    operator's estimate.
    """
    made_by = LAPLACIAN
    if not isinstance(args, tuple):
        args = tuple(args)
    _check_samples(samples, distribution, made_by)
    cap, x_indices = _prepare(f, args, argnums, made_by)
    if sigma is not None:
        _check_sigma(sigma, _x_example(cap, x_indices), made_by)

    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    by_rows = sigma is None and samples is None and rows_independent(cap.gm, placeholders[x_indices[0]])
    per_point = _per_row_laplacian(f, args, argnums, cap, made_by) if by_rows else None
    if per_point is not None:
        return per_point
    return _laplacian_of(cap, x_indices, args, sigma, samples, distribution, by_rows, made_by)


def _laplacian_of(cap, x_indices, args, sigma, samples, distribution, by_rows, made_by):
    """The forward Laplacian of a captured program: its directions those of ``x`` (the basis, sigma's
    columns or random draws) or with ``by_rows`` one row's basis in every row."""
    extras = [sigma] if sigma is not None else []

    def seed(xs, *more):
        directions = _row_directions(xs[0]) if by_rows else _directions(xs[0], more, samples, distribution)
        return [rules.Collapsed([xs[0], directions, None])]

    def outputs_of(r, i):
        if isinstance(r, rules.Collapsed):
            lap = r.lap if r.lap is not None else _zeros_for(r.value)
            return [lap / samples if samples else lap]
        v = rules.value_of(r)
        return [_zeros_for(v)] if is_float(v) else []

    flat = _trace(cap, x_indices, seed, extras, ["sigma"] * len(extras), outputs_of, made_by)
    laps = [i for i, o in enumerate(cap.out_leaves) if is_float(o)]
    n_out = len(cap.out_leaves)

    def build(flat_results):
        it = iter(flat_results[n_out:])
        lap = [next(it) if i in laps else None for i in range(n_out)]
        return pytree.tree_unflatten(flat_results[:n_out], cap.out_spec), pytree.tree_unflatten(lap, cap.out_spec)

    extra_args = [("sigma", sigma)] if sigma is not None else []
    roles = {len(args): lambda path: "the factor sigma of the weights C = sigma @ sigma.T"} if sigma is not None else None
    gm = back(flat, cap, build, made_by, Inputs(args, extra=extra_args, roles=roles), collapse_views=True)
    meta.OUT_EXAMPLE.set(gm, pytree.tree_unflatten(list(cap.out_leaves), cap.out_spec))
    return gm


def _per_row_laplacian(f, args, argnums, cap, made_by):
    """For ``f`` whose output rows depend on their own input rows only: ``fxtools.vmap`` over the rows
    of the Laplacian of ``f`` on one row (the cost of the vmapped per-point module). ``None`` when
    ``f`` on one row is not the same program (other ops or arguments, other output shapes; the
    leading size of a view may be the batch's), or fails:
    then the caller pushes one row's directions through all rows instead (as exact, slower)."""
    outs = cap.out_leaves
    batch = args[argnums].shape[0]
    if not all(is_float(o) and o.dim() >= 1 and o.shape[0] == batch for o in outs):
        return None

    @functools.wraps(f)
    def row(*given):
        a = list(given)
        a[argnums] = a[argnums].unsqueeze(0)
        return pytree.tree_map(lambda o: o.squeeze(0) if isinstance(o, torch.Tensor) else o, f(*a))

    row_args = tuple(a[0] if i == argnums else a for i, a in enumerate(args))
    try:
        row_cap, row_x = _prepare(row, row_args, argnums, made_by)
    except Exception:  # noqa: BLE001 - f refuses one row: the route over all rows stays
        return None
    same_outputs = [tuple(o.shape) for o in row_cap.out_leaves] == [tuple(o.shape[1:]) for o in outs]
    if not same_outputs or not _same(_program(row_cap.gm, 1, row=True), _program(cap.gm, batch)):
        return None
    for node in next(n for n in row_cap.gm.graph.nodes if n.op == "output").args[0]:
        if isinstance(node, fx.Node) and node.target is aten.squeeze.dim:  # the row's value keeps its name
            value = cast(fx.Node, node.args[0])
            name = value.name
            value._rename(f"{name}_row")
            node._rename(name)
    per_point = _laplacian_of(row_cap, row_x, row_args, None, None, "rademacher", False, made_by)
    namer = NodeNamer(vmappable(per_point), per_point.guards)  # as fxtools.vmap, its errors naming laplacian
    batched = torch.func.vmap(namer, in_dims=tuple(0 if i == argnums else None for i in range(len(args))))
    gm = trace_batched(batched, args, names_of=per_point, namer=namer, made_by=made_by)
    meta.OUT_EXAMPLE.set(gm, pytree.tree_unflatten(list(outs), cap.out_spec))
    return gm


_SHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


def _program(gm: fx.GraphModule, batch: int, row: bool = False) -> list:
    """The ops of a captured program in order with their arguments (nodes by position, constants by
    value, the leading size of a view or expand as ``"batch"`` where it is ``batch``); for the
    one-row version (``row``) without the ``unsqueeze`` of the input and the ``squeeze`` of the outputs."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    index: dict = {}
    ops: list = []
    for n in gm.graph.nodes:
        if n is output:
            break
        if row and n.target is aten.unsqueeze.default and n.args[0].op == "placeholder":
            index[n] = index[n.args[0]]
            continue
        if row and n.target is aten.squeeze.dim and list(n.users) == [output]:
            continue
        index[n] = len(ops)
        if n.op == "get_attr":
            ops.append(("get_attr", getattr(gm, str(n.target))))
        elif n.op != "call_function":
            ops.append((n.op,))
        else:
            args = fx.node.map_arg(n.args, lambda a: ("node", index.get(a)))
            if n.target in _SHAPE_OPS and len(args) > 1 and list(args[1])[:1] == [batch]:
                args = (args[0], ["batch", *list(args[1])[1:]], *args[2:])
            ops.append((n.target, args, fx.node.map_arg(n.kwargs, lambda a: ("node", index.get(a)))))
    outs = fx.node.map_arg(output.args, lambda a: ("node", index.get(a.args[0] if row else a)))
    return [*ops, ("output", outs)]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _check_samples(samples, distribution, made_by):
    if samples is not None and (not isinstance(samples, int) or samples < 1):
        raise ValueError(f"{made_by}: samples must be a positive int, got {samples!r}")
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(f"{made_by}: distribution must be one of {_DISTRIBUTIONS}, got {distribution!r}")


DIVERGENCE = Transform("fxtools.divergence")


@uses_pipeline(DIVERGENCE)
def divergence(f, *args, argnums=0, samples=None, distribution="rademacher") -> fx.GraphModule:
    """The divergence ``sum_i d out_i / d x_i`` of a vector field ``out = f(*args)`` with respect to
    ``x = args[argnums]`` (``out`` has as many elements as ``x``), as code: ``out, div = gm(*args)``.

    One forward pass carries the first-order terms of the ``D = x.numel()`` directions (forward
    mode), and the divergence is the trace of the Jacobian they form; continuous normalizing flows
    and score matching need it. ``samples=S``: Hutchinson's estimate ``mean_s v_s^T J v_s`` with ``S``
    random directions drawn at each call (``distribution`` ``"rademacher"`` or ``"normal"``).
    """
    made_by = DIVERGENCE
    args = tuple(args)
    _check_samples(samples, distribution, made_by)
    cap, x_indices = _prepare(f, args, argnums, made_by)
    x = _x_example(cap, x_indices)
    outs = cap.out_leaves
    if len(outs) != 1 or not is_float(outs[0]) or outs[0].numel() != x.numel():
        got = [tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__ for o in outs]
        raise ValueError(
            f"{made_by}: f must return one floating-point tensor with as many elements as the input "
            f"({x.numel()}, a vector field), got {got}"
        )
    seeds: list = []

    def seed(xs):
        seeds.append(_directions(xs[0], (), samples, distribution))
        return [rules.Collapsed([xs[0], seeds[-1], None])]

    def outputs_of(r, i):
        if not isinstance(r, rules.Collapsed) or r.grad is None:
            return [_zeros_for(rules.value_of(r)).sum()]
        n = r.value.numel()
        if samples:  # mean_s v_s . (J v_s)
            return [torch.sum(seeds[0].reshape(samples, n) * r.grad.reshape(samples, n)) / samples]
        return [torch.diagonal(r.grad.reshape(n, n)).sum()]  # the Jacobian's trace

    flat = _trace(cap, x_indices, seed, [], [], outputs_of, made_by)
    value, div = next(n for n in flat.graph.nodes if n.op == "output").args[0]
    if isinstance(value, fx.Node) and isinstance(div, fx.Node):
        div._rename(f"{value.name}_div")

    def build(flat_results):
        return pytree.tree_unflatten(flat_results[:1], cap.out_spec), flat_results[1]

    gm = back(flat, cap, build, made_by, Inputs(args), collapse_views=True)
    meta.OUT_EXAMPLE.set(gm, pytree.tree_unflatten(list(outs), cap.out_spec))
    return gm


BILAPLACIAN = Transform("fxtools.bilaplacian")


@uses_pipeline(BILAPLACIAN)
def bilaplacian(f, *args, argnums=0, samples=None, distribution="rademacher") -> fx.GraphModule:
    """The bi-Laplacian ``sum_ij d^4 out / dx_i^2 dx_j^2`` of ``f`` with respect to ``args[argnums]``,
    as code: ``out, bilap = gm(*args)``.

    Collapsed Taylor mode twice: the Laplacian of the Laplacian's module (``fxtools.laplacian``),
    so the code is the forward Laplacian of the forward Laplacian, each with ``D`` first-order
    terms and one summed second-order term per value. ``samples=S``: both Laplacians are
    Hutchinson's estimates with ``S`` random directions each, drawn independently at each call
    (``distribution`` as ``fxtools.laplacian``'s): unbiased, as the outer estimate is unbiased for
    the Laplacian of each inner estimate, and the inner one for the Laplacian.
    """
    made_by = BILAPLACIAN
    args = tuple(args)
    _check_samples(samples, distribution, made_by)
    inner = laplacian(f, *args, argnums=argnums, samples=samples, distribution=distribution)
    cap, x_indices = _prepare(inner, args, argnums, made_by)
    n_out = len(cap.out_leaves) // 2  # inner returns (out, lap), each with f's structure

    def seed(xs):
        return [rules.Collapsed([xs[0], _directions(xs[0], (), samples, distribution), None])]

    def outputs_of(r, i):
        if i < n_out:
            return []
        if isinstance(r, rules.Collapsed):
            lap = r.lap if r.lap is not None else _zeros_for(r.value)
            return [lap / samples if samples else lap]
        v = rules.value_of(r)
        return [_zeros_for(v)] if is_float(v) else []

    flat = _trace(cap, x_indices, seed, [], [], outputs_of, made_by)
    out_spec = cap.out_spec.child(0)
    floats = [is_float(o) for o in cap.out_leaves[n_out:]]

    def build(flat_results):
        it = iter(flat_results[2 * n_out :])
        bilap = [next(it) if fl else None for fl in floats]
        return pytree.tree_unflatten(flat_results[:n_out], out_spec), pytree.tree_unflatten(bilap, out_spec)

    gm = back(flat, cap, build, made_by, Inputs(args), collapse_views=True)
    meta.OUT_EXAMPLE.set(gm, pytree.tree_unflatten(list(cap.out_leaves[:n_out]), out_spec))
    return gm


def _directions(x, more, samples, distribution):
    """The first-order terms of the input: the standard basis, sigma's columns, random draws, or
    sigma times random draws (``samples`` with ``sigma``: ``E[sigma v v^T sigma^T] = C``)."""
    shape = tuple(x.shape)
    if more:
        sigma = more[0]
        columns = sigma.t().clone(memory_format=torch.contiguous_format)  # sigma of any layout
        if samples:
            return (_draw((samples, sigma.shape[1]), x, distribution) @ columns).view(samples, *shape)
        return columns.view(sigma.shape[1], *shape)
    if samples:
        return _draw((samples, *shape), x, distribution)
    n = math.prod(shape)
    return torch.eye(n, dtype=x.dtype, device=x.device).reshape(n, *shape)


def _row_directions(x):
    """The standard basis of one row, in every row at once: ``x``'s rows are independent points
    (``rows.rows_independent``), so each output row sees the directions of its own input row only."""
    n = math.prod(x.shape[1:])
    basis = torch.eye(n, dtype=x.dtype, device=x.device).reshape(n, 1, *x.shape[1:])
    return basis.expand(n, *x.shape)


def _draw(shape, x, distribution):
    """Random directions of zero mean and identity covariance, from PyTorch's generator."""
    if distribution == "normal":
        return torch.randn(shape, dtype=x.dtype, device=x.device)
    bits = torch.randint(0, 2, shape, device=x.device)
    return (2 * bits - 1).to(x.dtype)


JET = Transform("fxtools.jet")


@uses_pipeline(JET)
def jet(f, *args, order, argnums=0, directions=None) -> fx.GraphModule:
    """Taylor mode along a curve: the derivatives of ``f(x(t))`` at ``t = 0``, as code.

    ``x(t) = x + sum_k series[k-1] t^k / k!`` with ``x = args[argnums]``. Returns a GraphModule with
    ``out, out_series = gm(*args, series)``: ``series`` is a tuple of ``order`` terms, each shaped as
    ``x`` (the curve's derivatives), ``out`` is ``f(*args)`` and ``out_series`` has ``out``'s
    structure with, at each floating-point leaf, the tuple of ``d^k/dt^k f(x(t))``, ``k = 1..order``.
    As ``jax.experimental.jet.jet(f, (x,), (series,))``. With ``series = (v, 0, ...)`` the terms are
    the directional derivatives ``d^k f(x + t v) / dt^k``.

    ``x`` may be a pytree of tensors (each term of ``series`` then has its structure), and
    ``argnums`` a tuple: the curve moves all those arguments, each term of ``series`` is a tuple
    with one entry per argument. ``order=0`` gives ``f(*args)`` and empty tuples.

    ``directions=R``: the *collapsed* jet (Dangel et al., 2025) of ``R`` curves at once, summed in
    their highest term: ``series[k-1]`` for ``k < order`` has a leading dimension of ``R`` (the
    ``k``-th derivative of each curve), ``series[order-1]`` has ``x``'s shape (the sum over the
    curves of their ``order``-th derivative), and so have the returned terms. The highest term
    enters every rule linearly, so its sum is propagated instead of ``R`` of them: with
    ``order=2``, the basis as the first terms and a zero second term this is the forward Laplacian.
    """
    made_by = JET
    if not isinstance(args, tuple):
        args = tuple(args)
    if not isinstance(order, int) or isinstance(order, bool) or order < 0:
        raise ValueError(f"{made_by}: order must be a non-negative int, got {order!r}")
    if directions is not None and (not isinstance(directions, int) or isinstance(directions, bool) or directions < 1):
        raise ValueError(f"{made_by}: directions must be a positive int (the number of curves), got {directions!r}")
    cap, x_indices = _prepare(f, args, argnums, made_by, several=True)
    nums = argnums_tuple(argnums, len(args))
    moving = args[argnums] if isinstance(argnums, int) else tuple(args[n] for n in nums)
    series_example = tuple(pytree.tree_map(lambda a: _term_like(a, k, order, directions), moving) for k in range(1, order + 1))
    width = len(pytree.tree_leaves(moving))
    arg_of = _arg_of(cap, x_indices)
    order_of = [p for n in nums for p, a in enumerate(arg_of) if a == n]  # series leaf j -> its input

    def seed(xs, *more):
        terms = [[xv] for xv in xs]
        for k in range(order):
            for j, p in enumerate(order_of):
                terms[p].append(more[k * width + j])
        kind = rules.Jet if directions is None else rules.Collapsed
        return [rules.constant_if_zero(kind(t)) for t in terms]  # order 0: plain values

    def outputs_of(r, i):
        v = rules.value_of(r)
        if not rules.is_taylor(r) and not is_float(v):
            return []
        terms = r.terms[1:] if rules.is_taylor(r) else [None] * order
        return [t if t is not None else _term_like(v, k, order, directions) for k, t in enumerate(terms, 1)]

    series_names = [f"series_{k}" if width == 1 else f"series_{k}_{j}" for k in range(order) for j in range(width)]
    flat = _trace(cap, x_indices, seed, pytree.tree_leaves(series_example), series_names, outputs_of, made_by)
    n_out = len(cap.out_leaves)
    floats = [is_float(o) for o in cap.out_leaves]

    def build(flat_results):
        it = iter(flat_results[n_out:])
        series = [tuple(next(it) for _ in range(order)) if fl else None for fl in floats]
        return pytree.tree_unflatten(flat_results[:n_out], cap.out_spec), pytree.tree_unflatten(series, cap.out_spec)

    names = cap.arg_names
    moved = ", ".join(names[n] for n in nums)
    role = {len(args): lambda path: f"the series (the curve's {order} derivatives) of {moved}"}
    gm = back(flat, cap, build, made_by, Inputs(args, extra=[("series", series_example)], roles=role), collapse_views=True)
    meta.OUT_EXAMPLE.set(gm, pytree.tree_unflatten(list(cap.out_leaves), cap.out_spec))
    return gm
