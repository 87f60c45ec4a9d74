"""Elementwise rules: agreement with autograd at special points, dtypes, and short generated code."""

import pytest
import torch
import torch.nn.functional as F

import fxtools
from fxtools.graph.nodes import count_compute_nodes
from fxtools.transforms.check import check_vjp, check_vjp_fd

aten = torch.ops.aten
D = torch.float64

# Points where an op is not differentiable: ties, zeros, clamp/threshold bounds, +-3 and 6.
KINKS = torch.tensor([-6.0, -3.0, -1.0, -0.5, 0.0, 0.0, 0.5, 1.0, 2.0, 3.0, 6.0, 7.0], dtype=D)
OTHER = torch.tensor([-6.0, -2.0, -1.0, 0.5, 0.0, 1.0, 0.5, -1.0, 2.0, 3.0, 5.0, 7.5], dtype=D)
UNIT = torch.tensor([0.0, 0.1, 0.25, 0.5, 0.9, 1.0], dtype=D)
POS = torch.tensor([0.25, 0.5, 1.0, 1.5, 2.0, 3.0], dtype=D)

SPECIAL = {
    "abs": (torch.abs, KINKS),
    "relu": (torch.relu, KINKS),
    "relu6": (F.relu6, KINKS),
    "hardtanh": (lambda x: F.hardtanh(x, -1.0, 2.0), KINKS),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), KINKS),
    "rrelu_eval": (lambda x: F.rrelu(x, 0.1, 0.3), KINKS),
    "threshold": (lambda x: F.threshold(x, 0.5, -2.0), KINKS),
    "elu": (lambda x: F.elu(x, 0.7), KINKS),
    "elu_scaled": (lambda x: aten.elu(x, 0.7, 1.3, 0.6), KINKS),
    "selu": (F.selu, KINKS),
    "celu": (lambda x: F.celu(x, 1.5), KINKS),
    "gelu": (F.gelu, KINKS),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), KINKS),
    "silu": (F.silu, KINKS),
    "mish": (F.mish, KINKS),
    "softplus": (lambda x: F.softplus(x, beta=2.0, threshold=6.0), KINKS),
    "logsigmoid": (F.logsigmoid, KINKS),
    "hardsigmoid": (F.hardsigmoid, KINKS),
    "hardswish": (F.hardswish, KINKS),
    "softshrink": (lambda x: F.softshrink(x, 1.0), KINKS),
    "hardshrink": (lambda x: F.hardshrink(x, 1.0), KINKS),
    "clamp": (lambda x: torch.clamp(x, -1.0, 3.0), KINKS),
    "clamp_min": (lambda x: torch.clamp(x, min=0.0), KINKS),
    "clamp_max": (lambda x: torch.clamp(x, max=0.5), KINKS),
    "clip": (lambda x: torch.clip(x, -0.5, 2.0), KINKS),
    "sinc": (torch.sinc, KINKS),
    "frac": (torch.frac, KINKS + 0.25),
    "nan_to_num": (torch.nan_to_num, torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -2.0], dtype=D)),
    "logit": (torch.logit, UNIT),
    "logit_eps": (lambda x: torch.logit(x, eps=0.1), UNIT),
    "pow_0": (lambda x: x**0, KINKS),
    "pow_1": (lambda x: x**1, KINKS),
    "pow_2": (lambda x: x**2, KINKS),
    "pow_3": (lambda x: x.pow(3), KINKS),
    "pow_half": (lambda x: x**0.5, POS),
    "rpow": (lambda x: 2.0**x, KINKS),
    "rpow_zero": (lambda x: torch.pow(0.0, x), KINKS),
    "float_power": (lambda x: torch.float_power(x, 2), KINKS),
    "exp2": (torch.exp2, KINKS),
    "expm1": (torch.expm1, KINKS),
    "log2": (torch.log2, POS),
    "log10": (torch.log10, POS),
    "log1p": (torch.log1p, POS),
    "rsqrt": (torch.rsqrt, POS),
    "erfinv": (torch.erfinv, UNIT[:-1] * 2 - 0.9),
    "i1": (torch.special.i1, KINKS),
    "i1e": (torch.special.i1e, KINKS),
    "i0e": (torch.special.i0e, KINKS),
    "deg2rad": (torch.deg2rad, KINKS),
    "rad2deg": (torch.rad2deg, KINKS),
    "mvlgamma": (lambda x: torch.mvlgamma(x, 3), POS + 1.5),
    "sign": (lambda x: torch.sign(x) * x, KINKS),
    "round": (lambda x: torch.round(x, decimals=1) + torch.floor(x) + x, KINKS + 0.123),
    "positive": (lambda x: torch.positive(x) * 2, KINKS),
    "clone": (lambda x: x.clone() * x, KINKS),
    "contiguous": (lambda x: x.t().contiguous() * 2, KINKS.reshape(3, 4)),
    "alias": (lambda x: aten.alias(x) * x, KINKS),
    "to_float32": (lambda x: x.to(torch.float32) * 2, KINKS),
    "_to_copy": (lambda x: aten._to_copy(x, dtype=torch.float32).sin(), KINKS),
}


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_unary_special_points(name):
    f, x = SPECIAL[name]
    check_vjp(f, x.clone())


