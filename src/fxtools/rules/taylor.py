"""Taylor rules: how each op pushes a truncated Taylor expansion forward.

A value carried through Taylor mode is one of two kinds:

- ``Jet``: a univariate Taylor polynomial, ``terms[k] = d^k/dt^k x(t)`` at ``t = 0`` (the
  derivative convention of ``jax.experimental.jet``); ``terms[0]`` is the value.
- ``Collapsed``: a collapsed jet of order ``K`` (Dangel et al., 2025): ``terms[0]`` the value,
  ``terms[1..K-1]`` the lower terms of ``R`` directions each (stacked in a leading dimension of
  size ``R``) and ``terms[K]`` the highest term *summed* over the directions (it enters every rule
  linearly, so the sum is propagated instead of each direction's). ``K = 2`` is the forward
  Laplacian: ``grad`` (the first-order terms of the ``D`` directions) and ``lap``.

``None`` stands for a term known to be zero: no code is written for it.

The rules are data, one table entry per op family, as JAX's jet rules:

- linear ops (views, reductions, copies) apply to every term;
- affine ops of several arguments (``cat``, ``where``) apply to every term, a constant argument
  contributing to the value only;
- bilinear ops (``mul``, ``mm``, ``linear``, ``conv``) follow Leibniz's rule;
- pointwise functions give their derivative tower ``f'(x), f''(x), ...`` and Faà di Bruno's
  formula composes it with the argument's terms (the collapsed second-order term is
  ``f'(x) * lap + f''(x) * sum_d grad_d**2``);
- piecewise-linear ops (``relu``, ``abs``, ``clamp``, ``max``) select terms as they select values;
- a few composites (``softmax``, ``logsumexp``) are written with the rules of their parts.

Rules are called with the op, its arguments (Taylor values or plain ones) and keyword arguments;
they run while fxtools traces, so their torch calls are the generated code. An op with no rule
is decomposed by PyTorch's decompositions (``transforms/taylor.py``) or refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.decompose import decompositions, inline_decomposition
from .nn import dropout_fwd, feature_dropout_fwd

aten = torch.ops.aten

__all__ = ["Jet", "Collapsed", "is_taylor", "value_of", "constant_if_zero", "apply", "lookup", "has_rule", "expand", "RULES"]


class _Terms:
    """A value and its Taylor terms (``None``: known zero): what ``Jet`` and ``Collapsed`` share."""

    def __init__(self, terms):
        self.terms = list(terms)

    @property
    def value(self):
        return self.terms[0]

    @property
    def order(self) -> int:
        return len(self.terms) - 1


class Jet(_Terms):
    """``x(t) = sum_k terms[k] t^k / k!``: the value and its first ``order`` derivatives along a curve."""

    def map(self, fn):
        """A linear ``fn`` applied to every term."""
        return Jet([None if t is None else fn(t) for t in self.terms])


class Collapsed(_Terms):
    """A collapsed jet: the value, the lower terms of ``R`` directions (leading dimension ``R``) and
    the highest term summed over them; ``Collapsed([value, grad, lap])`` is the forward Laplacian's."""

    @property
    def grad(self):
        """The first-order terms of the directions (``None`` when known zero)."""
        return self.terms[1] if self.order > 1 else None

    @property
    def lap(self):
        """The highest term, summed over the directions."""
        return self.terms[-1] if self.order > 0 else None

    def map(self, fn):
        """A linear ``fn`` applied to every term (to each direction of the lower ones)."""
        return Collapsed(_collapsed_terms(self, fn(self.value), fn))


def _collapsed_terms(x, value, fn):
    """``value`` and the linear ``fn`` of each term of the collapsed jet ``x`` (of each direction of
    the lower ones), ``None`` kept."""
    vfn = torch.vmap(fn)
    return [value, *(_none_or(fn if k == x.order else vfn, t) for k, t in enumerate(x.terms[1:], 1))]


def _none_or(fn, t):
    return None if t is None else fn(t)


def is_taylor(x) -> bool:
    return isinstance(x, (Jet, Collapsed))


def constant_if_zero(x):
    """A Taylor value all of whose terms are known zero, as its plain value (``x ** 0``): a constant."""
    if isinstance(x, (list, tuple)):
        return type(x)(constant_if_zero(v) for v in x)
    if isinstance(x, Jet) and all(t is None for t in x.terms[1:]):
        return x.value
    if isinstance(x, Collapsed) and all(t is None for t in x.terms[1:]):
        return x.value
    return x


def value_of(x):
    """The plain value of a Taylor value; anything else unchanged (also inside lists)."""
    if isinstance(x, (list, tuple)):
        return type(x)(value_of(v) for v in x)
    return x.value if is_taylor(x) else x


def _zero(x):
    """A zero standing in for ``x``'s terms (a constant's, or a known-zero one)."""
    v = value_of(x)
    return torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0


def _add(a, b):
    if a is None:
        return b
    return a if b is None else a + b


def _scale(c, t):
    if t is None or c == 0:
        return None
    return t if c == 1 else (-t if c == -1 else c * t)


def _sum(items):
    out = None
    for item in items:
        out = _add(out, item)
    return out


# ------------------------------------------------------------------------------------------
# The families: linear, affine, bilinear, pointwise (Faà di Bruno), selection
# ------------------------------------------------------------------------------------------


def linear(op, args, kwargs, pos: int = 0):
    """``op`` linear in ``args[pos]`` (a Taylor value), the other arguments held constant."""
    x = args[pos]
    return _map_multi(x, lambda t: op(*args[:pos], t, *args[pos + 1 :], **kwargs))


def _map_multi(x, fn):
    """``x.map(fn)``, for an ``fn`` returning a tensor or a list of them (``split``, ``unbind``)."""
    out = fn(x.value)  # computed once: a second, identical call would take the value's name away in CSE
    if isinstance(out, torch.Tensor):
        if isinstance(x, Jet):
            return Jet([out] + [None if t is None else fn(t) for t in x.terms[1:]])
        return Collapsed(_collapsed_terms(x, out, fn))
    if isinstance(x, Jet):
        terms = [out] + [None if t is None else fn(t) for t in x.terms[1:]]
    else:
        terms = _collapsed_terms(x, out, fn)
    return [type(x)([t[i] if t is not None else None for t in terms]) for i in range(len(out))]


