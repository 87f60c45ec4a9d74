"""VJP rules of reductions: the cotangent is broadcast back over the reduced dimensions.

``restore`` puts the reduced dimensions back (as size 1) so that a cotangent shaped like the
reduction's output broadcasts against the input; a full reduction's 0-d cotangent needs nothing.
Ops that select elements (max over a dim, sort, topk, median, ...) scatter the cotangent back to
the indices they return; ops that pick a value shared by ties (amax, max of the whole tensor,
median of the whole tensor) split it evenly between the ties, as autograd does.

Complex tensors: sums, means and products are holomorphic rules (``vjp_rule`` conjugates their
arguments); variances and norms are real functions of complex tensors and compute autograd's
convention themselves (``complex="convention"``: ``var``'s ``2 ct (x - mean) / dof``).
"""

from __future__ import annotations

import math

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from ..registry import mark_nondifferentiable, vjp_rule
from .common import cast_cotangent, normalize_dims, same_shape

aten = torch.ops.aten


def restore(g, x, dim, keepdim=False):
    """``g`` (shaped like ``x`` reduced over ``dim``) with the reduced dims re-inserted as size 1."""
    if keepdim or g.dim() == 0 or g.dim() == x.dim():
        return g
    for d in normalize_dims(dim, x.dim()):
        g = g.unsqueeze(d)
    return g


def expand_as(g, x):
    g = cast_cotangent(g, x.dtype)
    return g if same_shape(g.shape, x.shape) else g.expand(x.shape)


def cast(g, x):
    return None if g is None else cast_cotangent(g, x.dtype)


def _at_least_one(n):
    """``max(n, 1)``; a data-dependent count stays as it is (when it is 0 the gradient is empty)."""
    return max(n, 1) if isinstance(n, int) else n


def is_full(x, dim):
    return dim is None or x.dim() == 0 or len(normalize_dims(dim, x.dim())) == x.dim()


def dims_of(x, dim):
    return normalize_dims(dim, x.dim()) if x.dim() else []


def numel(x, dim):
    return math.prod(x.shape[d] for d in dims_of(x, dim))


def sum_keep(t, x, dim):
    """``t`` summed over ``dim``, keeping the reduced dims (a 0-d sum for a full reduction)."""
    return t.sum() if is_full(x, dim) else t.sum(dims_of(x, dim), keepdim=True)


def sign(x):
    return x.sgn() if x.is_complex() else x.sign()


def power(t, e):
    return t if e == 1 else t.pow(int(e) if float(e).is_integer() else e)


def rev_cumsum(t, dim):
    return t.flip(dim).cumsum(dim).flip(dim)


def scatter_back(g, indices, x, dim, keepdim=True):
    """``g`` put back at ``indices`` along ``dim`` of a zero tensor shaped like ``x``."""
    if x.dim() == 0:
        return g
    if not keepdim:
        g, indices = g.unsqueeze(dim), indices.unsqueeze(dim)
    return torch.zeros_like(x).scatter(dim, indices, g)


def add(*gs):
    gs = [g for g in gs if g is not None]
    return None if not gs else gs[0] if len(gs) == 1 else gs[0] + gs[1]


# --- sums and means --------------------------------------------------------------------------


@vjp_rule(aten.sum.default)
def sum_(ct, out, x, dtype=None):
    return expand_as(ct, x)


@vjp_rule(aten.sum.dim_IntList)
def sum_dim(ct, out, x, dim, keepdim=False, dtype=None):
    return expand_as(restore(ct, x, dim, keepdim), x)


@vjp_rule(aten.nansum.default)
def nansum(ct, out, x, dim=None, keepdim=False, dtype=None):
    return cast(restore(ct, x, dim, keepdim), x).masked_fill(x.isnan(), 0)


@vjp_rule(aten.mean.default)
def mean(ct, out, x, dtype=None):
    return expand_as(ct / _at_least_one(x.numel()), x)


@vjp_rule(aten.mean.dim)
def mean_dim(ct, out, x, dim, keepdim=False, dtype=None):
    return expand_as(restore(ct / _at_least_one(numel(x, dim)), x, dim, keepdim), x)


@vjp_rule(aten.nanmean.default)
def nanmean(ct, out, x, dim=None, keepdim=False, dtype=None):
    nan = x.isnan()
    count = sum_keep(~nan, x, dim)
    return cast(restore(ct, x, dim, keepdim) / count, x).masked_fill(nan, 0)