BINARY = {
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "max_other": torch.max,
    "min_other": torch.min,
    "fmax": torch.fmax,
    "fmin": torch.fmin,
    "hypot": torch.hypot,
    "atan2": torch.atan2,
    "copysign": torch.copysign,
    "remainder": torch.remainder,
    "fmod": torch.fmod,
    "nextafter": torch.nextafter,
    "xlogy": torch.xlogy,
    "xlog1py": torch.special.xlog1py,
    "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2,
    "pow": lambda x, y: torch.pow(x.abs(), y),
    "where": lambda x, y: torch.where(x > y, x, y),
    "clamp_tensor": lambda x, y: torch.clamp(x, min=y, max=y + 1),
    "clamp_tensor_crossed": lambda x, y: torch.clamp(x, min=y, max=y - 1),
    "clamp_min_tensor": lambda x, y: torch.clamp_min(x, y),
    "clamp_max_tensor": lambda x, y: torch.clamp_max(x, y),
    "rsub": lambda x, y: torch.rsub(x, y, alpha=2),
    "sub_alpha": lambda x, y: torch.sub(x, y, alpha=3),
    "add_alpha": lambda x, y: torch.add(x, y, alpha=-0.5),
    "div_floor": lambda x, y: torch.div(x, y + 10, rounding_mode="floor") + x * y,
    "lerp_tensor": lambda x, y: torch.lerp(x, y, torch.sigmoid(x * y)),
    "addcmul": lambda x, y: torch.addcmul(x, y, x, value=0.5),
    "addcdiv": lambda x, y: torch.addcdiv(x, x, y + 10, value=2.0),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_special_points(name):
    check_vjp(BINARY[name], KINKS.clone(), OTHER.clone())


def test_binary_broadcasting():
    x, y = torch.randn(3, 1, 4, dtype=D), torch.randn(5, 1, dtype=D)
    for f in (
        torch.maximum,
        torch.hypot,
        torch.atan2,
        lambda a, b: torch.lerp(a, b, 0.3),
        lambda a, b: torch.where(a > 0, a, b),
        lambda a, b: torch.clamp(a, b, b + 1),
    ):
        check_vjp(f, x, y)


def test_scalar_overloads():
    x, c = torch.randn(6, dtype=D), torch.randn(6, dtype=D) > 0
    check_vjp(lambda x: aten.where.ScalarOther(c, x, 0.5) * x, x)
    check_vjp(lambda x: aten.where.ScalarSelf(c, 0.5, x) * x, x)
    check_vjp(lambda x: aten.mul.Scalar(x, 3.0) + aten.div.Scalar(x, 4.0), x)
    check_vjp(lambda x: aten.add.Scalar(x, 3.0) * aten.rsub.Scalar(x, 1.0, 2), x)
    check_vjp(lambda x: aten.pow.Scalar(3.0, x), x)
    check_vjp(lambda x: aten.remainder.Scalar(x, 0.7), x)
    check_vjp(lambda x: aten.xlogy.Scalar_Self(2.0, x.abs() + 0.1), x)
    check_vjp(lambda x, y: x.type_as(y) * 2, x.float(), x)
    z = torch.tensor([0.0, 1.0, 0.0, 2.5], dtype=D)
    check_vjp(lambda z: torch.xlogy(z, -1.0) + torch.special.xlog1py(z, 0.5), z)
    # autograd has no derivative for remainder(number, tensor)
    check_vjp_fd(lambda y: torch.remainder(2.5, y), torch.rand(4, dtype=D) + 0.5)


def test_prelu():
    x = torch.randn(2, 3, 4, dtype=D)
    x[0, 0, 0] = 0.0
    check_vjp(F.prelu, x, torch.rand(3, dtype=D))
    check_vjp(F.prelu, x, torch.rand(1, dtype=D))
    check_vjp(aten._prelu_kernel, x, torch.rand(3, 1, dtype=D))


def test_rrelu_training_uses_the_drawn_slopes():
    x = torch.randn(20, dtype=D)
    out, (g,) = fxtools.vjp(lambda x: F.rrelu(x, 0.1, 0.3, training=True), x)(x, torch.ones_like(x))
    assert torch.allclose(g, torch.where(x > 0, 1.0, out / x))
    assert ((g == 1) | ((g >= 0.1) & (g <= 0.3))).all()


def test_ldexp_frexp():
    x = torch.randn(5, dtype=D) * 100
    check_vjp(lambda x: torch.frexp(x).mantissa, x)
    check_vjp(torch.ldexp, x, torch.tensor([1, 2, 3, 0, 40]))
    check_vjp(torch.ldexp, x, torch.tensor([1.0, -2.0, 3.0, 0.0, 40.0], dtype=D))
    # autograd computes 2 ** e in integers here (2 ** -2 == 0): compare with finite differences
    check_vjp_fd(lambda x: torch.ldexp(x, torch.tensor([1, -2, 3, 0, -4])), torch.randn(5, dtype=D))


def _code(f, *args):
    return fxtools.vjp(f, *args)


def test_sin_plus_x_is_short():
    gm = _code(lambda x: torch.sin(x) + x, torch.randn(4))
    assert count_compute_nodes(gm) <= 5, gm.code


@pytest.mark.parametrize(
    "f, limit",
    [
        (torch.tanh, 4),
        (torch.sigmoid, 5),
        (F.silu, 7),
        (F.gelu, 12),
        (lambda x: F.gelu(x, approximate="tanh"), 17),
        (torch.relu, 4),
        (torch.abs, 3),
        (torch.exp, 2),
        (torch.sqrt, 3),
        (lambda x: x * x, 4),
    ],
)
def test_activation_code_is_short(f, limit):
    gm = _code(f, torch.randn(4))
    assert count_compute_nodes(gm) <= limit, gm.code


def test_generated_code_reads_like_pytorch():
    code = _code(torch.tanh, torch.randn(4)).code
    assert "torch.ops.aten" not in code, code
    code = _code(F.relu, torch.randn(4)).code
    assert "torch.where" in code and "torch.ops.aten" not in code, code


def test_no_cotangent_for_python_numbers():
    gm = _code(lambda x: x * 2 + 1, torch.randn(4))
    assert count_compute_nodes(gm) <= 3, gm.code


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_dtypes_are_kept(dtype):
    x, y = torch.rand(4, dtype=dtype) + 0.5, torch.rand(4, dtype=dtype) + 0.5
    for f in (
        torch.sin,
        torch.sqrt,
        torch.sigmoid,
        F.gelu,
        F.silu,
        torch.erf,
        torch.log,
        lambda a: a**3,
        lambda a: torch.clamp(a, 0.6, 0.9),
        F.softplus,
        F.elu,
    ):
        gm = _code(f, x)
        _, (g,) = gm(x, torch.ones_like(x))
        assert g.dtype == dtype
    for f in (torch.maximum, torch.atan2, torch.hypot, torch.pow, torch.mul, torch.div, torch.xlogy):
        gm = _code(f, x, y)
        _, (gx, gy) = gm(x, y, torch.ones_like(x))
        assert gx.dtype == dtype and gy.dtype == dtype


def test_mixed_dtypes_cast_back():
    x, y = torch.randn(4, dtype=torch.float16), torch.randn(4, dtype=D)
    gm = _code(lambda x, y: x * y, x, y)
    _, (gx, gy) = gm(x, y, torch.ones(4, dtype=D))
    assert gx.dtype == torch.float16 and gy.dtype == D
    check_vjp(lambda x: x.to(torch.float32).to(D) * 3, torch.randn(4, dtype=D))