def _slots(args, data):
    """Where the data arguments are: ``(position, index in a list argument or None)``."""
    slots = []
    for p in data:
        if p < len(args):
            a = args[p]
            slots += [(p, i) for i in range(len(a))] if isinstance(a, (list, tuple)) else [(p, None)]
    return slots


def _fill(args, slots, vals):
    args = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
    for (p, i), v in zip(slots, vals):
        if i is None:
            args[p] = v
        else:
            args[p][i] = v
    return args


def affine(op, args, kwargs, data):
    """``op`` jointly linear in the arguments at positions ``data`` up to a constant: each term is
    ``op`` of the arguments' terms, constants' terms being zero (``cat``, ``where``, ``stack``)."""
    slots = _slots(args, data)
    xs = [args[p] if i is None else args[p][i] for p, i in slots]
    value = op(*_fill(args, slots, [value_of(x) for x in xs]), **kwargs)
    first = next(x for x in xs if is_taylor(x))

    def term(vals, batched=None):
        if batched is None or not any(batched):
            return op(*_fill(args, slots, vals), **kwargs)
        return torch.vmap(lambda *g: term(list(g)), in_dims=tuple(0 if b else None for b in batched))(*vals)

    terms = [value]
    for k in range(1, first.order + 1):
        parts = [x.terms[k] if is_taylor(x) else None for x in xs]
        if all(t is None for t in parts):
            terms.append(None)
            continue
        filled = [t if t is not None else _zero(x) for t, x in zip(parts, xs)]
        lower = isinstance(first, Collapsed) and k < first.order
        terms.append(term(filled, [lower and t is not None for t in parts]))
    return type(first)(terms)


def bilinear(op, a, b, value=None):
    """``op(a, b)``, linear in each argument: Leibniz's rule."""
    if not is_taylor(a):
        return b.map(lambda t: op(a, t))
    if not is_taylor(b):
        return a.map(lambda t: op(t, b))
    value = op(a.value, b.value) if value is None else value
    terms = [value]
    for k in range(1, a.order + 1):
        terms.append(_sum(_leibniz(op, a, b, k, i) for i in range(k, -1, -1)))
    return type(a)(terms)


def _leibniz(op, a, b, k, i):
    """``C(k, i) op(a_i, b_(k-i))``; in a collapsed jet over the directions of the lower terms
    (batched), and summed over them in its highest term."""
    x, y = a.terms[i], b.terms[k - i]
    if x is None or y is None:
        return None
    c = math.comb(k, i)
    top = a.order
    bx, by = isinstance(a, Collapsed) and 0 < i < top, isinstance(a, Collapsed) and 0 < k - i < top
    if not (bx or by):
        return _scale(c, op(x, y))
    out = torch.vmap(op, in_dims=(0 if bx else None, 0 if by else None))(x, y)
    return _scale(c, out.sum(0) if k == top else out)


