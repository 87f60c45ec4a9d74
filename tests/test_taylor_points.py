"""Second derivatives at special points: ``fxtools.laplacian``, ``fxtools.hvp`` and ``fxtools.jet``
(order 2) of every pointwise OpInfo (unary, or binary with the second argument fixed) against
torch.func's ``jacfwd(jacrev)`` in float64, at 0, -0, +-1, +-0.5, +-30, +-800, kinks and domain
edges; NaN equals NaN. PyTorch's autograd is the reference users compare with."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from opinfo_harness import autograd_opinfos
from taylor_oracle import F64, randn
from test_taylor import curve_derivatives

import fxtools
from fxtools.errors import MissingRuleError

POINTS = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 30.0, -30.0, 800.0, -800.0, 2.0, -2.0, 0.2, 0.8]

# Where fxtools keeps a different, documented value (docs/taylor.md, "Special points"), keyed by
# the point as written (-0.0 is not 0.0): overflow that makes autograd's formula inf / inf, the
# sign of an infinite derivative at -0.0.
KNOWN = {
    ("logaddexp", "-800.0"): "NaN in autograd (exp overflows in its double backward), fxtools 0 (the limit)",
    ("nn.functional.mish", "800.0"): "NaN in autograd (tanh(softplus)'s double backward overflows), fxtools 0",
    ("sqrt", "-0.0"): "Laplacian: -inf (fxtools, the limit from the right) against autograd's +inf",
    ("rsqrt", "-0.0"): "Laplacian: +inf (fxtools) against autograd's -inf",
    ("logit", "0.0"): "hvp: NaN as torch.autograd.functional.hessian, -inf in torch.func's",
    ("logit", "-0.0"): "hvp: NaN against autograd's -inf",
    ("logit", "1.0"): "hvp: NaN against autograd's +inf",
}
TAYLOR_REFUSED = {"copysign"}
PROGRAMS = {  # the argument used twice, and a replaced infinity: autograd's derivatives are NaN at 0
    "xlogy(x, x)": lambda x: torch.xlogy(x, x),
    "nan_to_num(log|x|)": lambda x: torch.nan_to_num(torch.log(x.abs())),
    "nan_to_num(1/x)": lambda x: torch.nan_to_num(1 / x, posinf=3.0),
}


@functools.cache
def pointwise_ops():
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

    ops = dict(PROGRAMS)
    for op in autograd_opinfos():
        if isinstance(op, UnaryUfuncInfo):
            s = next(iter(op.sample_inputs("cpu", F64)))
            if any(isinstance(a, torch.Tensor) for a in [*s.args, *s.kwargs.values()]):
                continue
            f = functools.partial(lambda op, s, x: op.op(x, *s.args, **s.kwargs), op, s)
        elif isinstance(op, BinaryUfuncInfo):
            f = functools.partial(lambda op, x: op.op(x, torch.full_like(x, 0.7)), op)
        else:
            continue
        if op.name in NAMES:
            ops.setdefault(op.name, f)
    return ops


NAMES = [
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "erf", "erfc", "exp", "exp2",
    "expm1", "log", "log10", "log1p", "log2", "logit", "neg", "reciprocal", "rsqrt", "sigmoid", "sin",
    "sinc", "sinh", "sqrt", "square", "tan", "tanh", "special.entr", "copysign", "logaddexp", "xlogy",
    "pow", "float_power", "nn.functional.elu", "nn.functional.celu", "nn.functional.selu",
    "nn.functional.logsigmoid", "nn.functional.mish", "nn.functional.softplus", "nn.functional.silu",
"nn.functional.relu", "nn.functional.hardtanh", "clamp_min", "clamp_max",
]  # fmt: skip


@pytest.mark.parametrize("name", NAMES + list(PROGRAMS))
def test_second_derivatives_at_special_points_match_autograd(name):
    f = pointwise_ops()[name]
    x = torch.tensor(POINTS, dtype=F64)
    v, w = torch.ones_like(x), torch.zeros_like(x)

    def g(x):
        return f(x).sum()

    want = torch.func.jacfwd(torch.func.jacrev(g))(x).diagonal()
    jet_want = want + torch.func.jvp(f, (x,), (w,))[1]  # d2/dt2 f(x + t v + t^2/2 w): H v v + J w, NaN where J is inf
    got = {"hvp": fxtools.hvp(g, x)(x, v)}
    if name in TAYLOR_REFUSED:  # refused by name, no wrong answer
        with pytest.raises(MissingRuleError):
            fxtools.laplacian(f, x)
    else:
        got["laplacian"] = fxtools.laplacian(f, x)(x)[1]
        got["jet"] = fxtools.jet(f, x, order=2)(x, (v, w))[1][1]
    keep = torch.tensor([(name, str(p)) not in KNOWN for p in POINTS])
    for transform, value in got.items():
        reference = jet_want if transform == "jet" else want
        torch.testing.assert_close(
            value[keep], reference[keep], rtol=1e-9, atol=1e-9, equal_nan=True, msg=lambda m: f"{transform}: {m}"
        )


OWN_RULES = {  # ops with a Taylor rule of their own (rather than their decomposition), with their options
    "elu(alpha)": lambda x: F.elu(x, alpha=0.5),
    "elu in place": lambda x: F.elu(x * 1.0, inplace=True),
    "elu(scale, input_scale)": lambda x: torch.ops.aten.elu(x, 0.3, 1.7, 0.6),
    "celu": lambda x: F.celu(x, alpha=2.0),
    "logsigmoid": lambda x: F.logsigmoid(x * 3),
    "logit(eps)": lambda x: torch.logit(x.sigmoid(), eps=0.3),
    "entr": lambda x: torch.special.entr(x.abs() + 0.1),
    "nan_to_num": lambda x: torch.nan_to_num(x / (x - 0.3)),
    "xlogy": lambda x: torch.xlogy(x.exp(), x * x + 1) + torch.xlogy(x, 2.0) + torch.special.xlogy(3.0, x.abs()),
}


@pytest.mark.parametrize("name", list(OWN_RULES))
def test_own_rules_at_order_3_and_in_hvp(name):
    """Order-3 jets along random curves, the Laplacian of a sum and hvp, against torch.func."""
    f = OWN_RULES[name]
    x = torch.tensor([0.0, -0.7, 0.3, 1.2, -2.0, 0.1], dtype=F64)
    series = tuple(randn(6, seed=20 + k) for k in range(3))
    same = dict(rtol=1e-9, atol=1e-9, equal_nan=True)
    out, got = fxtools.jet(f, x, order=3)(x, series)
    torch.testing.assert_close(out, f(x), **same)
    for k, want in enumerate(curve_derivatives(f, x, series)):
        torch.testing.assert_close(got[k], want, **same)

    def g(x):
        return f(x).sum()

    torch.testing.assert_close(fxtools.laplacian(g, x)(x)[1], torch.func.jacfwd(torch.func.jacrev(g))(x).trace(), **same)
    torch.testing.assert_close(fxtools.hvp(g, x)(x, series[0]), torch.func.jvp(torch.func.grad(g), (x,), series[:1])[1], **same)
