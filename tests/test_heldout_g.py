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

_W = torch.randn(3, 8, dtype=D, generator=torch.Generator().manual_seed(0))


def _pinn_residual(v, xt):
    xt = xt.detach().requires_grad_(True)
    x, t = xt[:, :2], xt[:, 2:]
    u = (x * (1 - x)).prod(-1, keepdim=True) * t * (torch.tanh(xt @ _W) @ v)  # hard boundary condition
    du = torch.autograd.grad(u, xt, grad_outputs=torch.ones_like(u), create_graph=True)[0]
    lap = 0
    for i in range(2):
        lap = lap + torch.autograd.grad(du[:, i].sum(), xt, create_graph=True)[0][:, i]
    return ((du[:, 2] - 0.1 * lap + u[:, 0] ** 3) ** 2).mean()


def _eager_grad(v, xt):
    v = v.clone().requires_grad_(True)
    return torch.autograd.grad(_pinn_residual(v, xt), v)[0]


@pytest.fixture(scope="module")
def pinn_grad():
    g = torch.Generator().manual_seed(1)
    v, xt = torch.randn(8, 1, dtype=D, generator=g), torch.rand(5, 3, dtype=D, generator=g)
    return fxtools.grad(_pinn_residual, v, xt), v


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
def test_a_pinn_residual_with_released_temporaries_is_differentiated(pinn_grad, layout):
    gm, v = pinn_grad
    g = torch.Generator().manual_seed(2)
    xt = {
        "contiguous": lambda: torch.rand(5, 3, dtype=D, generator=g),
        "transposed": lambda: torch.rand(3, 5, dtype=D, generator=g).t(),
        "expanded": lambda: torch.rand(1, 3, dtype=D, generator=g).expand(5, 3),
    }[layout]()
    torch.testing.assert_close(gm(v, xt), _eager_grad(v, xt), rtol=1e-10, atol=1e-12)