@vjp_rule(aten.trace)
def trace(ct, out, x):
    return ct * torch.eye(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)


# --- products -------------------------------------------------------------------------------


def _others_product(x, d):
    """The product of the other elements along ``d``, computed as autograd does (the product of
    those before times the product of those after), so ``0 * inf`` gives NaN where it does there."""
    n = x.shape[d]
    ones = torch.ones_like(x.narrow(d, 0, 1))
    before = torch.cat([ones, x.narrow(d, 0, n - 1)], d).cumprod(d)
    after = torch.cat([ones, x.narrow(d, 1, n - 1).flip(d)], d).cumprod(d).flip(d)
    return before * after


def _prod_grad(ct, out, x, dim, keepdim):
    """autograd's ``prod_backward``, zeros, infs and NaNs included: ``out / x`` when no element is
    0 (NaN at an inf, as there); else the product of the others, along ``dim`` as soon as any
    element of ``x`` is 0, and for the product of all elements only when exactly one is (several
    zeros make every such product 0, which autograd returns without computing it)."""
    if x.dim() == 0:
        return cast(ct, x)
    out, ct = restore(out, x, dim, keepdim), restore(ct, x, dim, keepdim)
    if guard_or_false(x.numel() == 0):  # an unbacked size (after masked_select) takes the general path
        return cast(ct * (out / x), x)
    zero = x == 0
    quotient = out / torch.where(zero, 1, x)  # finite where unused, so its own derivative is too
    if dim is None:
        zeros = zero.sum()
        others = _others_product(x.reshape(-1), 0).reshape(x.shape)
        # with several zeros the others' products are 0, but not their derivatives (kept for hvp);
        # 0 * inf among them would be NaN where autograd gives 0
        factor = torch.where(zeros == 0, quotient, torch.where((zeros == 1) | x.isfinite().all(), others, 0))
    else:
        factor = torch.where(zero.any(), _others_product(x, dims_of(x, dim)[0]), quotient)
    return cast(ct * factor, x)


@vjp_rule(aten.prod.default)
def prod(ct, out, x, dtype=None):
    return _prod_grad(ct, out, x, None, False)


@vjp_rule(aten.prod.dim_int)
def prod_dim(ct, out, x, dim, keepdim=False, dtype=None):
    return _prod_grad(ct, out, x, dim, keepdim)


@vjp_rule(aten.cumsum.default)
def cumsum(ct, out, x, dim, dtype=None):
    return cast(rev_cumsum(ct, dim) if x.dim() else ct, x)


def _suffix_recurrence(ct, factors, d):
    """``q_i = ct_i + f_i q_{i+1}`` along ``d`` (``factors`` holds ``f_0 ... f_{n-2}``), by a doubling
    scan: ``ceil(log2 n)`` steps, each adding ``a_i q_{i+s}`` where ``a_i = f_i ... f_{i+s-1}``.
    ``O(n log n)`` work, ``O(n)`` memory; slices, not padding, so no ``inf * 0`` past the end."""
    n = ct.shape[d]
    q, a, s = ct, factors, 1
    while s < n:
        q = torch.cat([q.narrow(d, 0, n - s) + a * q.narrow(d, s, n - s), q.narrow(d, n - s, s)], d)
        a = a.narrow(d, 0, n - 2 * s) * a.narrow(d, s, n - 2 * s) if 2 * s < n else a
        s *= 2
    return q


def _kinds(t):
    """Per element: is it NaN, 0, ±inf (a trailing dim of 3)."""
    return torch.stack([t.isnan(), t == 0, t.isinf()], -1).int()


def _special_sums(ct, x, d):
    """Where ``sum_{j >= i} ct_j prod_{l <= j, l != i} x_l``, summed term by term as autograd's double
    backward sums it, is NaN, +inf or -inf (ignoring overflow): a term is NaN with a NaN or with both
    a 0 and an inf among its factors, else ±inf with an inf (minus for an odd count of sign bits).
    Counted for every kind of ``x_i`` (NaN, 0, inf) left out, then the one of ``x_i`` is picked."""
    own = _kinds(x)
    left_out = (own.cumsum(d) + _kinds(ct)).unsqueeze(-2) - torch.eye(3, dtype=own.dtype, device=x.device) > 0
    nan = left_out[..., 0] | (left_out[..., 1] & left_out[..., 2])
    inf = left_out[..., 2] & ~nan
    minus = ((x.signbit().int().cumsum(d) + ct.signbit().int()) % 2 == 1).unsqueeze(-1)
    flags = rev_cumsum(torch.stack([nan, inf & ~minus, inf & minus], -1).int(), d) > 0  # some j >= i
    nan, plus, minus = (flags & own.bool().unsqueeze(-1)).any(-2).unbind(-1)
    plus, minus = torch.where(x.signbit(), minus, plus), torch.where(x.signbit(), plus, minus)
    return nan | (plus & minus), plus, minus


