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

import math
import operator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.functionalize import functionalize
from ..capture.nested import out_of_place_views
from ..capture.trace import trace_flat
from ..errors import FxtoolsError, MissingRuleError, user_line_of
from ..graph import meta
from ..graph.nodes import ancestors, is_float
from ..registry import differentiable_nodes
from ..rules import taylor as rules
from .pipeline import back, uses_pipeline
from .retrace import Namer, copy_constants, example_mode, fake_example
from .vjp import argnums_tuple, prepare

aten = torch.ops.aten

__all__ = ["jet", "laplacian"]

_DISTRIBUTIONS = ("rademacher", "normal")


def _prepare(f, args, argnums, made_by):
    """Capture ``f`` once; the index of the differentiated placeholder; the nodes Taylor terms reach."""
    if not isinstance(argnums, int):
        raise ValueError(f"{made_by} differentiates one argument: argnums must be an int, got {argnums!r}")
    num = argnums_tuple(argnums, len(args))[0]
    x = args[num]
    if not is_float(x):
        raise ValueError(
            f"{made_by} needs args[{num}] to be a floating-point tensor (got {type(x).__name__}); "
            "pass the input of the differential operator there, as one tensor"
        )
    cap, wrt = prepare(f, args, (num,), made_by=made_by)
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    x_index = wrt.index(True)
    _decompose_ruleless(cap.gm, placeholders[x_index], made_by)
    return cap, x_index


def _needed(gm: fx.GraphModule, x_node: fx.Node) -> set[fx.Node]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    reach = ancestors(list(output.args[0]))
    return {n for n in differentiable_nodes(gm, {x_node}) if n in reach}


def _lacks_rule(node) -> bool:
    return node.op == "call_function" and node.target is not operator.getitem and not rules.has_rule(node.target)


def _decompose_ruleless(gm: fx.GraphModule, x_node: fx.Node, made_by: str) -> None:
    """Ops the Taylor terms reach that have no Taylor rule: PyTorch's decompositions, until none is left;
    an op with neither is refused, with the user's line."""
    left = rules.expand(gm, lambda: [n for n in _needed(gm, x_node) if _lacks_rule(n)])
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
        return rules.apply(node.target, args, kwargs)
    except (NotImplementedError, KeyError) as exc:
        raise FxtoolsError(
            f"{made_by}: cannot push Taylor terms through {node.target} "
            f"(called from {user_line_of(node) or 'an unknown line'}): {exc}"
        ) from exc


def _name_terms(namer, value, name, weak):
    """``h``, and its terms ``h_grad``, ``h_lap`` or ``h_d1 ... h_dK``."""
    if isinstance(value, (list, tuple)):
        return
    if isinstance(value, rules.Collapsed):
        namer(value.value, name, weak=weak)
        namer(value.grad, f"{name}_grad", weak=weak)
        namer(value.lap, f"{name}_lap", weak=weak)
    elif isinstance(value, rules.Jet):
        for k, t in enumerate(value.terms):
            namer(t, name if k == 0 else f"{name}_d{k}", weak=weak)
    else:
        namer(value, name, weak=weak)


