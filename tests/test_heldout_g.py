"""Held-out programs (batch g): training losses with derivatives inside, PINNs, NaN hunting.

Each test is a program that gave a wrong answer, a crash or a false refusal before its fix; the
oracle is eager PyTorch (torch.autograd) on the same computation in float64.
"""

import pytest
import torch

import fxtools

D = torch.float64

# --- torch.autograd.grad inside a program reading a value Python has released: the grad_outputs
# temporary `torch.ones_like(u)`, the cotangent of an earlier grad, a closed-over constant. They were
# refused as "written in place after it was read" (a PINN's Laplacian, the most common idiom). ---

_W = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(0))


def _pinn_residual(v, xt):
    xt = xt.detach().requires_grad_(True)
    x, t = xt[:, :1], xt[:, 1:]
    u = x * (1 - x) * t * (torch.tanh(xt @ _W) @ v)  # hard boundary and initial conditions
    du = torch.autograd.grad(u, xt, grad_outputs=torch.ones_like(u), create_graph=True)[0]
    uxx = torch.autograd.grad(du[:, 0].sum(), xt, create_graph=True)[0][:, 0]
    return ((du[:, 1] - 0.1 * uxx + u[:, 0] ** 3) ** 2).mean()


def _eager_grad(v, xt):
    v = v.clone().requires_grad_(True)
    return torch.autograd.grad(_pinn_residual(v, xt), v)[0]


@pytest.fixture(scope="module")
def pinn_grad():
    g = torch.Generator().manual_seed(1)
    v, xt = torch.randn(4, 1, dtype=D, generator=g), torch.rand(5, 2, dtype=D, generator=g)
    return fxtools.grad(_pinn_residual, v, xt), v


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
def test_a_pinn_residual_with_released_temporaries_is_differentiated(pinn_grad, layout):
    gm, v = pinn_grad
    g = torch.Generator().manual_seed(2)
    xt = {
        "contiguous": lambda: torch.rand(5, 2, dtype=D, generator=g),
        "transposed": lambda: torch.rand(2, 5, dtype=D, generator=g).t(),
        "expanded": lambda: torch.rand(1, 2, dtype=D, generator=g).expand(5, 2),
    }[layout]()
    torch.testing.assert_close(gm(v, xt), _eager_grad(v, xt), rtol=1e-10, atol=1e-12)


def _grad_reading_a_value_whose_view_is_written_later(x):  # eager: "modified by an inplace operation"
    x = x.requires_grad_()
    c = torch.ones(3, dtype=D) * 2
    u = (torch.tanh(x) * c.view(3)).sum()
    c.view(3)[0].add_(1)  # through another view of it; then Python releases it
    del c
    return torch.autograd.grad(u, x, create_graph=True)[0].sum()


def _grad_reading_a_value_whose_view_was_written_before(x):  # eager runs it
    x = x.requires_grad_()
    c = torch.ones(3, dtype=D) * 2
    c[0].add_(1)
    u = (torch.tanh(x) * c).sum()
    del c
    return torch.autograd.grad(u, x, create_graph=True)[0].sum()


def test_a_value_written_through_a_view_after_the_read_is_refused_as_eager_does():
    x = torch.randn(3, dtype=D)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grad_reading_a_value_whose_view_is_written_later(x.clone())
    with pytest.raises(fxtools.FxtoolsError, match=r"test_heldout_g.py:\d+: return torch.autograd.grad.*written in place"):
        fxtools.grad(_grad_reading_a_value_whose_view_is_written_later, x)
    got = fxtools.grad(_grad_reading_a_value_whose_view_was_written_before, x)(x)
    want = torch.func.grad(lambda x: (torch.tensor([3.0, 2, 2], dtype=D) * (1 - torch.tanh(x) ** 2)).sum())(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def _pinn_with_a_nan_in_its_derivative(v, xt):
    xt = xt.detach().requires_grad_(True)
    u = torch.sqrt((xt @ _W) ** 2) @ v  # |h|: its derivative at h = 0 is 0 / 0
    du = torch.autograd.grad(u, xt, grad_outputs=torch.ones_like(u), create_graph=True)[0]
    return (du**2).mean()


def test_a_nan_born_in_autograd_grad_inside_names_its_line():
    v = torch.randn(4, 1, dtype=D, generator=torch.Generator().manual_seed(3))
    report = fxtools.find_nonfinite(_pinn_with_a_nan_in_its_derivative, v, torch.zeros(5, 2, dtype=D), argnums=(0,))
    assert report.phase == "forward" and report.line.startswith("du = torch.autograd.grad(u, xt")