@vjp_rule(aten.cumprod.default)
def cumprod(ct, out, x, dim, dtype=None):
    """``grad_i = sum_{j >= i} ct_j prod_{l <= j, l != i} x_l``: autograd's ``rev_cumsum(ct * out) / x``
    where ``x_i`` is finite and nonzero (the same value, and the same NaNs and infs, as the sum) or
    the tensor holds no zero (autograd's choice); elsewhere without dividing, the product of the
    elements before ``i`` times ``_suffix_recurrence`` (``O(n log n)`` work, ``O(n)`` memory), whose
    own derivative is cumprod's second one at zeros (hvp), with the NaNs and infs of autograd's
    term-by-term sum (``_special_sums``) where an inf or NaN is about."""
    if x.dim() == 0 or x.shape[dim] == 1 or x.numel() == 0:
        return cast(ct, x)
    d, n = dim % x.dim(), x.shape[dim]
    zero = x == 0
    quotient = rev_cumsum(ct * out, d) / torch.where(zero, 1, x)  # finite where unused: so is its derivative
    before = torch.cat([torch.ones_like(x.narrow(d, 0, 1)), x.narrow(d, 0, n - 1)], d).cumprod(d)
    products = before * _suffix_recurrence(ct, x.narrow(d, 1, n - 1), d)
    if not x.is_complex():
        nan, plus, minus = _special_sums(ct, x, d)
        products = products.masked_fill(plus, math.inf).masked_fill(minus, -math.inf).masked_fill(nan, math.nan)
    summed = torch.where(x.isfinite() & ~zero, quotient, products) + 0.0  # +0.0 where autograd's sums give it
    return cast(torch.where(zero.any(), summed, quotient), x)


@vjp_rule(aten.logcumsumexp.default, complex="real")
def logcumsumexp(ct, out, x, dim):
    """``grad_i = sum_{j >= i} ct_j exp(x_i - out_j)``, linear in ``ct`` (its transpose is the JVP):
    ``exp(x_i - out_i) r_i`` with ``r_i = ct_i + exp(out_i - out_{i+1}) r_{i+1}``, whose factors are
    at most 1 (``out`` grows along the line), so nothing overflows at any magnitude."""
    if x.dim() == 0 or x.numel() == 0:
        return ct
    d, n = dim % x.dim(), x.shape[dim]
    decay = torch.exp(out.narrow(d, 0, n - 1) - out.narrow(d, 1, n - 1))
    return torch.exp(x - out) * _suffix_recurrence(ct, decay, d) + 0.0  # autograd never gives -0.0


@vjp_rule(aten.logsumexp.default)
def logsumexp(ct, out, x, dim, keepdim=False):
    return restore(ct, x, dim, keepdim) * torch.exp(x - restore(out, x, dim, keepdim))


# --- max, min and friends -------------------------------------------------------------------


@vjp_rule(aten.amax.default)
def amax(ct, out, x, dim=(), keepdim=False):
    mask = x == restore(out, x, dim, keepdim)
    return restore(ct, x, dim, keepdim) / sum_keep(mask, x, dim) * mask


@vjp_rule(aten.amin.default)
def amin(ct, out, x, dim=(), keepdim=False):
    return amax(ct, out, x, dim, keepdim)


@vjp_rule(aten.aminmax.default)
def aminmax(ct, out, x, *, dim=None, keepdim=False):
    return add(*(amax(c, o, x, dim, keepdim) if c is not None else None for c, o in zip(ct, out)))


@vjp_rule(aten.max.default)
def max_(ct, out, x):
    """``ct`` split evenly between the elements equal to ``out``, or between the NaNs when there
    are any (then ``out`` is NaN), as autograd does."""
    return _split_evenly(ct, torch.logical_or(x == out, torch.isnan(x)))


def _split_evenly(ct, mask):
    return torch.where(mask, ct / mask.sum(), 0)