def _trace(cap, x_index, seed, extras, extra_names, outputs_of, made_by):
    """The flat graph ``(captured inputs..., extras...) -> (outputs..., their terms...)``.

    ``seed(x, *extras)`` makes the differentiated input's Taylor value; ``outputs_of(value, i)``
    lists the terms returned for output ``i``.
    """
    graph = cap.gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    out_nodes = list(next(n for n in graph.nodes if n.op == "output").args[0])
    need = _needed(cap.gm, placeholders[x_index])
    namer = Namer()

    def template(*flat):
        inputs, more = flat[: len(placeholders)], flat[len(placeholders) :]
        env: dict = dict(zip(placeholders, inputs))
        with namer.owner(placeholders[x_index].name):
            env[placeholders[x_index]] = seed(inputs[x_index], *more)
        _name_terms(namer, env[placeholders[x_index]], placeholders[x_index].name, False)
        for node in graph.nodes:
            if node.op == "get_attr":
                env[node] = getattr(cap.gm, node.target)
            elif node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                if node.target is torch._C._set_grad_enabled:
                    continue
                with namer.owner(node.name):
                    if node.target is operator.getitem:
                        env[node] = args[0][args[1]]
                    elif node in need:
                        env[node] = _run(node, args, kwargs, made_by)
                    else:
                        env[node] = node.target(*rules.value_of(list(args)), **{k: rules.value_of(v) for k, v in kwargs.items()})
                _name_terms(namer, env[node], node.name, meta.INTERMEDIATE.on(node))
        results = [env[o] if isinstance(o, fx.Node) else o for o in out_nodes]
        terms = []
        for i, r in enumerate(results):
            terms += outputs_of(r, i)
        return (*[rules.value_of(r) for r in results], *terms)

    mode = example_mode([p.meta["val"] for p in placeholders])
    examples = [fake_example(p.meta["val"], mode, keep_strides=True) for p in placeholders]
    more = [fake_example(v, mode) for v in extras]
    gm = trace_flat(template, [*examples, *more], record_stack_traces=False, pre_dispatch=False)
    names = [p.name for p in placeholders] + list(extra_names)
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
        node._rename(name)
    copy_constants(cap.gm, gm)
    namer.apply(gm.graph)
    out_of_place_views(gm)  # the batched ops' in-place squeeze_ (traced below torch.func)
    functionalize(gm)
    _fold_identity_products(gm)
    return gm


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


def _zeros_for(value):
    return torch.zeros_like(value)


def _x_example(cap, x_index):
    return [leaf for leaf, t in zip(cap.leaves, cap.tensor_leaf) if t][x_index]


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


@uses_pipeline(
    "fxtools.laplacian",
    requires="front: a prepared graph; ops the directions reach have Taylor rules or decompositions",
    ensures="gm(*args[, sigma]) -> (out, laplacian), laplacian nested as out",
)
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
    ``"rademacher"`` (entries +-1) or ``"normal"``. Unbiased; exact only as ``S`` grows.
    """
    made_by = "fxtools.laplacian"
    if not isinstance(args, tuple):
        args = tuple(args)
    if sigma is not None and samples is not None:
        raise ValueError(f"{made_by}: pass sigma or samples, not both")
    if samples is not None and (not isinstance(samples, int) or samples < 1):
        raise ValueError(f"{made_by}: samples must be a positive int, got {samples!r}")
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(f"{made_by}: distribution must be one of {_DISTRIBUTIONS}, got {distribution!r}")
    cap, x_index = _prepare(f, args, argnums, made_by)
    x = _x_example(cap, x_index)
    extras = []
    if sigma is not None:
        _check_sigma(sigma, x, made_by)
        extras = [sigma]

    def seed(xv, *more):
        return rules.Collapsed(xv, _directions(xv, more, samples, distribution), None)

    def outputs_of(r, i):
        if isinstance(r, rules.Collapsed):
            lap = r.lap if r.lap is not None else _zeros_for(r.value)
            return [lap / samples if samples else lap]
        v = rules.value_of(r)
        return [_zeros_for(v)] if is_float(v) else []

    flat = _trace(cap, x_index, seed, extras, ["sigma"] * len(extras), outputs_of, made_by)
    laps = [i for i, o in enumerate(cap.out_leaves) if is_float(o)]
    n_out = len(cap.out_leaves)

    def build(flat_results):
        it = iter(flat_results[n_out:])
        lap = [next(it) if i in laps else None for i in range(n_out)]
        return pytree.tree_unflatten(flat_results[:n_out], cap.out_spec), pytree.tree_unflatten(lap, cap.out_spec)

    extra_args = [("sigma", sigma)] if sigma is not None else []
    roles = {len(args): lambda path: "the factor sigma of the weights C = sigma @ sigma.T"} if sigma is not None else None
    gm = back(flat, cap, build, made_by=made_by, args=args, extra_args=extra_args, roles=roles, collapse_views=True)
    meta.OUT_EXAMPLE.set(gm, pytree.tree_unflatten(list(cap.out_leaves), cap.out_spec))
    return gm


def _directions(x, more, samples, distribution):
    """The first-order terms of the input: the standard basis, sigma's columns, or random draws."""
    shape = tuple(x.shape)
    if more:
        sigma = more[0]
        return sigma.t().reshape(sigma.shape[1], *shape)
    if samples:
        if distribution == "normal":
            return torch.randn((samples, *shape), dtype=x.dtype, device=x.device)
        bits = torch.randint(0, 2, (samples, *shape), device=x.device)
        return (2 * bits - 1).to(x.dtype)
    n = math.prod(shape)
    return torch.eye(n, dtype=x.dtype, device=x.device).reshape(n, *shape)


