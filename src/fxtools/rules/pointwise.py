"""VJP rules of elementwise ops: each cotangent is the output cotangent times a local derivative.

Binary ops broadcast, so their cotangents are reduced back to each input's shape
(``unbroadcast``). Python-number and integer arguments get no cotangent. At points where an op
is not differentiable (``abs`` at 0, ``relu`` at 0, ``clamp`` at its bounds, ties of
``maximum``) the rules pick the same one-sided derivative as ``torch.autograd``.

Complex tensors: the rules are the real formulas, and ``vjp_rule`` hands holomorphic ones (all
but those saying ``complex="convention"``) conjugated arguments, so ``mul``'s ``ct * y`` becomes
autograd's ``ct * y.conj()`` (see ``fxtools.registry``). ``abs``, ``sgn``, ``angle`` and
``conj_physical`` are not holomorphic and compute autograd's convention themselves.
"""

from __future__ import annotations

import cmath
import math

import torch

from ..registry import mark_nondifferentiable, register_vjp, vjp_rule
from .common import cast_cotangent, is_tensor, unbroadcast

aten = torch.ops.aten

_LN2 = math.log(2.0)
_LN10 = math.log(10.0)
_SQRT_PI = math.sqrt(math.pi)
_SQRT_2PI = math.sqrt(2 * math.pi)
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _diff(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _scaled(ct, c):
    return ct if c == 1 else ct * c


def _keep(mask, ct, like=None):
    """``ct`` where ``mask`` holds, zero elsewhere (reduced to ``like``'s shape if given)."""
    g = torch.where(mask, ct, 0)
    return g if like is None else unbroadcast(g, like)


def _drop(mask, ct):
    """Zero where ``mask`` holds, ``ct`` elsewhere: written with the comparison autograd's kernel
    makes (``x <= 0``), so that at NaN, where every comparison is false, ``ct`` passes as in autograd.
    (Autograd's vectorised CPU loops disagree with its own scalar code at NaN for some activations:
    hardtanh gives 0 on 8 or more float64 elements, 1 on fewer and on GPU; the rules follow the
    scalar code.)"""
    return torch.where(mask, 0, ct)


# Unary math.


@vjp_rule(aten.sin)
def sin(ct, out, x):
    return ct * torch.cos(x)


@vjp_rule(aten.cos)
def cos(ct, out, x):
    return -ct * torch.sin(x)


@vjp_rule(aten.tan)
def tan(ct, out, x):
    return ct * (1 + out * out)


@vjp_rule(aten.asin)
def asin(ct, out, x):
    return ct * torch.rsqrt(1 - x * x)


@vjp_rule(aten.acos)
def acos(ct, out, x):
    return -ct * torch.rsqrt(1 - x * x)


@vjp_rule(aten.atan)
def atan(ct, out, x):
    return ct / (1 + x * x)


@vjp_rule(aten.sinh)
def sinh(ct, out, x):
    return ct * torch.cosh(x)


@vjp_rule(aten.cosh)
def cosh(ct, out, x):
    return ct * torch.sinh(x)


@vjp_rule(aten.tanh)
def tanh(ct, out, x):
    return ct * (1 - out * out)


@vjp_rule(aten.asinh)
def asinh(ct, out, x):
    return ct * torch.rsqrt(x * x + 1)


@vjp_rule(aten.acosh)
def acosh(ct, out, x):
    return ct * torch.rsqrt(x * x - 1)


@vjp_rule(aten.atanh)
def atanh(ct, out, x):
    return ct / (1 - x * x)


@vjp_rule(aten.exp)
def exp(ct, out, x):
    return ct * out


@vjp_rule(aten.exp2)
def exp2(ct, out, x):
    return ct * out * _LN2


@vjp_rule(aten.expm1)
def expm1(ct, out, x):
    return ct * (out + 1)


@vjp_rule(aten.log)
def log(ct, out, x):
    return ct / x


@vjp_rule(aten.log2)
def log2(ct, out, x):
    return ct / (x * _LN2)


@vjp_rule(aten.log10)
def log10(ct, out, x):
    return ct / (x * _LN10)


@vjp_rule(aten.log1p)
def log1p(ct, out, x):
    return ct / (x + 1)


@vjp_rule(aten.sqrt)
def sqrt(ct, out, x):
    return ct / (2 * out)


@vjp_rule(aten.rsqrt)
def rsqrt(ct, out, x):
    return -0.5 * ct * out.pow(3)


@vjp_rule(aten.reciprocal)
def reciprocal(ct, out, x):
    return -ct * out * out


@vjp_rule(aten.square)
def square(ct, out, x):
    return ct * (2 * x)


@vjp_rule(aten.abs, complex="convention")
def abs(ct, out, x):
    return ct * (torch.sgn(x) if x.is_complex() else torch.sign(x))


@vjp_rule(aten.sgn, complex="convention")
def sgn(ct, out, x):
    """``sgn(z) = z / |z|`` moves only along the circle: ``(ct - s Re(s̄ ct)) / |z|``, 0 at 0."""
    if not x.is_complex():
        return None
    r = x.abs()
    g = (ct - out * torch.real(out.conj() * ct)) / r
    return torch.where(r == 0, 0, g)


@vjp_rule(aten.neg)
def neg(ct, out, x):
    return -ct


@vjp_rule(aten.frac)
def frac(ct, out, x):
    return ct


@vjp_rule(aten.deg2rad)
def deg2rad(ct, out, x):
    return ct * (math.pi / 180)


@vjp_rule(aten.rad2deg)
def rad2deg(ct, out, x):
    return ct * (180 / math.pi)


@vjp_rule(aten.angle, complex="convention")
def angle(ct, out, x):
    """``d angle(z) = Im(z̄ dz) / |z|²``: the gradient is ``ct * i z / |z|²`` (0 at 0; none for reals)."""
    if not x.is_complex():
        return None
    return torch.where(x == 0, 0, ct * x * 1j / (x * x.conj()).real)


@vjp_rule(aten.nan_to_num)
def nan_to_num(ct, out, x, nan=None, posinf=None, neginf=None):
    return _keep(torch.isfinite(x), ct)


@vjp_rule(aten.sigmoid)
def sigmoid(ct, out, x):
    return ct * out * (1 - out)


@vjp_rule(aten.logit)
def logit(ct, out, x, eps=None):
    lo, hi = (0, 1) if eps is None else (eps, 1 - eps)
    d = x * (1 - x)
    g = ct / (d.abs() if eps is None else d)  # autograd: +inf at -0.0 too (the kernel tests x == 0)
    return torch.where(torch.logical_and(x >= lo, x <= hi), g, math.nan if eps is None else 0)


@vjp_rule(aten.erf)
def erf(ct, out, x):
    return ct * torch.exp(-x * x) * (2 / _SQRT_PI)


@vjp_rule(aten.erfc)
def erfc(ct, out, x):
    return ct * torch.exp(-x * x) * (-2 / _SQRT_PI)


@vjp_rule(aten.erfinv)
def erfinv(ct, out, x):
    return ct * torch.exp(out * out) * (_SQRT_PI / 2)


@vjp_rule(aten.special_erfcx)
def erfcx(ct, out, x):
    return ct * (2 * x * out - 2 / _SQRT_PI)


@vjp_rule(aten.special_ndtr)
def ndtr(ct, out, x):
    return ct * torch.exp(-0.5 * x * x) / _SQRT_2PI


@vjp_rule(aten.special_ndtri)
def ndtri(ct, out, x):
    return ct * torch.exp(0.5 * out * out) * _SQRT_2PI


@vjp_rule(aten.special_log_ndtr)
def log_ndtr(ct, out, x):
    return ct * torch.exp(-0.5 * x * x - out) / _SQRT_2PI


@vjp_rule(aten.lgamma)
def lgamma(ct, out, x):
    return ct * torch.digamma(x)


@vjp_rule(aten.digamma)
def digamma(ct, out, x):
    return ct * torch.polygamma(1, x)


@vjp_rule(aten.polygamma)
def polygamma(ct, out, n, x):
    return None, ct * torch.polygamma(n + 1, x)


@vjp_rule(aten.mvlgamma)
def mvlgamma(ct, out, x, p):
    offsets = torch.arange(1 - p, 1, dtype=x.dtype, device=x.device) / 2  # x + 0.0, as autograd: +0.0 at -0.0
    return ct * torch.digamma(x.unsqueeze(-1) + offsets).sum(-1)


@vjp_rule(aten.special_entr)
def entr(ct, out, x):
    return -ct * (torch.log(x) + 1)


@vjp_rule(aten.i0)
def i0(ct, out, x):
    return ct * torch.special.i1(x)


@vjp_rule(aten.special_i0e)
def i0e(ct, out, x):
    return ct * (torch.special.i1e(x) - torch.sign(x) * out)


def _away_from_zero(x):
    eps = torch.finfo(x.dtype).eps
    big = x.abs() > eps
    return big, torch.where(big, x, eps)


@vjp_rule(aten.special_i1)
def i1(ct, out, x):
    big, x = _away_from_zero(x)
    return ct * torch.where(big, torch.special.i0(x) - out / x, 0.5)


@vjp_rule(aten.special_i1e)
def i1e(ct, out, x):
    big, x = _away_from_zero(x)
    return ct * torch.where(big, torch.special.i0e(x) - out * (torch.sign(x) + 1 / x), 0.5)


@vjp_rule(aten.sinc)
def sinc(ct, out, x):
    zero = x == 0  # x divided by is 1 there, so differentiating again sends 0 through, not 0 * inf
    return torch.where(zero, 0, ct * (torch.cos(math.pi * x) - out) / torch.where(zero, 1, x))


@vjp_rule(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(ct, out, x, exponent):
    if exponent == 0:
        return None
    if exponent == 1:
        return ct
    if exponent == 2:
        return ct * (2 * x)
    return ct * (exponent * x.pow(exponent - 1))


@vjp_rule(aten.pow.Tensor_Tensor)
def pow_tensor_tensor(ct, out, x, exponent):
    # autograd's formulas: the cotangent times a masked coefficient (not the masked product), so
    # that the JVP, this rule transposed, masks the coefficient too: no 0 * log(0) = NaN at x = 0
    gx = ct * torch.where(exponent == 0, 0, exponent * x.pow(exponent - 1))
    ge = ct * torch.where(torch.logical_and(x == 0, _real(exponent) >= 0), 0, out * torch.log(x)) if _diff(exponent) else None
    return unbroadcast(gx, x), unbroadcast(ge, exponent)


def _real(t):
    return t.real if t.is_complex() else t


@vjp_rule(aten.pow.Scalar)
def pow_scalar(ct, out, base, exponent):
    if base == 0:
        return None, ct * torch.where(_real(exponent) >= 0, 0, out * -math.inf)  # masked coefficient: see pow_tensor_tensor
    if isinstance(base, complex) or exponent.is_complex():
        # log of the conjugated base (a real one is not conjugated by vjp_rule): -0.0 picks the
        # conjugate's side of the branch cut for a negative base
        return None, ct * out * cmath.log(base if isinstance(base, complex) else complex(base, -0.0))
    return None, ct * out * (math.log(base) if base > 0 else math.nan)


@vjp_rule(aten.float_power.Tensor_Scalar)
def float_power(ct, out, x, exponent):
    return pow_tensor_scalar(ct, out, x.to(out.dtype), exponent)


mark_nondifferentiable(
    aten.sign,
    aten.floor,
    aten.ceil,
    aten.round,
    aten.trunc,
    aten.fix,
    aten.floor_divide,
    aten.signbit,
    aten.eq,
    aten.ne,
    aten.lt,
    aten.le,
    aten.gt,
    aten.ge,
    aten.isnan,
    aten.isinf,
    aten.isfinite,
    aten.isposinf,
    aten.isneginf,
    aten.logical_and,
    aten.logical_or,
    aten.logical_not,
    aten.logical_xor,
)


# Arithmetic.


@vjp_rule(aten.add)
def add(ct, out, x, y, alpha=1):
    return unbroadcast(ct, x), unbroadcast(_scaled(ct, alpha), y) if is_tensor(y) else None


@vjp_rule(aten.sub)
def sub(ct, out, x, y, alpha=1):
    return unbroadcast(ct, x), unbroadcast(-ct if alpha == 1 else ct * -alpha, y) if is_tensor(y) else None


@vjp_rule(aten.rsub)
def rsub(ct, out, x, y, alpha=1):
    return unbroadcast(-ct if alpha == 1 else ct * -alpha, x), unbroadcast(ct, y)


@vjp_rule(aten.mul)
def mul(ct, out, x, y):
    return (unbroadcast(ct * y, x) if is_tensor(x) else None, unbroadcast(ct * x, y) if is_tensor(y) else None)


@vjp_rule(aten.div)
def div(ct, out, x, y, rounding_mode=None):
    if rounding_mode is not None:
        return None, None
    gx = ct / y
    return unbroadcast(gx, x), unbroadcast(-gx * out, y) if is_tensor(y) else None


@vjp_rule(aten.addcmul)
def addcmul(ct, out, x, t1, t2, value=1):
    return unbroadcast(ct, x), unbroadcast(_scaled(ct * t2, value), t1), unbroadcast(_scaled(ct * t1, value), t2)


@vjp_rule(aten.addcdiv)
def addcdiv(ct, out, x, t1, t2, value=1):
    g1 = _scaled(ct, value) / t2
    return unbroadcast(ct, x), unbroadcast(g1, t1), unbroadcast(-g1 * t1 / t2, t2)


@vjp_rule(aten.lerp)
def lerp(ct, out, start, end, weight):
    ge = ct * weight
    gw = unbroadcast(ct * (end - start), weight) if is_tensor(weight) else None
    return unbroadcast(ct - ge, start), unbroadcast(ge, end), gw


@vjp_rule(aten.remainder)
def remainder(ct, out, x, y):
    gy = -ct * torch.div(x, y, rounding_mode="floor") if _diff(y) else None
    return unbroadcast(ct, x), unbroadcast(gy, y)


@vjp_rule(aten.fmod)
def fmod(ct, out, x, y):
    gy = -ct * torch.div(x, y, rounding_mode="trunc") if _diff(y) else None
    return unbroadcast(ct, x), unbroadcast(gy, y)


@vjp_rule(aten.atan2)
def atan2(ct, out, y, x):
    r = x * x + y * y
    g = torch.where(r == 0, 0, ct / r)
    return unbroadcast(g * x, y), unbroadcast(-g * y, x)


@vjp_rule(aten.hypot)
def hypot(ct, out, x, y):
    g = ct / out
    return unbroadcast(g * x, x), unbroadcast(g * y, y)


@vjp_rule(aten.copysign)
def copysign(ct, out, x, y):
    zero = x == 0  # as sinc: a second derivative 0, not 0 * inf, at 0
    return unbroadcast(torch.where(zero, 0, ct * (out / torch.where(zero, 1, x))), x), None


@vjp_rule(aten.nextafter)
def nextafter(ct, out, x, y):
    return _keep(x != y, ct, x), None


@vjp_rule(aten.ldexp)
def ldexp(ct, out, x, e):
    ge = ct * out * _LN2 if _diff(e) else None
    return unbroadcast(ct * torch.exp2(e if _diff(e) else e.to(out.dtype)), x), unbroadcast(ge, e)


@vjp_rule(aten.frexp)
def frexp(ct, out, x):
    return ct[0] / torch.exp2(out[1].to(out[0].dtype))


@vjp_rule(aten.logaddexp)
def logaddexp(ct, out, x, y):
    """Autograd's ``ct / (1 + exp(y - x))``, as a sigmoid: 1 at ``(inf, 0)``, where ``exp(x - out)`` is NaN."""
    return unbroadcast(ct * torch.sigmoid(x - y), x), unbroadcast(ct * torch.sigmoid(y - x), y)


@vjp_rule(aten.logaddexp2)
def logaddexp2(ct, out, x, y):
    """Autograd's formula, finite at ``(inf, 0)`` (see ``logaddexp``)."""
    return unbroadcast(ct / (1 + torch.exp2(y - x)), x), unbroadcast(ct / (1 + torch.exp2(x - y)), y)


def _xlog_self_grad(g, x, y, edge):
    """``g`` made 0 where ``x == 0`` and ``y <= edge``, as autograd does for xlogy and xlog1py."""
    if is_tensor(y):
        return torch.where(torch.logical_and(x == 0, y <= edge), 0, g)
    return torch.where(x == 0, 0, g) if y <= edge else g


@vjp_rule(aten.xlogy)
def xlogy(ct, out, x, y):
    gx = _xlog_self_grad(torch.xlogy(ct, y), x, y, 0) if is_tensor(x) else None
    gy = ct * x / y if is_tensor(y) else None
    return unbroadcast(gx, x), unbroadcast(gy, y)


@vjp_rule(aten.special_xlog1py)
def xlog1py(ct, out, x, y):
    gx = _xlog_self_grad(torch.special.xlog1py(ct, y), x, y, -1) if is_tensor(x) else None
    gy = ct * x / (y + 1) if is_tensor(y) else None
    return unbroadcast(gx, x), unbroadcast(gy, y)


# Selection: maximum, minimum, clamp, where.


def _tie_split(ct, x, y, x_loses, y_loses):
    half = torch.where(x == y, ct / 2, ct)
    return unbroadcast(torch.where(x_loses, 0, half), x), unbroadcast(torch.where(y_loses, 0, half), y)


@vjp_rule(aten.maximum)
def maximum(ct, out, x, y):
    return _tie_split(ct, x, y, x < y, x > y)


@vjp_rule(aten.minimum)
def minimum(ct, out, x, y):
    return _tie_split(ct, x, y, x > y, x < y)


@vjp_rule(aten.max.other)
def max_other(ct, out, x, y):
    return maximum(ct, out, x, y)


@vjp_rule(aten.min.other)
def min_other(ct, out, x, y):
    return minimum(ct, out, x, y)


@vjp_rule(aten.fmax)
def fmax(ct, out, x, y):
    x_wins = torch.logical_or(x >= y, torch.isnan(y))
    return _keep(x_wins, ct, x), unbroadcast(torch.where(x_wins, 0, ct), y)


@vjp_rule(aten.fmin)
def fmin(ct, out, x, y):
    x_wins = torch.logical_or(x <= y, torch.isnan(y))
    return _keep(x_wins, ct, x), unbroadcast(torch.where(x_wins, 0, ct), y)


def _inside(x, lo, hi):
    """Where ``lo <= x <= hi`` (either bound may be None)."""
    if lo is None:
        return x <= hi
    if hi is None:
        return x >= lo
    return torch.logical_and(x >= lo, x <= hi)


@vjp_rule(aten.clamp)
def clamp(ct, out, x, min=None, max=None):
    if min is None and max is None:
        return ct, None, None
    gx = _keep(_inside(x, min, max), ct, x)
    gmin = gmax = None
    if _diff(min):
        below = x < min if max is None else torch.logical_and(x < min, min < max)
        gmin = _keep(below, ct, min)
    if _diff(max):
        above = x > max if min is None else torch.logical_or(x > max, max < min)
        gmax = _keep(above, ct, max)
    return gx, gmin, gmax


@vjp_rule(aten.clip)
def clip(ct, out, x, min=None, max=None):
    return clamp(ct, out, x, min, max)


@vjp_rule(aten.clamp_min)
def clamp_min(ct, out, x, min):
    return _keep(x >= min, ct, x), _keep(x < min, ct, min) if _diff(min) else None


@vjp_rule(aten.clamp_max)
def clamp_max(ct, out, x, max):
    return _keep(x <= max, ct, x), _keep(x > max, ct, max) if _diff(max) else None


@vjp_rule(aten.where.self)
def where(ct, out, cond, x, y):
    gx = _keep(cond, ct, x) if is_tensor(x) else None
    gy = unbroadcast(torch.where(cond, 0, ct), y) if is_tensor(y) else None
    return None, gx, gy


for _overload in ("ScalarSelf", "ScalarOther"):
    vjp_rule(getattr(aten.where, _overload))(where)


# Activations.


@vjp_rule(aten.relu)
def relu(ct, out, x):
    return _drop(out <= 0, ct)


@vjp_rule(aten.threshold)
def threshold(ct, out, x, threshold, value):
    return _drop(x <= threshold, ct)


@vjp_rule(aten.hardtanh)
def hardtanh(ct, out, x, min_val=-1, max_val=1):
    return _drop(torch.logical_or(x <= min_val, x >= max_val), ct)


@vjp_rule(aten.relu6)
def relu6(ct, out, x):
    return hardtanh(ct, out, x, 0, 6)


@vjp_rule(aten.leaky_relu)
def leaky_relu(ct, out, x, negative_slope=0.01):
    return torch.where(x > 0, ct, ct * negative_slope)


def _rrelu_fwd(x, lower=1 / 8, upper=1 / 3, training=False, generator=None):
    """In training, eager PyTorch's kernel draws one uniform slope per element that is not positive
    (in order) and records every element's slope as its noise: the rule calls that kernel, so the
    same seed gives the same slopes as eager, and the noise is the derivative. The value is
    ``x * noise``, which is what the kernel computes (bitwise): PyTorch's autograd formula of the
    functional kernel's value reads uninitialised memory (2.13), and generated code may be run
    under autograd."""
    if training:
        _, noise = aten.rrelu_with_noise_functional(x, torch.empty_like(x), lower, upper, True)
        return x * noise, noise
    return aten.rrelu(x, lower, upper), (x, (lower + upper) / 2)


def _rrelu_bwd(aux, ct):
    if isinstance(aux, tuple):
        return leaky_relu(ct, None, *aux)
    return ct * aux


register_vjp(aten.rrelu, _rrelu_fwd, _rrelu_bwd, source="hand-written")


def _elu(ct, out, x, alpha, scale, input_scale):
    """At 0 the left first derivative and, as PyTorch's double backward, a zero second one."""
    neg = _scaled(ct * (out + alpha * scale), input_scale)
    return torch.where(x < 0, neg, torch.where(x == 0, _scaled(ct, alpha * scale * input_scale), _scaled(ct, scale)))


@vjp_rule(aten.elu)
def elu(ct, out, x, alpha=1, scale=1, input_scale=1):
    return _elu(ct, out, x, alpha, scale, input_scale)


@vjp_rule(aten.selu)
def selu(ct, out, x):
    return _elu(ct, out, x, _SELU_ALPHA, _SELU_SCALE, 1)


@vjp_rule(aten.celu)
def celu(ct, out, x, alpha=1.0):
    return _elu(ct, out, x, alpha, 1, 1 / alpha)


_GELU_K, _GELU_C = math.sqrt(2 / math.pi), 0.044715


def gelu_tanh_gate(x):
    """``s`` with ``gelu(x, approximate="tanh") = x * s``: ``sigmoid(2 k (x + c x^3))``, which is
    ``(1 + tanh(k (x + c x^3))) / 2``. One ``exp``: a compiler's vectorised ``tanh`` can cost
    several (Inductor's CPU one four), and ``x * s`` has no cancellation where ``1 + tanh`` has one."""
    return torch.sigmoid((x + x.pow(3) * _GELU_C) * (2 * _GELU_K))


def gelu_tanh_slope(x):
    """The derivative of ``gelu(x, approximate="tanh")``, from the gate ``s``: ``s + x s (1 - s) y'``."""
    s = gelu_tanh_gate(x)
    return s * (1 + x * (1 - s) * (x * x * (6 * _GELU_C * _GELU_K) + 2 * _GELU_K))


@vjp_rule(aten.gelu)
def gelu(ct, out, x, approximate="none"):
    if approximate == "tanh":
        return ct * gelu_tanh_slope(x)
    cdf = 0.5 * (1 + torch.erf(x * math.sqrt(0.5)))
    gauss = torch.exp(-0.5 * x * x)
    pdf = gauss / _SQRT_2PI
    x_pdf = x * pdf
    slope = cdf + x_pdf
    return ct * slope


@vjp_rule(aten.silu)
def silu(ct, out, x):
    s = torch.sigmoid(x)
    return ct * s * (1 + x * (1 - s))


@vjp_rule(aten.mish)
def mish(ct, out, x):
    t = torch.tanh(torch.nn.functional.softplus(x))
    return ct * (t + x * torch.sigmoid(x) * (1 - t * t))


@vjp_rule(aten.softplus)
def softplus(ct, out, x, beta=1, threshold=20):
    z = _scaled(x, beta)
    return torch.where(z > threshold, ct, ct * torch.sigmoid(z))


@vjp_rule(aten.log_sigmoid)
def log_sigmoid(ct, out, x):
    return ct * torch.sigmoid(-x)


@vjp_rule(aten.hardsigmoid)
def hardsigmoid(ct, out, x):
    return _keep(torch.logical_and(x > -3, x < 3), ct / 6)


@vjp_rule(aten.hardswish)
def hardswish(ct, out, x):
    return torch.where(x <= -3, 0, torch.where(x < 3, ct * (x / 3 + 0.5), ct))


@vjp_rule(aten.softshrink)
def softshrink(ct, out, x, lambd=0.5):
    return _drop(x.abs() <= lambd, ct)


@vjp_rule(aten.hardshrink)
def hardshrink(ct, out, x, lambd=0.5):
    return _drop(x.abs() <= lambd, ct)


@vjp_rule(aten.prelu)
def prelu(ct, out, x, weight):
    w = weight.reshape([-1] + [1] * (x.dim() - 2)) if weight.numel() > 1 and x.dim() > 2 else weight
    gx = unbroadcast(torch.where(x > 0, ct, ct * w), x)
    gw = torch.where(x > 0, 0, ct * x)
    gw = gw.sum() if weight.numel() == 1 else unbroadcast(gw, w)
    return gx, gw if gw.shape == weight.shape else gw.reshape(weight.shape)


# Copies and conversions: the cotangent passes through, cast back to the input's dtype.


def _identity(ct, out, x, *args, **kwargs):
    return ct


for _op in (aten.clone, aten.alias, aten.lift_fresh_copy, aten.contiguous, aten.positive, aten.resolve_conj, aten.resolve_neg):
    vjp_rule(_op)(_identity)


@vjp_rule(aten.conj_physical, complex="convention")
def conj_physical(ct, out, x):
    return ct.conj() if x.is_complex() else ct


def _cast_back(ct, out, x, *args, **kwargs):
    if ct.device != x.device:
        ct = ct.to(x.device)
    return cast_cotangent(ct, x.dtype)


for _op in (aten._to_copy, aten.to, aten.type_as):
    vjp_rule(_op)(_cast_back)


mark_nondifferentiable(aten.detach, aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like)
# Factories (no tensor input to differentiate) and runtime value checks.
# Random draws carry no gradient in autograd either (``bernoulli(p)``, ``normal(mean, std)``); kept as
# the ops eager PyTorch calls, they draw the same numbers as eager under the same seed.
mark_nondifferentiable(
    aten.empty,
    aten.empty_strided,
    aten.zeros,
    aten.ones,
    aten.full,
    aten.arange,
    aten.scalar_tensor,
    aten.rand,
    aten.randn,
    aten.randint,
    aten.normal,
    aten.normal_functional,
    aten.rand_like,
    aten.randn_like,
    aten.randint_like,
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.poisson,
    aten._assert_async,
    aten.sym_constrain_range_for_size,
)