@vjp_rule(aten.min.default)
def min_(ct, out, x):
    return max_(ct, out, x)


@vjp_rule(aten.median.default)
def median(ct, out, x):
    return max_(ct, out, x)


@vjp_rule(aten.nanmedian.default)
def nanmedian(ct, out, x):
    """As ``max_``, but NaNs are skipped unless they are all there is (then ``out`` is NaN)."""
    return _split_evenly(ct, torch.logical_or(x == out, torch.logical_and(torch.isnan(x), torch.isnan(out))))


@vjp_rule(aten.max.dim)
def max_dim(ct, out, x, dim, keepdim=False):
    return scatter_back(ct[0], out[1], x, dim, keepdim)


for _op in (aten.min.dim, aten.median.dim, aten.nanmedian.dim):
    vjp_rule(_op)(max_dim)


@vjp_rule(aten.mode.default)
def mode(ct, out, x, dim=-1, keepdim=False):
    return scatter_back(ct[0], out[1], x, dim, keepdim)


@vjp_rule(aten.kthvalue.default)
def kthvalue(ct, out, x, k, dim=-1, keepdim=False):
    return scatter_back(ct[0], out[1], x, dim, keepdim)


@vjp_rule(aten.sort.default)
def sort(ct, out, x, dim=-1, descending=False):
    return scatter_back(ct[0], out[1], x, dim)


@vjp_rule(aten.sort.stable)
def sort_stable(ct, out, x, *, stable=None, dim=-1, descending=False):
    return scatter_back(ct[0], out[1], x, dim)


@vjp_rule(aten.topk.default)
def topk(ct, out, x, k, dim=-1, largest=True, sorted=True):
    return scatter_back(ct[0], out[1], x, dim)


@vjp_rule(aten.cummax.default)
def cummax(ct, out, x, dim):
    if x.dim() == 0:
        return ct[0]
    return torch.zeros_like(x).scatter_add(dim, out[1], ct[0])


@vjp_rule(aten.cummin.default)
def cummin(ct, out, x, dim):
    return cummax(ct, out, x, dim)


# --- variance and norms ---------------------------------------------------------------------


def _var_grad(ct, x, dim, correction, keepdim, scale=2.0):
    """``scale * ct * (x - mean) / (n - correction)``: var's VJP (scale 2), or std's given ct / std."""
    if ct is None:
        return None
    dof = numel(x, dim) - (1 if correction is None else correction)
    centered = x - x.mean() if is_full(x, dim) else x - x.mean(dims_of(x, dim), keepdim=True)
    return restore(ct / (dof / scale) if scale != 1 else ct / dof, x, dim, keepdim) * centered


def _std_grad(ct, std, x, dim, correction, keepdim):
    if ct is None:
        return None
    return _var_grad(_over_nonzero(ct, std), x, dim, correction, keepdim, scale=1.0)


def _mean_grad(ct, x, dim, keepdim):
    return None if ct is None else expand_as(restore(ct / _at_least_one(numel(x, dim)), x, dim, keepdim), x)


def _correction(unbiased):
    return 1 if unbiased else 0


@vjp_rule(aten.var.correction, complex="convention")
def var(ct, out, x, dim=None, *, correction=None, keepdim=False):
    return _var_grad(ct, x, dim, correction, keepdim)


@vjp_rule(aten.var.dim, complex="convention")
def var_dim(ct, out, x, dim, unbiased=True, keepdim=False):
    return _var_grad(ct, x, dim, _correction(unbiased), keepdim)


@vjp_rule(aten.var.default, complex="convention")
def var_all(ct, out, x, unbiased=True):
    return _var_grad(ct, x, None, _correction(unbiased), False)


@vjp_rule(aten.std.correction, complex="convention")
def std(ct, out, x, dim=None, *, correction=None, keepdim=False):
    return _std_grad(ct, out, x, dim, correction, keepdim)


@vjp_rule(aten.std.dim, complex="convention")
def std_dim(ct, out, x, dim, unbiased=True, keepdim=False):
    return _std_grad(ct, out, x, dim, _correction(unbiased), keepdim)


@vjp_rule(aten.std.default, complex="convention")
def std_all(ct, out, x, unbiased=True):
    return _std_grad(ct, out, x, None, _correction(unbiased), False)


@vjp_rule(aten.var_mean.correction, complex="convention")
def var_mean(ct, out, x, dim=None, *, correction=None, keepdim=False):
    return add(_var_grad(ct[0], x, dim, correction, keepdim), _mean_grad(ct[1], x, dim, keepdim))


