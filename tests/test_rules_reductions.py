"""Reductions: readable generated code, and cases PyTorch's OpInfo samples do not reach.

Numerical checks compare with torch.autograd in float64 (``check_vjp``); readability checks
look at the generated backward's ops.
"""

import math

import pytest
import torch

import fxtools
from fxtools.transforms.check import check_vjp

D = torch.float64
INF = float("inf")


def _x():
    return torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(0))


def _zeros():
    x = _x()
    x[0, 1] = x[1, 1] = x[1, 2] = x[2, 3] = 0
    return x


def _ties():
    return torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [5.0, 1.0, 5.0]], dtype=D)


def _zero_row():
    x = _x()
    x[0] = 0
    return x


def _nans():
    x = _zeros()
    return torch.where(x == 0, math.nan, x)


S = torch.tensor(1.5, dtype=D)

CASES = {
    # sums and means: dims given as None / [] / negative, keepdim both ways, 0-d inputs, dtype
    "sum_0d": (lambda x: x.sum(), S),
    "sum_0d_dim": (lambda x: x.sum(0), S),
    "sum_0d_keepdim": (lambda x: x.sum(-1, keepdim=True), S),
    "sum_neg_keepdim": (lambda x: x.sum(-1, keepdim=True), _x()),
    "sum_empty_dims": (lambda x: x.sum([]), _x()),
    "sum_dtype": (lambda x: x.sum(1, dtype=D), _x().float()),
    "mean_dtype": (lambda x: x.mean(dtype=D), _x().float()),
    "mean_0d": (lambda x: x.mean(0), S),
    "mean_all_keepdim": (lambda x: x.mean([0, 1], keepdim=True), _x()),
    "nansum": (lambda x: x.nansum(1), _nans()),
    "nanmean": (lambda x: x.nanmean(), _nans()),
    "nanmean_keepdim": (lambda x: x.nanmean(-1, True), _nans()),
    # products with zeros (none, one, several per slice)
    "prod_zeros": (lambda x: x.prod(), _zeros()),
    "prod_zeros_dim": (lambda x: x.prod(1), _zeros()),
    "prod_zeros_keepdim": (lambda x: x.prod(0, keepdim=True), _zeros()),
    "prod_one_zero": (lambda x: x.prod(), torch.tensor([2.0, 0.0, 3.0], dtype=D)),
    "prod_0d": (lambda x: x.prod(0), S),
    "cumprod_zeros": (lambda x: x.cumprod(1), _zeros()),
    "cumprod_zeros_dim0": (lambda x: x.cumprod(0), _zeros()),
    "cumprod_0d": (lambda x: x.cumprod(0), S),
    "cumsum_0d": (lambda x: x.cumsum(0), S),
    "cumsum_dtype": (lambda x: x.cumsum(-1, dtype=D), _x().float()),
    "logcumsumexp_large": (lambda x: x.logcumsumexp(1), _x() * 500),
    "logcumsumexp_0d": (lambda x: x.logcumsumexp(0), S),
    "logsumexp_keepdim": (lambda x: x.logsumexp(-1, True), _x()),
    "logsumexp_all": (lambda x: x.logsumexp([0, 1]), _x()),
    "logsumexp_0d": (lambda x: x.logsumexp(0), S),
    # ties share the gradient (amax, amin, max(), min(), median()); dim versions use the index
    "amax_ties": (lambda x: x.amax(1), _ties()),
    "amin_ties": (lambda x: x.amin(), _ties()),
    "amax_keepdim": (lambda x: x.amax([0, 1], keepdim=True), _ties()),
    "max_ties": (lambda x: x.max(), _ties()),
    "min_ties": (lambda x: x.min(), _ties()),
    "median_ties": (lambda x: x.median(), _ties()),
    "aminmax": (lambda x: torch.aminmax(x, dim=1), _ties()),
    "aminmax_max_only": (lambda x: torch.aminmax(x)[1], _ties()),
    "max_dim": (lambda x: torch.max(x, -1), _ties()),
    "min_dim_keepdim": (lambda x: torch.min(x, 0, keepdim=True), _ties()),
    "max_dim_0d": (lambda x: torch.max(x, 0), S),
    "median_dim": (lambda x: x.median(1), _x()),
    "nanmedian_dim": (lambda x: x.nanmedian(-1, True), _x()),
    "kthvalue": (lambda x: x.kthvalue(2, 0), _x()),
    "kthvalue_0d": (lambda x: x.kthvalue(1), S),
    "mode": (lambda x: x.mode(0), _ties()),
    "sort_0d": (lambda x: x.sort(), S),
    "sort_descending": (lambda x: x.sort(0, descending=True), _x()),
    "sort_stable": (lambda x: torch.sort(x, stable=True, dim=0), _x()),
    "topk_smallest": (lambda x: x.topk(2, 0, largest=False), _x()),
    "cummax": (lambda x: x.cummax(0), _ties()),
    "cummin": (lambda x: x.cummin(1).values, _ties()),
    # variance and standard deviation: corrections, unbiased, no degrees of freedom, zero std
    "var_correction0": (lambda x: x.var(1, correction=0), _x()),
    "var_correction2_keepdim": (lambda x: x.var([0, 1], correction=2, keepdim=True), _x()),
    "var_biased_dim": (lambda x: torch.var(x, 0, False), _x()),
    "var_biased_all": (lambda x: torch.var(x, False), _x()),
    "var_no_dof": (lambda x: x.var(1, correction=4), _x()),
    "var_0d": (lambda x: x.var(correction=0), S),
    "std_constant": (lambda x: x.std(1), torch.ones(3, 4, dtype=D)),
    "std_neg_keepdim": (lambda x: x.std(-2, keepdim=True), _x()),
    "std_biased_all": (lambda x: torch.std(x, False), _x()),
    "var_mean": (lambda x: torch.var_mean(x, 1, correction=0), _x()),
    "var_mean_var_only": (lambda x: torch.var_mean(x, 1)[0], _x()),
    "var_mean_mean_only": (lambda x: torch.var_mean(x)[1], _x()),
    "std_mean_keepdim": (lambda x: torch.std_mean(x, [0], keepdim=True), _x()),
    "std_mean_biased": (lambda x: torch.std_mean(x, False), _x()),
    # norms, including at zero
    "norm2_at_zero": (lambda x: x.norm(dim=1), _zero_row()),
    "norm1_zeros": (lambda x: x.norm(1, dim=0), _zeros()),
    "norm_inf_ties": (lambda x: torch.linalg.vector_norm(x, INF, 1), _ties()),
    "norm_minus_inf": (lambda x: torch.linalg.vector_norm(x, -INF), _ties()),
    "norm3": (lambda x: torch.linalg.vector_norm(x, 3, [0, 1]), _zeros()),
    "norm3_at_zero": (lambda x: torch.linalg.vector_norm(x, 3, 1), _zero_row()),
    "norm_half": (lambda x: torch.linalg.vector_norm(x, 0.5, 1, True), _x()),
    "norm0": (lambda x: torch.linalg.vector_norm(x, 0), _x()),
    "norm_dtype": (lambda x: torch.linalg.vector_norm(x, 2, dtype=D), _x().float()),
    "norm_0d": (lambda x: x.norm(), S),
    "norm_aten_scalar": (lambda x: torch.ops.aten.norm.Scalar(x, 3), _x()),
    # integer-valued reductions carry no gradient
    "nondifferentiable": (lambda x: x * torch.count_nonzero(x) + x.argmax() + x.argmin(1).sum() + x.any() + x.all(), _x()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_autograd(name):
    f, x = CASES[name]
    check_vjp(f, x, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "name", ["sum", "mean", "prod", "cumprod", "logsumexp", "norm", "norm1", "norm3", "norm_inf", "var", "std"]
)
def test_complex_inputs(name):
    f = {
        "sum": lambda z: z.sum(1),
        "mean": lambda z: z.mean(),
        "prod": lambda z: z.prod(1),
        "cumprod": lambda z: z.cumprod(1),
        "logsumexp": lambda z: z.logsumexp(1),
        "norm": lambda z: z.norm(dim=1),
        "norm1": lambda z: torch.linalg.vector_norm(z, 1),
        "norm3": lambda z: torch.linalg.vector_norm(z, 3, 1),
        "norm_inf": lambda z: torch.linalg.vector_norm(z, INF),
        "var": lambda z: z.var(1),
        "std": lambda z: z.std(),
    }[name]
    z = torch.randn(3, 4, dtype=torch.complex128, generator=torch.Generator().manual_seed(0))
    z[0, 1] = z[1, 2] = z[1, 3] = 0
    check_vjp(f, z, rtol=1e-6, atol=1e-8)


# --- integer outputs: the indices get no cotangent ------------------------------------------


@pytest.mark.parametrize(
    "op",
    [
        lambda x: torch.max(x, 1),
        lambda x: torch.min(x, 0, keepdim=True),
        lambda x: x.sort(1),
        lambda x: x.topk(2),
        lambda x: x.kthvalue(2, 1),
        lambda x: x.median(0),
        lambda x: x.mode(1),
        lambda x: x.cummax(1),
    ],
    ids=["max", "min", "sort", "topk", "kthvalue", "median", "mode", "cummax"],
)
def test_indices_take_none_cotangent(op):
    x = _x()
    gm = fxtools.vjp(op, x)
    values, indices = op(x)
    ct = torch.randn(values.shape, dtype=D, generator=torch.Generator().manual_seed(1))
    (out_values, out_indices), (grad_x,) = gm(x, (ct, None))
    assert torch.equal(out_values, values) and torch.equal(out_indices, indices)
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(op(xr)[0], xr, ct)
    torch.testing.assert_close(grad_x, want)


def test_argmax_output_alone_is_not_differentiated():
    gm = fxtools.vjp(lambda x: (x.argmax(1), x.sum()), _x())
    (idx, total), (grad_x,) = gm(_x(), (None, torch.tensor(2.0, dtype=D)))
    assert torch.equal(idx, _x().argmax(1))
    torch.testing.assert_close(grad_x, torch.full((3, 4), 2.0, dtype=D))


# --- readability ----------------------------------------------------------------------------


def _code(f, x, grad=False):
    gm = fxtools.grad(f, x) if grad else fxtools.vjp(f, x)
    return gm, gm.code


def test_grad_of_sum_is_expanded_ones():
    gm, code = _code(lambda x: x.sum(), _x(), grad=True)
    assert len([n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]) <= 3, code
    assert ".expand([3, 4])" in code and "unsqueeze" not in code and "reshape" not in code


def test_vjp_of_sum_is_one_expand():
    gm, code = _code(lambda x: x.sum(), _x())
    assert "grad_x = grad_loss.expand([3, 4])" in code, code


def test_mean_over_dim_is_one_division_one_unsqueeze_one_expand():
    gm, code = _code(lambda x: x.mean(1), _x())
    body = code.split("torch.mean(x, [1])", 1)[1]
    assert body.count("/") == 1 and body.count("unsqueeze(") == 1 and body.count(".expand(") == 1, code
    assert "grad_out / 4" in code


def test_keepdim_needs_no_unsqueeze():
    for f in (lambda x: x.sum(1, keepdim=True), lambda x: x.amax(-1, keepdim=True), lambda x: x.logsumexp(0, True)):
        _, code = _code(f, _x())
        assert "unsqueeze" not in code and "reshape" not in code, code


def test_full_reduction_over_dim_list_needs_no_reshape():
    for f in (lambda x: x.sum([0, 1]), lambda x: x.mean([]), lambda x: x.var([0, 1])):
        _, code = _code(f, _x())
        assert "unsqueeze" not in code and "reshape" not in code and "view" not in code, code


def test_no_conversion_when_dtypes_match():
    for f in (lambda x: x.sum(1), lambda x: x.mean(), lambda x: x.prod(1), lambda x: x.cumsum(0)):
        _, code = _code(f, _x())
        assert ".to(" not in code and "_to_copy" not in code, code


def test_max_dim_scatters_to_index():
    _, code = _code(lambda x: torch.max(x, 1), _x())
    # a scatter into a fresh zeros tensor prints as its in-place method (codegen/inplace.py)
    assert "torch.zeros_like(x).scatter_(" in code, code
    assert "index_put" not in code and "torch.ops" not in code


def test_sort_gradient_is_one_scatter():
    gm, code = _code(lambda x: x.sort(1)[0], _x())
    after = code.split("torch.sort(", 1)[1]
    assert after.count("torch.") == 1 and after.count(".scatter_(") == 1, code  # zeros_like(...).scatter_


def test_amax_splits_ties_with_one_count():
    _, code = _code(lambda x: x.amax(1), _x())
    assert code.count("torch.sum(") == 1 and code.count("==") == 1, code


def test_var_backward_is_centered_input_times_scaled_cotangent():
    _, code = _code(lambda x: x.var(1), _x())
    assert code.count("torch.mean(") == 1 and code.count(" - ") == 1, code
    assert "torch.ops" not in code


def test_norm_backward_is_input_times_scaled_cotangent():
    _, code = _code(lambda x: x.norm(dim=1), _x())
    body = code.split("torch.linalg.vector_norm(x, dim=[1])", 1)[1]
    assert "grad_x = x * " in body and body.count("torch.unsqueeze(") == 1, code
    assert "torch.ops" not in body


@pytest.mark.parametrize(
    "f",
    [
        lambda x: x.prod(1),
        lambda x: x.cumprod(1),
        lambda x: x.logcumsumexp(1),
        lambda x: x.amin(0),
        lambda x: x.nanmean(1),
        lambda x: torch.std_mean(x, 1),
        lambda x: x.topk(2),
        lambda x: x.kthvalue(2),
        lambda x: x.median(),
        lambda x: torch.linalg.vector_norm(x, 3, 1),
    ],
)
def test_backward_uses_public_torch_calls(f):
    _, code = _code(f, _x())
    backward = [line for line in code.splitlines() if "grad" in line or "torch.ops" in line]
    assert not [line for line in backward if "torch.ops" in line and "linalg_vector_norm.default(x" not in line], code


@pytest.mark.parametrize("p", [2.0, 1.0, 0.5, 3.0, math.inf])
def test_cdist_jacobian_and_second_order_match_autograd(p):
    """cdist's rule is written in torch ops: jacrev (PyTorch's vmap of ``_cdist_backward`` gave
    zeros, silently) equals autograd's row-by-row Jacobian, with a zero distance and ties; hvp
    (``_cdist_backward`` has no derivative) equals the pairwise norm's, written out."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, dtype=torch.float64, generator=g), torch.randn(2, 3, dtype=torch.float64, generator=g)
    x[1], y[0] = 1.0, 1.0  # a zero distance, and ties for p = inf

    def f(x, y):
        return torch.cdist(x, y, p=p)

    got = fxtools.jacrev(f, x, y, argnums=(0, 1))(x, y)
    want = torch.autograd.functional.jacobian(f, (x, y))  # eager autograd, one row at a time
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if p == 2.0:
        v = torch.randn(4, 3, dtype=torch.float64, generator=g)

        def loss(x, dist):
            return dist(x, x[:2] + 1.0).square().sum() + dist(x, 2 * x[1:3] + 0.5).sum()

        def written_out(a, b):
            return ((a[:, None] - b[None]) ** 2).sum(-1).sqrt()

        hv = fxtools.hvp(lambda x: loss(x, torch.cdist), x)(x, v)
        torch.testing.assert_close(hv, torch.autograd.functional.hvp(lambda x: loss(x, written_out), x, v)[1])