def _partitions(k: int, n: int):
    """Multiplicities ``m[j]`` (j = 1..k) with ``sum m = n`` and ``sum j * m[j] = k``."""

    def rec(j, left_k, left_n):
        if left_n == 0:
            if left_k == 0:
                yield {}
            return
        if j > left_k:
            return
        for m in range(min(left_n, left_k // j), -1, -1):
            for rest in rec(j + 1, left_k - j * m, left_n - m):
                yield {j: m, **rest} if m else rest

    yield from rec(1, k, n)


def bell(k: int, n: int, xs):
    """The partial Bell polynomial ``B_{k,n}(x_1, ..., x_{k-n+1})`` of the terms ``xs`` (``xs[j]``
    the ``j``-th term, None for zero): the coefficient of ``f^(n)`` in the ``k``-th derivative."""
    out = None
    for m in _partitions(k, n):
        if any(xs[j] is None for j in m):
            continue
        coef = math.factorial(k) // math.prod(math.factorial(j) ** c * math.factorial(c) for j, c in m.items())
        factors = [xs[j] for j, c in sorted(m.items()) for _ in range(c)]
        prod = factors[0]
        for f in factors[1:]:
            prod = prod * f
        out = _add(out, _scale(coef, prod))
    return out


def pointwise(x, tower: Callable[[int], list], value):
    """``f(x)`` for a pointwise ``f`` whose derivatives ``tower(n) = [f'(x), ..., f^(n)(x)]``:
    Faà di Bruno's formula."""
    if isinstance(x, Jet):
        d = tower(x.order)
        terms = [value]
        for k in range(1, x.order + 1):
            terms.append(_sum(_times(d[n - 1], bell(k, n, x.terms)) for n in range(1, k + 1)))
        return Jet(terms)
    top = x.order
    d = tower(top)
    terms = [value]
    for k in range(1, top):  # each direction's lower terms
        terms.append(_sum(_each(d[n - 1], bell(k, n, x.terms)) for n in range(1, k + 1)))
    summed = [_times(d[n - 1], _none_or(lambda t: t.sum(0), bell(top, n, x.terms))) for n in range(2, top + 1)]
    terms.append(_sum([_times(d[0], x.lap), *summed]))  # f'(x) * lap + f''(x) * sum_d grad_d**2 (K = 2)
    return Collapsed(terms)


def _times(d, t):
    if d is None or t is None:
        return None
    return d * t


def _each(d, t):
    """``d * t`` for each direction of ``t`` (leading dimension), ``d`` shaped as the value."""
    if d is None or t is None:
        return None
    if not isinstance(d, torch.Tensor) or d.dim() < t.dim():
        return d * t
    return torch.vmap(lambda u: d * u)(t)


def select(x, mask_fn):
    """A piecewise-linear op: every term goes through the same linear selection as the value."""
    return x.map(mask_fn)


# ------------------------------------------------------------------------------------------
# Derivative towers of pointwise functions: tower(x, y, n) -> [f'(x), ..., f^(n)(x)], y = f(x)
# ------------------------------------------------------------------------------------------


def _poly_eval(coeffs, y):
    """``sum_i coeffs[i] * y**i``, written withderiv zero terms."""
    powers = [None, y]
    for _ in range(2, len(coeffs)):
        powers.append(powers[-1] * y)
    deriv = None
    for i, c in enumerate(coeffs):
        if c == 0:
            continue
        if i == 0:
            deriv = c
            continue
        term = powers[i] if abs(c) == 1 else abs(c) * powers[i]
        if deriv is None:
            deriv = term if c > 0 else (-term if c == -1 else c * powers[i])
        else:
            deriv = deriv + term if c > 0 else deriv - term
    return deriv


def _poly_deriv(p):
    return [i * c for i, c in enumerate(p)][1:]


def _poly_mul(p, q):
    out = [0] * (len(p) + len(q) - 1)
    for i, a in enumerate(p):
        for j, b in enumerate(q):
            out[i + j] += a * b
    return out


def output_ode(coeffs):
    """The tower of an ``f`` with ``f' = P(f)`` (``exp``: P(y) = y; ``tanh``: 1 - y**2;
    ``sigmoid``: y - y**2): ``f^(n+1) = P_n'(f) f'`` where ``f^(n) = P_n(f)``, polynomials in the output."""

    def tower(x, y, n):
        d1 = _poly_eval(coeffs, y)
        derivs, poly = [d1], list(coeffs)
        while len(derivs) < n:
            slope = _poly_eval(_poly_deriv(poly), y)
            next_deriv = d1 if _is_one(slope) else (None if slope is None else slope * d1)
            derivs.append(next_deriv)
            poly = _poly_mul(_poly_deriv(poly), coeffs)
        return derivs

    return tower


def _is_one(p) -> bool:
    return isinstance(p, (int, float)) and p == 1


def power(p):
    """The tower of ``x ** p`` (``p`` a number or a constant tensor): ``p (p-1) ... (p-n+1) x ** (p-n)``."""

    def tower(x, y, n):
        if isinstance(p, torch.Tensor):
            coef = [p]
            for k in range(2, n + 1):
                coef.append(coef[-1] * (p - (k - 1)))
            return [c * torch.pow(x, p - k) for k, c in enumerate(coef, 1)]
        out: list[torch.Tensor | None] = []
        c = 1.0
        for k in range(1, n + 1):
            c *= p - k + 1
            e = p - k
            if c == 0:
                out.append(None)
            elif e == 0:
                out.append(torch.full_like(x, c))
            else:
                base = x if e == 1 else (torch.reciprocal(x) if e == -1 else torch.pow(x, e))
                out.append(base if c == 1 else c * base)
        return out

    return tower


def _cycle(other, sign):
    """``sin`` (``other = cos``, ``sign = 1``) and ``cos`` (``sin``, ``-1``): the derivatives
    ``sign * other(x), -y, -sign * other(x), y`` repeat with period four."""

    def tower(x, y, n):
        deriv = other(x) if sign > 0 else -other(x)
        next_deriv = -y
        derivs = [deriv, next_deriv]
        if n > 2:
            derivs += [-deriv, y]
        return [derivs[k % 4] for k in range(n)]

    return tower


def _hyper(other):
    def tower(x, y, n):
        o = other(x)
        return [o if k % 2 == 0 else y for k in range(n)]

    return tower


def _log_like(inner, scale=1.0):
    """``log(x)`` (``inner = x``), ``log1p`` (``1 + x``), ``log2``/``log10`` (``scale``):
    ``f^(n) = (-1)^(n-1) (n-1)! scale / inner^n``."""

    def tower(x, y, n):
        r = torch.reciprocal(inner(x))
        if scale != 1.0:
            r1 = r * scale
        else:
            r1 = r
        out = [r1]
        rn = r
        for k in range(2, n + 1):
            rn = rn * r
            c = (-1) ** (k - 1) * math.factorial(k - 1) * scale
            out.append(c * rn)
        return out

    return tower


def _hermite(n):
    """Coefficients of the physicists' Hermite polynomial ``H_n``."""
    h = [[1], [0, 2]]
    while len(h) <= n:
        k = len(h) - 1
        nxt = [0] + [2 * c for c in h[k]]
        for i, c in enumerate(h[k - 1]):
            nxt[i] -= 2 * k * c
        h.append(nxt)
    return h[n]


def _erf(sign):
    """``erf^(n) = 2/sqrt(pi) (-1)^(n-1) H_{n-1}(x) exp(-x**2)`` (``erfc`` is minus that)."""

    def tower(x, y, n):
        g = (sign * 2 / math.sqrt(math.pi)) * torch.exp(-(x * x))
        out = []
        for k in range(1, n + 1):
            h = _poly_eval(_hermite(k - 1), x)
            c = (-1) ** (k - 1)
            out.append(g if k == 1 else (c * h) * g)
        return out

    return tower


def _from_derivative(g):
    """The tower of an ``f`` whose derivative ``g(x)`` is written with ruled ops (``atan``: ``1 / (1 + x**2)``):
    ``f^(k+1)`` is the ``k``-th term of ``g``'s jet along ``x + t``."""

    def tower(x, y, n):
        if n == 1:
            return [g(x)]
        return list(g(Jet([x, torch.ones_like(x)] + [None] * (n - 2))).terms)

    return tower


def _one_plus_square(sign_one, sign_square):
    """``sign_one + sign_square * u**2``, for the derivatives of the inverse trigonometric functions."""

    def of(u):
        square = call(aten.mul.Tensor, u, u)
        if sign_square < 0:
            return call(aten.rsub.Scalar, square, sign_one)
        return call(aten.add.Tensor, square, sign_one)

    return of


def _then(op, inner, scale=1):
    def of(u):
        out = call(op, inner(u))
        return call(aten.mul.Tensor, out, scale) if scale != 1 else out

    return of


TOWERS: dict[Any, Callable] = {
    aten.atan: _from_derivative(_then(aten.reciprocal.default, _one_plus_square(1, 1))),
    aten.asin: _from_derivative(_then(aten.rsqrt.default, _one_plus_square(1, -1))),
    aten.acos: _from_derivative(_then(aten.rsqrt.default, _one_plus_square(1, -1), -1)),
    aten.atanh: _from_derivative(_then(aten.reciprocal.default, _one_plus_square(1, -1))),
    aten.asinh: _from_derivative(_then(aten.rsqrt.default, _one_plus_square(1, 1))),
    aten.acosh: _from_derivative(_then(aten.rsqrt.default, _one_plus_square(-1, 1))),
    aten.exp2: lambda x, y, n: [y * math.log(2.0) ** k for k in range(1, n + 1)],
    aten.exp: output_ode([0, 1]),
    aten.tanh: output_ode([1, 0, -1]),
    aten.sigmoid: output_ode([0, 1, -1]),
    aten.tan: output_ode([1, 0, 1]),
    aten.expm1: lambda x, y, n: [torch.exp(x)] * n,
    aten.sin: _cycle(torch.cos, 1),
    aten.cos: _cycle(torch.sin, -1),
    aten.sinh: _hyper(torch.cosh),
    aten.cosh: _hyper(torch.sinh),
    aten.log: _log_like(lambda x: x),
    aten.log1p: _log_like(lambda x: 1 + x),
    aten.log2: _log_like(lambda x: x, 1 / math.log(2.0)),
    aten.log10: _log_like(lambda x: x, 1 / math.log(10.0)),
    aten.sqrt: power(0.5),
    aten.rsqrt: power(-0.5),
    aten.reciprocal: power(-1),
    aten.square: power(2),
    aten.erf: _erf(1),
    aten.erfc: _erf(-1),
}


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------

RULES: dict[Any, Callable] = {}


def taylor_rule(*ops):
    def register(fn):
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def lookup(op):
    """The Taylor rule of an op (an overload's own entry first, then its packet's)."""
    rule = RULES.get(op)
    if rule is None and isinstance(op, torch._ops.OpOverload):
        rule = RULES.get(op.overloadpacket)
    return rule


def has_rule(op) -> bool:
    return lookup(op) is not None


def apply(op, args, kwargs, called=False):
    """``op`` on Taylor (and plain) arguments, by its rule; KeyError if it has none. ``called``:
    the program calls ``op`` itself (it is no step of a decomposition): a rule of ``CALLED``
    gives PyTorch's value for the op where a decomposition's step must give the decomposed op's."""
    rule = (CALLED.get(op) or CALLED.get(getattr(op, "overloadpacket", op))) if called else None
    rule = rule or lookup(op)
    if rule is None:
        raise KeyError(op)
    return constant_if_zero(rule(op, list(args), dict(kwargs)))


def call(op, *args, **kwargs):
    """``op`` on arguments some of which may be Taylor values: what composite rules are written with."""
    if any(is_taylor(a) for a in pytree.tree_leaves((args, kwargs), is_leaf=is_taylor)):
        return apply(op, args, kwargs)
    return op(*args, **kwargs)


def _only_first(op, args, kwargs):
    others = [a for a in pytree.tree_leaves((args[1:], kwargs), is_leaf=is_taylor) if is_taylor(a)]
    if others:
        raise NotImplementedError(f"{op} is linear in its first argument only; its others must not depend on the input")
    return linear(op, args, kwargs)


LINEAR = [
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten.permute,
    aten.transpose,
    aten.t,
    aten.expand,
    aten.unsqueeze,
    aten.squeeze,
    aten.sum,
    aten.mean,
    aten.neg,
    aten.clone,
    aten.alias,
    aten.slice,
    aten.select,
    aten.index_select,
    aten.narrow,
    aten.flip,
    aten.roll,
    aten.repeat,
    aten.cumsum,
    aten.diagonal,
    aten.gather,
    aten.unfold,
    aten._to_copy,
    aten.contiguous,
    aten.trace,
    aten.tril,
    aten.triu,
    aten.diag,
    aten.diag_embed,
    aten.flatten,
    aten.movedim,
    aten.split,
    aten.split_with_sizes,
    aten.unbind,
    aten.chunk,
    aten.index,
    aten.as_strided,
    aten.lift_fresh_copy,
    aten.avg_pool1d,
    aten.avg_pool2d,
    aten.avg_pool3d,
    aten.adaptive_avg_pool1d,
    aten.adaptive_avg_pool2d,
    aten._adaptive_avg_pool2d,
    aten.pixel_shuffle,
    aten.pixel_unshuffle,
    aten.upsample_nearest1d,
    aten.upsample_nearest2d,
    aten.upsample_bilinear2d,
    aten.im2col,
    aten.col2im,
    aten.conj,
    aten.real,
    aten.alias_copy,
    aten.view_copy,
    aten.permute_copy,
    aten.squeeze_copy,
    aten.unsqueeze_copy,
    aten.expand_copy,
    aten.t_copy,
    aten.transpose_copy,
    aten.slice_copy,
    aten.select_copy,
    aten.diagonal_copy,
    aten.unfold_copy,
    aten.unbind_copy,
    aten.split_copy,
    aten.cumulative_trapezoid,
    aten.trapezoid,
    aten.channel_shuffle,
    aten.reflection_pad1d,
    aten.reflection_pad2d,
    aten.replication_pad1d,
    aten.replication_pad2d,
    aten.nansum,
]
for _op in LINEAR:
    RULES[_op] = _only_first


@taylor_rule(aten.expand_as, aten.view_as, aten.reshape_as, aten.type_as)
def _like_second(op, args, kwargs):
    """``x.expand_as(y)`` and kin: linear in ``x``; ``y`` is read for its shape (or dtype) only."""
    x, y = args[0], value_of(args[1])
    if not is_taylor(x):
        return op(x, y)
    return linear(op, [x, y], kwargs)


# data positions of affine ops: a constant in one of them contributes to the value only
AFFINE = {
    aten.cat: (0,),
    aten.stack: (0,),
    aten.hstack: (0,),
    aten.vstack: (0,),
    aten.where: (1, 2),
    aten.masked_fill: (0, 2),
    aten.index_put: (0, 2),
    aten.index_add: (0, 3),
    aten.scatter: (0, 3),
    aten.scatter_add: (0, 3),
    aten.slice_scatter: (0, 1),
    aten.select_scatter: (0, 1),
    aten.diagonal_scatter: (0, 1),
    aten.constant_pad_nd: (0, 2),
    aten.lerp: (0, 1),
    aten.copy: (1,),
    aten.fill: (1,),
    aten._unsafe_index: (0,),
    aten._unsafe_masked_index: (0, 3),
    aten._unsafe_index_put: (0, 2),
    aten._unsafe_masked_index_put_accumulate: (0, 3),
}


def _affine(op, args, kwargs):
    data = AFFINE.get(op) or AFFINE[op.overloadpacket]
    if op.overloadpacket in (aten.lerp,) and is_taylor(args[2] if len(args) > 2 else None):
        raise NotImplementedError("lerp with a weight depending on the input")
    return affine(op, args, kwargs, data)


for _op in AFFINE:
    RULES[_op] = _affine


def _where(op, args, kwargs):
    """``torch.where(c, a, b)``: the selected branch's terms, plus zero times the other's, so a
    non-finite derivative of the branch not taken gives NaN, as autograd's ``where`` backward
    (a zero cotangent times that derivative) gives in a gradient, a Hessian and so a Laplacian
    (``torch.where(x > 0, torch.log(x), 0)`` at 0). Where it is finite the terms are the selected
    branch's, as ``affine`` computes them."""
    c, a, b = args[:3]
    out = _affine(op, args, kwargs)
    if is_taylor(a) and is_taylor(b):
        other = _affine(aten.where.self, (c, b, a), kwargs)
        rest = [t if t is None else t + u * 0 for t, u in zip(out.terms[1:], other.terms[1:])]
    else:
        taken = a if is_taylor(a) else b
        zero = taken.map(lambda t: t * 0)
        rest = _affine(aten.where.self, (c, taken, zero) if taken is a else (c, zero, taken), kwargs).terms[1:]
    return type(out)([out.value, *rest])


# rules for ops the program calls itself (``apply(..., called=True)``)
CALLED = {aten.where: _where}


@taylor_rule(aten.add, aten.sub, aten.rsub)
def _add_sub(op, args, kwargs):
    """Sums: the terms add (``alpha`` scales the second); a constant shifts the value only."""
    a, b = args[0], args[1]
    alpha = kwargs.get("alpha", 1)
    sa, sb = {aten.add: (1, alpha), aten.sub: (1, -alpha), aten.rsub: (-alpha, 1)}[op.overloadpacket]
    value = op(value_of(a), value_of(b), **kwargs)
    shape = value.shape
    parts = [_broadcast(x, shape) for x in (a, b)]
    taylor = next(x for x in parts if x is not None)
    terms = [value] + [_add(_scale(sa, _term(parts[0], k)), _scale(sb, _term(parts[1], k))) for k in range(1, taylor.order + 1)]
    return type(taylor)(terms)


def _term(x, k):
    return None if x is None else x.terms[k]


def _broadcast(x, shape):
    """A Taylor summand expanded to the sum's shape (None for a constant)."""
    if not is_taylor(x):
        return None
    if tuple(x.value.shape) == tuple(shape):
        return x
    return x.map(lambda t: t.expand(shape))


@taylor_rule(aten.mul, aten.mm, aten.bmm, aten.matmul, aten.mv, aten.dot, aten.outer, aten.inner, aten.vdot, aten.einsum)
def _bilinear(op, args, kwargs):
    if op.overloadpacket is aten.einsum:
        eq, ops = args[0], list(args[1])
        if len(ops) != 2:
            raise NotImplementedError("einsum of other than two operands")
        return bilinear(lambda x, y: op(eq, [x, y]), ops[0], ops[1])
    return bilinear(lambda x, y: op(x, y, *args[2:], **kwargs), args[0], args[1])


@taylor_rule(aten.linear)
def _linear(op, args, kwargs):
    """``x @ w.T + b``: bilinear in ``(x, w)``, then the bias's terms added."""
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    out = _matmul_t(op, x, w)
    if b is not None:
        out = call(aten.add.Tensor, out, b)
    return _with_value(out, op(value_of(x), value_of(w), value_of(b)))


def _matmul_t(op, x, w):
    if not is_taylor(x) and not is_taylor(w):
        return op(x, w)
    return bilinear(lambda u, v: op(u, v), x, w)


@taylor_rule(aten.convolution)
def _convolution(op, args, kwargs):
    """Bilinear in (input, weight), then the bias's terms added per channel."""
    x, w, b, *rest = args
    conv = bilinear(lambda u, v: op(u, v, None, *rest), x, w) if is_taylor(x) or is_taylor(w) else op(x, w, None, *rest)
    out = conv
    if b is not None:
        out = call(aten.add.Tensor, conv, call(aten.view.default, b, [-1] + [1] * (value_of(x).dim() - 2)))
    return _with_value(out, op(value_of(x), value_of(w), value_of(b), *rest))


@taylor_rule(aten.addmm, aten.addmv, aten.baddbmm, aten.addbmm, aten.addcmul, aten.addcdiv)
def _add_product(op, args, kwargs):
    """``beta * input + alpha * product(a, b)``, written with the rules of its parts."""
    inp, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", kwargs.get("value", 1))
    product = {
        aten.addmm: aten.mm.default,
        aten.addmv: aten.mv.default,
        aten.baddbmm: aten.bmm.default,
        aten.addbmm: None,
        aten.addcmul: aten.mul.Tensor,
        aten.addcdiv: aten.div.Tensor,
    }[op.overloadpacket]
    if product is None:
        prod = call(aten.sum.dim_IntList, call(aten.bmm.default, a, b), [0])
    else:
        prod = call(product, a, b)
    scaled = call(aten.mul.Tensor, prod, alpha) if alpha != 1 else prod
    base = call(aten.mul.Tensor, inp, beta) if beta != 1 else inp
    return call(aten.add.Tensor, base, scaled)


@taylor_rule(aten.div)
def _div(op, args, kwargs):
    a, b = args[0], args[1]
    if kwargs.get("rounding_mode") is not None:
        raise NotImplementedError("div with a rounding mode is piecewise constant")
    if not is_taylor(b):
        return linear(op, args, kwargs)
    r = pointwise(b, lambda n: power(-1)(b.value, None, n), torch.reciprocal(b.value))
    return bilinear(aten.mul.Tensor, a, r, value=op(value_of(a), b.value))


@taylor_rule(aten.pow)
def _pow(op, args, kwargs):
    x, p = args[0], args[1]
    if not is_taylor(p):
        value = op(x.value, p)
        return pointwise(x, lambda n: power(p)(x.value, value, n), value)
    if not is_taylor(x):  # base ** p = exp(p log base)
        log_base = math.log(x) if not isinstance(x, torch.Tensor) else torch.log(x)
        value = op(x, p.value)
        return pointwise(call(aten.mul.Tensor, p, log_base), lambda n: [value] * n, value)
    return call(aten.exp.default, call(aten.mul.Tensor, p, call(aten.log.default, x)))


def _tower_rule(op, args, kwargs):
    x = args[0]
    tower = TOWERS[op.overloadpacket]
    value = op(x.value, *args[1:], **kwargs)
    return pointwise(x, lambda n: tower(x.value, value, n), value)


for _op in TOWERS:
    RULES[_op] = _tower_rule


# Pointwise ops PyTorch decomposes into pieces with kinks or overflow (``log_sigmoid``:
# ``min(0, x) - log1p(exp(-|x|))``, whose kinks at 0 cancel in the math but not in the terms):
# a tower of the op itself, with PyTorch's derivative where the op has a kink.


def _tower_of(op, args, kwargs, value, tower):
    x = args[0]
    return pointwise(x, lambda n: tower(x.value, n), value)


@taylor_rule(aten.log_sigmoid_forward)
def _log_sigmoid(op, args, kwargs):
    """``f' = sigmoid(-x)``: smooth everywhere (``-1/4`` at 0)."""
    value, buffer = op(args[0].value)
    tower = _from_derivative(lambda u: call(aten.sigmoid.default, call(aten.neg.default, u)))
    return [_tower_of(op, args, kwargs, value, lambda x, n: tower(x, value, n)), buffer]


@taylor_rule(aten.special_entr)
def _entr(op, args, kwargs):
    """``-x log x``: ``f' = -(log x + 1)``, ``f^(k) = (-1)^(k-1) (k-2)! / x^(k-1)``; PyTorch's
    formulas also for ``x < 0`` (where the value is ``-inf``: autograd's ``f'' = -1/x``)."""

    def tower(x, n):
        r = torch.reciprocal(x)
        out, rk = [-(torch.log(x) + 1)], r
        for k in range(2, n + 1):
            out.append(-rk if k == 2 else ((-1) ** (k - 1) * math.factorial(k - 2)) * rk)
            rk = rk * r
        return out

    return _tower_of(op, args, kwargs, op(args[0].value), tower)


@taylor_rule(aten.logit)
def _logit(op, args, kwargs):
    """``log(x / (1 - x))``: ``f' = 1 / (x (1 - x))``. Outside ``[0, 1]`` (value NaN) autograd's first
    derivative is NaN and its higher ones 0; ``eps`` clamps first, as the op does."""
    x, eps = args[0], (args[1] if len(args) > 1 else kwargs.get("eps"))
    if eps is not None:
        x = call(aten.clamp.default, x, eps, 1 - eps)
    value = op(x.value)
    inner = _from_derivative(lambda u: call(aten.reciprocal.default, call(aten.mul.Tensor, u, call(aten.rsub.Scalar, u, 1))))

    def tower(v, n):
        outside = torch.logical_or(v < 0, v > 1)
        return [torch.where(outside, math.nan if k == 0 else 0.0, d) for k, d in enumerate(inner(v, value, n))]

    return _tower_of(op, [x], {}, value, tower)


_ELU_PARAMS: dict[Any, Callable[..., tuple]] = {  # (alpha, scale, input_scale) of each op of the family, from its arguments
    aten.elu: lambda x, alpha=1, scale=1, input_scale=1: (alpha, scale, input_scale),
    aten.selu: lambda x: (1.6732632423543772848170429916717, 1.0507009873554804934193349852946, 1),
    aten.celu: lambda x, alpha=1.0: (alpha, 1, 1 / alpha),
}


@taylor_rule(*_ELU_PARAMS)
def _elu(op, args, kwargs):
    """``scale * alpha * (exp(input_scale * x) - 1)`` for ``x <= 0``, ``scale * x`` above: at 0
    PyTorch's ``elu_backward`` takes the left first derivative and a zero second one."""
    alpha, scale, input_scale = _ELU_PARAMS[op.overloadpacket](*value_of(args), **kwargs)

    def tower(x, n):
        e = torch.exp(x * input_scale) if input_scale != 1 else torch.exp(x)
        first = torch.where(x <= 0, e * (alpha * scale * input_scale), scale)
        return [first, *(torch.where(x < 0, e * (alpha * scale * input_scale**k), 0.0) for k in range(2, n + 1))]

    return _tower_of(op, args, kwargs, op(*value_of(args), **kwargs), tower)


# piecewise-linear ops: the terms are selected as the value is


@taylor_rule(aten.relu)
def _relu(op, args, kwargs):
    x = args[0]
    mask = x.value > 0
    return _with_value(select(x, lambda t: torch.where(mask, t, 0)), op(x.value))


@taylor_rule(aten.abs)
def _abs(op, args, kwargs):
    x = args[0]
    s = torch.sign(x.value)
    return _with_value(select(x, lambda t: s * t), op(x.value))


@taylor_rule(aten.clamp, aten.clamp_min, aten.clamp_max, aten.hardtanh)
def _clamp(op, args, kwargs):
    x = args[0]
    lo, hi = _bounds(op, args, kwargs)
    if is_taylor(lo) or is_taylor(hi):
        raise NotImplementedError(f"{op} with bounds depending on the input")
    v = x.value
    if op.overloadpacket is aten.hardtanh:  # hardtanh's derivative is zero at its bounds
        keep = (v > lo) & (v < hi)
    else:
        keep = _within(v, lo, hi)
    return _with_value(select(x, lambda t: torch.where(keep, t, 0)), op(v, *args[1:], **kwargs))


def _bounds(op, args, kwargs):
    packet = op.overloadpacket
    if packet is aten.clamp_min:
        return args[1], None
    if packet is aten.clamp_max:
        return None, args[1]
    if packet is aten.hardtanh:
        return (args[1] if len(args) > 1 else -1.0), (args[2] if len(args) > 2 else 1.0)
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    return lo, hi


def _within(v, lo, hi):
    keep = None
    if lo is not None:
        keep = v >= lo
    if hi is not None:
        keep = (v <= hi) if keep is None else keep & (v <= hi)
    return keep


@taylor_rule(aten.leaky_relu)
def _leaky_relu(op, args, kwargs):
    x = args[0]
    slope = args[1] if len(args) > 1 else 0.01
    pos = x.value > 0
    return _with_value(select(x, lambda t: torch.where(pos, t, slope * t)), op(x.value, *args[1:]))


@taylor_rule(aten.maximum, aten.minimum, aten.fmax, aten.fmin, aten.max.other, aten.min.other)
def _maximum(op, args, kwargs):
    """The larger (smaller) argument's terms; at ties the mean of both, as autograd."""
    a, b = args
    va, vb = value_of(a), value_of(b)
    first = va > vb if op.overloadpacket in (aten.maximum, aten.fmax, aten.max) else va < vb
    w = first.to(va.dtype if isinstance(va, torch.Tensor) else vb.dtype) + 0.5 * (va == vb)
    left = call(aten.mul.Tensor, a, w)
    right = call(aten.mul.Tensor, b, 1 - w)
    return _with_value(call(aten.add.Tensor, left, right), op(va, vb))


@taylor_rule(aten.amax, aten.amin, aten.max, aten.min)
def _extremum(op, args, kwargs):
    """The terms at the extreme elements (their mean at ties, as autograd); ``max(x, dim)``
    follows its returned indices, as autograd."""
    x = args[0]
    v = x.value
    out = op(v, *args[1:], **kwargs)
    if isinstance(out, (tuple, list)):  # max.dim / min.dim: (values, indices)
        dim = args[1]
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        idx = out[1] if keepdim else out[1].unsqueeze(dim)
        picked = linear(aten.gather.default, [x, dim, idx], {})
        if not keepdim:
            picked = linear(aten.squeeze.dim, [picked, dim], {})
        return [_with_value(picked, out[0]), out[1]]
    dims = list(range(v.dim())) if len(args) < 2 or op.overloadpacket in (aten.max, aten.min) else args[1]
    dims = [dims] if isinstance(dims, int) else list(dims) or list(range(v.dim()))
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    full = out if keepdim or not dims or out.dim() == v.dim() else _unsqueeze_all(out, dims, v.dim())
    mask = (v == full).to(v.dtype)
    weight = mask / mask.sum(dims, keepdim=True)
    picked = x.map(lambda t: (t * weight).sum(dims, keepdim=keepdim))
    return _with_value(picked, out)


def _unsqueeze_all(out, dims, ndim):
    for d in sorted(d % ndim for d in dims):
        out = out.unsqueeze(d)
    return out


@taylor_rule(aten.sort, aten.topk, aten.kthvalue, aten.cummax, aten.cummin, aten.median, aten.mode)
def _by_indices(op, args, kwargs):
    """Ops returning values picked at returned indices: the terms are gathered at those indices."""
    x = args[0]
    out = op(x.value, *args[1:], **kwargs)
    if not isinstance(out, (tuple, list)):
        raise NotImplementedError(f"{op} without indices")
    values, idx = out[0], out[1]
    dim = _dim_arg(op, args, kwargs)
    keep = idx.dim() == x.value.dim()
    index = idx if keep else idx.unsqueeze(dim)
    picked = linear(aten.gather.default, [x, dim, index], {})
    if not keep:
        picked = linear(aten.squeeze.dim, [picked, dim], {})
    return [_with_value(picked, values), idx]


def _dim_arg(op, args, kwargs):
    packet = op.overloadpacket
    if packet is aten.topk:
        return args[2] if len(args) > 2 else kwargs.get("dim", -1)
    if packet is aten.kthvalue:
        return args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("dim", -1)


def _with_value(t, value):
    """``t`` with its value replaced by ``value`` (the op itself, rather than its rule's spelling)."""
    return type(t)([value, *t.terms[1:]])


@taylor_rule(aten.nan_to_num)
def _nan_to_num(op, args, kwargs):
    """The terms times ``isfinite(x)``, as autograd: a replaced element's NaN terms (``log(|x|)`` at
    0: ``0 * inf``) stay NaN rather than being selected away."""
    x = args[0]
    finite = torch.isfinite(x.value)
    return _with_value(x.map(lambda t: t * finite), op(x.value, *args[1:], **kwargs))


@taylor_rule(aten.xlogy)
def _xlogy(op, args, kwargs):
    """``x * log(y)`` by Leibniz's rule with autograd's conventions: ``x``'s terms times ``log(y)`` as
    ``xlogy`` (0 for a zero term, and where ``x == 0``, ``y <= 0``), so ``xlogy(x, x)`` has NaN
    derivatives at 0 (``x / y * dy`` is ``0 / 0``) rather than the decomposition's selected 0."""
    x, y = args[0], args[1]
    vx, vy = value_of(x), value_of(y)
    no_log = (vx == 0) & (vy <= 0)
    log_y = call(aten.log.default, y) if is_taylor(y) else vy
    log_value = value_of(log_y)

    def product(s, t):
        return torch.where(no_log, 0.0, torch.xlogy(s, vy)) if t is log_value else s * t

    return _with_value(bilinear(product, x, log_y), op(vx, vy))


# composites


@taylor_rule(aten._softmax, aten.softmax)
def _softmax(op, args, kwargs):
    x, dim = args[0], args[1]
    shift = torch.amax(x.value, dim, keepdim=True)  # a constant: softmax does not change with it
    e = call(aten.exp.default, call(aten.sub.Tensor, x, shift))
    s = call(aten.div.Tensor, e, call(aten.sum.dim_IntList, e, [dim], True))
    return _with_value(s, op(x.value, *args[1:], **kwargs))


@taylor_rule(aten._log_softmax, aten.log_softmax)
def _log_softmax(op, args, kwargs):
    x, dim = args[0], args[1]
    out = op(x.value, *args[1:], **kwargs)
    return _with_value(call(aten.sub.Tensor, x, _logsumexp(x, [dim])), out)


def _logsumexp(x, dims):
    shift = torch.amax(x.value, dims, keepdim=True)
    e = call(aten.exp.default, call(aten.sub.Tensor, x, shift))
    return call(aten.add.Tensor, call(aten.log.default, call(aten.sum.dim_IntList, e, dims, True)), shift)


@taylor_rule(aten.logsumexp)
def _logsumexp_rule(op, args, kwargs):
    x, dims = args[0], args[1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    lse = _logsumexp(x, dims)
    if not keepdim:
        lse = call(aten.squeeze.dims, lse, dims)
    return _with_value(lse, op(x.value, *args[1:], **kwargs))


def _dims_of(dims, ndim):
    if dims is None:
        return list(range(ndim))
    return [dims] if isinstance(dims, int) else list(dims) or list(range(ndim))


def _moments(x, dims, correction):
    """``(var, mean)`` over ``dims`` (kept), written with the rules of their parts."""
    v = x.value
    n = math.prod(v.shape[d] for d in dims)
    mean = call(aten.mean.dim, x, dims, True)
    dev = call(aten.sub.Tensor, x, mean)
    sq = call(aten.sum.dim_IntList, call(aten.mul.Tensor, dev, dev), dims, True)
    return call(aten.div.Tensor, sq, max(n - correction, 0)), mean


def _correction_keepdim(args, kwargs):
    """``(correction, keepdim)`` of a variance call: keywords (``.correction``) or positions (``.dim``)."""
    if len(args) > 2:  # var.dim(x, dim, unbiased, keepdim)
        return (1 if args[2] else 0), (args[3] if len(args) > 3 else kwargs.get("keepdim", False))
    correction = kwargs.get("correction")
    if correction is None:
        correction = 1 if kwargs.get("unbiased", True) else 0
    return correction, kwargs.get("keepdim", False)


@taylor_rule(aten.var, aten.std, aten.var_mean, aten.std_mean)
def _variance(op, args, kwargs):
    """Variance (and standard deviation, and their means) as the mean of squared deviations."""
    x = args[0]
    dims = _dims_of(args[1] if len(args) > 1 and not isinstance(args[1], bool) else kwargs.get("dim"), x.value.dim())
    correction, keepdim = _correction_keepdim(args, kwargs)
    var, mean = _moments(x, dims, correction)
    packet = op.overloadpacket
    first = call(aten.sqrt.default, var) if packet in (aten.std, aten.std_mean) else var
    if not keepdim:
        first = call(aten.squeeze.dims, first, dims)
        mean = call(aten.squeeze.dims, mean, dims)
    out = op(x.value, *args[1:], **kwargs)
    if packet in (aten.var_mean, aten.std_mean):
        return [_shaped(first, out[0]), _shaped(mean, out[1])]
    return _shaped(first, out)


def _shaped(t, value):
    """``t`` with ``value`` as its value, its terms reshaped to it (a 0-dimensional input's moments)."""
    if tuple(t.value.shape) != tuple(value.shape):
        t = t.map(lambda u: u.reshape(value.shape))
    return _with_value(t, value)


@taylor_rule(aten.linalg_vector_norm)
def _vector_norm(op, args, kwargs):
    """``(sum |x|^p)^(1/p)``: ``sqrt(sum x * x)`` for p = 2, the largest ``|x|`` for p = inf."""
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dims = _dims_of(args[2] if len(args) > 2 else kwargs.get("dim"), x.value.dim())
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    out = op(x.value, *args[1:], **kwargs)
    if p == 2:
        norm = call(aten.sqrt.default, call(aten.sum.dim_IntList, call(aten.mul.Tensor, x, x), dims, keepdim))
    elif p in (math.inf, -math.inf):
        norm = call(aten.amax.default if p > 0 else aten.amin.default, call(aten.abs.default, x), dims, keepdim)
    elif p == 1:
        norm = call(aten.sum.dim_IntList, call(aten.abs.default, x), dims, keepdim)
    elif p > 0:
        powered = call(aten.pow.Tensor_Scalar, call(aten.abs.default, x), p)
        norm = call(aten.pow.Tensor_Scalar, call(aten.sum.dim_IntList, powered, dims, keepdim), 1 / p)
    else:
        raise NotImplementedError(f"vector norm of order {p}")
    return _with_value(norm, out)


@taylor_rule(aten.dropout, aten.feature_dropout)
def _dropout(op, args, kwargs):
    """One mask, drawn as eager PyTorch draws it (the same numbers after the same seed), applied to every term."""
    x, p, train = args[0], args[1], args[2]
    draw = dropout_fwd if op.overloadpacket is aten.dropout else feature_dropout_fwd
    _, mask = draw(x.value, p, train)
    return x if mask is None else call(aten.mul.Tensor, x, mask)


@taylor_rule(aten.batch_norm)
def _batch_norm(op, args, kwargs):
    """The value by the op itself (it updates the running statistics as eager does, outside autograd);
    the terms from the batch's moments in training, else from the running statistics."""
    x, weight, bias, running_mean, running_var, training, _momentum, eps = args[:8]
    v = x.value
    out = op(v, *value_of(list(args[1:])), **kwargs)
    shape = [1, -1] + [1] * (v.dim() - 2)
    if training or running_mean is None:
        var, mean = _moments(x, [d for d in range(v.dim()) if d != 1], 0)
    else:
        var, mean = call(aten.view.default, running_var, shape), call(aten.view.default, running_mean, shape)
    y = call(aten.mul.Tensor, call(aten.sub.Tensor, x, mean), call(aten.rsqrt.default, call(aten.add.Tensor, var, eps)))
    if weight is not None:
        y = call(aten.mul.Tensor, y, call(aten.view.default, weight, shape))
    if bias is not None:
        y = call(aten.add.Tensor, y, call(aten.view.default, bias, shape))
    return _with_value(y, out)


_MAX_PROD = 16


@taylor_rule(aten.prod)
def _prod(op, args, kwargs):
    """The product of ``n`` factors, by Leibniz's rule one factor at a time (``n`` up to 16)."""
    x = args[0]
    v = x.value
    if len(args) > 1:
        dim, keepdim = args[1], args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    else:
        x, dim, keepdim = call(aten.reshape.default, x, [-1]), 0, False
    n = value_of(x).shape[dim]
    if n > _MAX_PROD:
        raise NotImplementedError(
            f"prod of {n} factors: Taylor mode multiplies them one at a time up to {_MAX_PROD}; write exp(sum(log(x))) for positive x"
        )
    out = op(v, *args[1:], **kwargs)
    if n == 0:
        return out
    acc = call(aten.select.int, x, dim, 0)
    for i in range(1, n):
        acc = call(aten.mul.Tensor, acc, call(aten.select.int, x, dim, i))
    if keepdim:
        acc = call(aten.unsqueeze.default, acc, dim)
    return _with_value(acc, out)


def expand(gm: fx.GraphModule, ruleless: Callable[[], list]) -> list:
    """Replace the nodes ``ruleless()`` lists (ops the Taylor terms reach without a rule) by PyTorch's
    decompositions, round after round; returns those left (no decomposition applies)."""
    for _ in range(20):
        todo = ruleless()
        if not todo or not any([any(inline_decomposition(gm, n, d) for d in decompositions(n.target)) for n in todo]):
            break
    gm.recompile()
    return ruleless()
