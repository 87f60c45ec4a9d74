"""Functions captured through fxtools' replacements (fxtools/replacements.py): each computes what
PyTorch computes, differentiates like torch.autograd, and keeps PyTorch's value checks as
runtime assertions in the generated code."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import fxtools
from fxtools.capture import replacements
from fxtools.errors import FxtoolsError
from fxtools.transforms.check import check_vjp

f64 = torch.float64


def r(*shape, seed=0, dtype=f64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed + len(shape)))


def pos(*shape, seed=0):
    return r(*shape, seed=seed).abs() + 0.1


fw = torch.tensor([1, 3, 0, 2, 1])
COV_CASES = {
    "vector": (r(5), {}),
    "matrix": (r(3, 5), {}),
    "correction0": (r(3, 5), {"correction": 0}),
    "correction2": (r(3, 5), {"correction": 2}),
    "fweights": (r(3, 5), {"fweights": fw}),
    "aweights": (r(3, 5), {"aweights": pos(5)}),
    "both": (r(3, 5), {"fweights": fw, "aweights": pos(5), "correction": 3}),
    "one_observation_aweights": (r(3, 1), {"aweights": pos(1)}),
    "integers": (torch.arange(10).view(2, 5), {"fweights": fw}),
    "complex": (r(3, 5, dtype=torch.complex128), {"aweights": pos(5)}),
    "too_few_observations": (r(3, 1), {}),
}


@pytest.mark.parametrize("name", list(COV_CASES))
def test_cov_equals_torch_cov(name):
    x, kwargs = COV_CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(replacements.cov(x, **kwargs), torch.cov(x, **kwargs), equal_nan=True)


@pytest.mark.parametrize("x", [r(5), r(3, 5), r(1, 4), r(2, 3, dtype=torch.complex128)], ids=str)
def test_corrcoef_equals_torch_corrcoef(x):
    torch.testing.assert_close(replacements.corrcoef(x), torch.corrcoef(x), equal_nan=True)


def test_cov_and_corrcoef_match_autograd():
    check_vjp(lambda x, w: torch.cov(x, fweights=fw, aweights=w, correction=2), r(3, 5), pos(5))
    check_vjp(lambda x: x.cov(correction=0), r(4, 6))
    check_vjp(torch.corrcoef, r(3, 5))
    check_vjp(lambda x: x.corrcoef(), r(5))


def test_cov_weight_checks_run_in_generated_code():
    x, w = r(3, 5), pos(5)
    gm = fxtools.vjp(lambda x, w: torch.cov(x, aweights=w), x, w)
    ct = torch.ones(3, 3, dtype=f64)
    gm(x, w, ct)
    with pytest.raises(RuntimeError, match="aweights cannot be negative"):
        gm(x, -w, ct)
    with pytest.raises(RuntimeError, match="weights sum to zero"):
        gm(x, torch.zeros_like(w), ct)


@pytest.mark.parametrize(
    "var_shape,kwargs",
    [
        ((4, 3), {}),
        ((4, 1), {"reduction": "sum", "full": True}),
        ((4,), {"reduction": "none"}),
    ],
)
def test_gaussian_nll_loss_equals_torch_and_matches_autograd(var_shape, kwargs):
    x, t, v = r(4, 3), r(4, 3, seed=1), pos(*var_shape)
    torch.testing.assert_close(replacements.gaussian_nll_loss(x, t, v, **kwargs), F.gaussian_nll_loss(x, t, v, **kwargs))
    check_vjp(lambda x, t, v: F.gaussian_nll_loss(x, t, v, **kwargs), x, t, v)


def test_gaussian_nll_loss_variance_clamp_passes_the_gradient_through():
    """PyTorch clamps var to eps in place under no_grad: clamped entries keep the identity gradient."""
    v = torch.tensor([1e-9, 0.5, 2e-8, 1.0], dtype=f64)
    check_vjp(lambda x, v: F.gaussian_nll_loss(x, torch.zeros(4, dtype=f64), v, eps=1e-6), r(4), v)


def test_gaussian_nll_loss_negative_variance_raises_in_generated_code():
    x, t, v = r(4, 3), r(4, 3, seed=1), pos(4, 3)
    gm = fxtools.vjp(lambda x, t, v: F.gaussian_nll_loss(x, t, v), x, t, v)
    assert "_assert_async" in gm.code
    with pytest.raises(RuntimeError, match="var has negative entry"):
        gm(x, t, -v, torch.tensor(1.0, dtype=f64))


@pytest.mark.parametrize("start", [0, 2, -3])
def test_narrow_with_a_tensor_start(start):
    x, s = r(4, 5, 3), torch.tensor(start)
    torch.testing.assert_close(replacements.narrow(x, 1, s, 2), torch.narrow(x, 1, start, 2))
    gm = check_vjp(lambda x, s: torch.narrow(x, 1, s, 2) * 2, x, s)
    out, _ = gm(x, torch.tensor(1), r(4, 2, 3))  # another start, same generated code
    torch.testing.assert_close(out, x[:, 1:3] * 2)


def test_writes_into_narrow_with_a_tensor_start_reach_the_narrowed_tensor():
    """The result is a copy (``index_select``) where eager's is a view: writes into it are put back."""

    def f(x, s):
        y = x * 1
        y.narrow(0, s, 2).mul_(2)
        return y

    x, ct = r(4), r(4, seed=1)
    gm = fxtools.vjp(f, x, torch.tensor(1))
    for s in (1, 0, -2):
        out, vjp_fn = torch.func.vjp(lambda x: f(x, torch.tensor(s)), x)
        got, (g, _) = gm(x, torch.tensor(s), ct)
        torch.testing.assert_close(got, out)
        torch.testing.assert_close(g, vjp_fn(ct)[0])