@vjp_rule(aten.var_mean.dim, complex="convention")
def var_mean_dim(ct, out, x, dim, unbiased=True, keepdim=False):
    return var_mean(ct, out, x, dim, correction=_correction(unbiased), keepdim=keepdim)


@vjp_rule(aten.var_mean.default, complex="convention")
def var_mean_all(ct, out, x, unbiased=True):
    return var_mean(ct, out, x, None, correction=_correction(unbiased))


@vjp_rule(aten.std_mean.correction, complex="convention")
def std_mean(ct, out, x, dim=None, *, correction=None, keepdim=False):
    return add(_std_grad(ct[0], out[0], x, dim, correction, keepdim), _mean_grad(ct[1], x, dim, keepdim))


@vjp_rule(aten.std_mean.dim, complex="convention")
def std_mean_dim(ct, out, x, dim, unbiased=True, keepdim=False):
    return std_mean(ct, out, x, dim, correction=_correction(unbiased), keepdim=keepdim)


@vjp_rule(aten.std_mean.default, complex="convention")
def std_mean_all(ct, out, x, unbiased=True):
    return std_mean(ct, out, x, None, correction=_correction(unbiased))


def _over_nonzero(ct, norm):
    """``ct / norm``, 0 where the norm (a std, a distance) is 0 (PyTorch's convention), dividing by
    1 there so that the rule's transpose (jvp) and derivative (hvp) stay finite too."""
    zero = norm == 0
    return (ct / torch.where(zero, 1, norm)).masked_fill(zero, 0)


def _norm_grad(ct, norm, x, p, dim, keepdim):
    p = 2.0 if p is None else float(p)
    if p == 0:
        return None
    if p == 1:
        return cast(sign(x) * restore(ct, x, dim, keepdim), x)
    if p == 2:
        return cast(x * restore(_over_nonzero(ct, norm), x, dim, keepdim), x)
    ct, norm = restore(ct, x, dim, keepdim), restore(norm, x, dim, keepdim)
    if math.isinf(p):
        mask = x.abs() == norm
        return cast(sign(x) * (ct / sum_keep(mask, x, dim) * mask), x)
    if p < 1:
        return cast(sign(x) * power(x.abs(), p - 1).masked_fill(x == 0, 0) * (ct * power(norm, 1 - p)), x)
    return cast(x * power(x.abs(), p - 2) * _over_nonzero(ct, power(norm, p - 1)), x)


@vjp_rule(aten.linalg_vector_norm.default, complex="convention")
def linalg_vector_norm(ct, out, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    return _norm_grad(ct, out, x, ord, dim, keepdim)


@vjp_rule(aten._cdist_forward.default)
def _cdist_forward(ct, out, x1, x2, p, compute_mode=None):
    """PyTorch's ``_cdist_backward``, in torch ops: that op has no derivative (hvp, jvp) and its vmap
    (jacrev) returns wrong values. Per pair, the gradient of ``|x1_i - x2_j|_p`` with PyTorch's
    conventions (0 where the distance is 0; p = inf: every coordinate at the maximum)."""
    if p == 0:
        return torch.zeros_like(x1), torch.zeros_like(x2)
    if p == 2:
        w = _over_nonzero(ct, out)
        g1 = w.sum(-1, keepdim=True) * x1 - w @ x2
        g2 = w.sum(-2).unsqueeze(-1) * x2 - w.transpose(-1, -2) @ x1
        return g1.sum_to_size(x1.shape), g2.sum_to_size(x2.shape)
    diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)
    ct, dist = ct.unsqueeze(-1), out.unsqueeze(-1)
    if p == 1:
        g = ct * torch.sign(diff)
    elif math.isinf(p):
        g = ct * torch.sign(diff) * (diff.abs() == dist)
    elif p < 2:
        g = torch.sign(diff) * torch.where(diff == 0, 1, diff.abs()).pow(p - 1) * _over_nonzero(ct, dist.pow(p - 1))
    else:
        g = diff * diff.abs().pow(p - 2) * _over_nonzero(ct, dist.pow(p - 1))
    return g.sum(-2).sum_to_size(x1.shape), (-g.sum(-3)).sum_to_size(x2.shape)


mark_nondifferentiable(aten.count_nonzero, aten.argmax, aten.argmin, aten.any, aten.all, aten.argsort)
