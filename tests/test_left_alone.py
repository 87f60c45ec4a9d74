"""Problems an earlier session saw and left alone: each test failed before its fix."""

import pytest
import torch

import fxtools

TOL = dict(rtol=1e-10, atol=1e-10)


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _repeat_loss(x, r):
    return torch.repeat_interleave(x, r, dim=0).sin().pow(2).sum()


def _nonzero_loss(x):
    return x[torch.nonzero(x > 0)[:, 0]].sin().pow(2).sum()


@pytest.mark.parametrize(
    "make, op",
    [
        (lambda x, r: fxtools.hessian(_repeat_loss, x, r), "repeat_interleave"),
        (lambda x, r: fxtools.hessian(_nonzero_loss, x), "nonzero"),
        (lambda x, r: fxtools.jacrev(fxtools.jacrev(_repeat_loss, x, r), x, r), "repeat_interleave"),
    ],
    ids=["hessian-repeat", "hessian-nonzero", "jacrev-of-jacrev"],
)
def test_second_derivative_of_a_data_dependent_size_names_the_line(make, op):
    """Batching the gradient's own data-dependent op was refused at "an unknown line"."""
    x, r = _r(3, 2, seed=1), torch.tensor([1, 0, 2])
    with pytest.raises(fxtools.errors.DataDependentError, match=rf"{op} at .*test_left_alone.py:\d+: (def|return)"):
        make(x, r)


def test_hessian_where_a_data_dependent_size_batches():
    """``x[mask]``'s second derivative batches (its gradient is an index_put): no refusal."""

    def f(x):
        return x[x > 0].sin().pow(2).sum()

    x = _r(3, 2, seed=2)
    torch.testing.assert_close(fxtools.hessian(f, x)(x), torch.func.hessian(f)(x), **TOL)
    torch.testing.assert_close(
        fxtools.hvp(_repeat_loss, x, torch.tensor([1, 0, 2]))(x, torch.tensor([2, 1, 0]), x),
        torch.func.jvp(torch.func.grad(lambda y: _repeat_loss(y, torch.tensor([2, 1, 0]))), (x,), (x,))[1],
        **TOL,
    )