@uses_pipeline(
    "fxtools.jet",
    requires="front: a prepared graph; ops the series reaches have Taylor rules or decompositions",
    ensures="gm(*args, series) -> (out, out_series), out_series nested as out",
)
def jet(f, *args, order, argnums=0) -> fx.GraphModule:
    """Taylor mode along a curve: the derivatives of ``f(x(t))`` at ``t = 0``, as code.

    ``x(t) = x + sum_k series[k-1] t^k / k!`` with ``x = args[argnums]``. Returns a GraphModule with
    ``out, out_series = gm(*args, series)``: ``series`` is a tuple of ``order`` tensors shaped as
    ``x`` (the curve's derivatives), ``out`` is ``f(*args)`` and ``out_series`` has ``out``'s
    structure with, at each floating-point leaf, the tuple of ``d^k/dt^k f(x(t))``, ``k = 1..order``.
    As ``jax.experimental.jet.jet(f, (x,), (series,))``. With ``series = (v, 0, ...)`` the terms are
    the directional derivatives ``d^k f(x + t v) / dt^k``.
    """
    made_by = "fxtools.jet"
    if not isinstance(args, tuple):
        args = tuple(args)
    if not isinstance(order, int) or order < 1:
        raise ValueError(f"{made_by}: order must be a positive int, got {order!r}")
    cap, x_index = _prepare(f, args, argnums, made_by)
    x = _x_example(cap, x_index)
    series_example = tuple(torch.zeros_like(x) for _ in range(order))

    def seed(xv, *more):
        return rules.Jet([xv, *more])

    def outputs_of(r, i):
        if isinstance(r, rules.Jet):
            return [t if t is not None else _zeros_for(r.value) for t in r.terms[1:]]
        v = rules.value_of(r)
        return [_zeros_for(v) for _ in range(order)] if is_float(v) else []

    flat = _trace(cap, x_index, seed, list(series_example), [f"series_{k}" for k in range(order)], outputs_of, made_by)
    n_out = len(cap.out_leaves)
    floats = [is_float(o) for o in cap.out_leaves]

    def build(flat_results):
        it = iter(flat_results[n_out:])
        series = [tuple(next(it) for _ in range(order)) if fl else None for fl in floats]
        return pytree.tree_unflatten(flat_results[:n_out], cap.out_spec), pytree.tree_unflatten(series, cap.out_spec)

    names = cap.arg_names
    role = {len(args): lambda path: f"the series (the curve's {order} derivatives) of {names[argnums]}"}
    gm = back(
        flat, cap, build, made_by=made_by, args=args, extra_args=[("series", series_example)], roles=role, collapse_views=True
    )
    meta.OUT_EXAMPLE.set(gm, pytree.tree_unflatten(list(cap.out_leaves), cap.out_spec))
    return gm