LSTSQ_SHAPES = [((4, 3), (4, 2)), ((3, 3), (3, 1)), ((2, 5), (2, 3)), ((2, 6, 3), (2, 6, 2)), ((2, 2, 4), (2, 2, 1))]


@pytest.mark.parametrize("dtype", [f64, torch.complex128])
@pytest.mark.parametrize("shapes", LSTSQ_SHAPES, ids=str)
def test_lstsq_gels_equals_torch(shapes, dtype):
    a, b = r(*shapes[0], dtype=dtype), r(*shapes[1], seed=1, dtype=dtype)
    want = torch.linalg.lstsq(a, b, driver="gels")
    got = replacements.lstsq(a, b, driver="gels")
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shapes", LSTSQ_SHAPES, ids=str)
def test_lstsq_gels_matches_autograd(shapes):
    check_vjp(lambda a, b: torch.linalg.lstsq(a, b, driver="gels").solution, r(*shapes[0]), r(*shapes[1], seed=1))


def test_lstsq_residuals_match_autograd():
    check_vjp(lambda a, b: torch.linalg.lstsq(a, b, driver="gels").residuals, r(5, 3), r(5, 2, seed=1))


def test_lstsq_other_drivers_are_refused():
    """gelsd and gelss return residuals for a tall ``A`` only at full rank: their output shapes depend
    on the computed rank (gelsy, the CPU default, has static shapes: tests/test_heldout_r.py)."""
    for driver in ("gelss", "gelsd"):
        with pytest.raises(FxtoolsError, match="lstsq"):
            fxtools.vjp(lambda a, b: torch.linalg.lstsq(a, b, driver=driver).solution, r(4, 3), r(4, 2))


def test_aten_size_called_directly_keeps_sizes_symbolic():
    """``torch.ops.aten.size.default(x)`` on a size marked dynamic stays that size (a graph value),
    not the example's: the gradient at another size is autograd's there."""
    from torch.export import Dim

    def f(x):
        n = torch.ops.aten.size.default(x)[0]
        return (x * n).sin().sum()

    g = fxtools.grad(f, r(5, 3), dynamic_shapes=({0: Dim("n")},))
    for rows in (5, 7):
        x = r(rows, 3, seed=rows).requires_grad_()
        (expected,) = torch.autograd.grad(f(x), x)
        torch.testing.assert_close(g(x.detach()), expected)
