"""Held-out programs (batch m): JVP losses, PINNs on batches, and NaN tracing.

Each test is a program a demanding user writes that gave a silent wrong answer, a false refusal
or an unclear error before its fix. The oracle is torch.func / torch.autograd in float64.
"""

from __future__ import annotations

import pytest
import torch

import fxtools

D = torch.float64


def _u(w, x):
    return torch.tanh(x @ w).sum()


def _hess(w, x):
    return torch.func.hessian(lambda x: _u(w, x))(x)


def test_fxtools_laplacian_vmap_and_grad_called_inside_a_loss():
    """``fxtools.laplacian`` / ``vmap`` / ``grad`` called inside a loss that fxtools differentiates (a
    PINN's residual built in the loss) failed with internal errors (a fake-mode mismatch,
    ``.numpy()`` of a traced value): each now runs as its torch.func spelling."""
    torch.manual_seed(0)
    w, xs = torch.randn(3, 4, dtype=D), torch.randn(2, 3, dtype=D)

    def loss(w, xs):
        lap = fxtools.laplacian(_u, w, xs[0], argnums=1)
        _, d = fxtools.vmap(lap, w, xs, in_dims=(None, 0))(w, xs)
        g = fxtools.grad(_u, w, xs[0], argnums=1)(w, xs[0])
        return (d**2).sum() + (g**2).sum()

    def want(w, xs):
        d = torch.stack([_hess(w, x).trace() for x in xs])
        return (d**2).sum() + (torch.func.grad(_u, argnums=1)(w, xs[0]) ** 2).sum()

    got = fxtools.value_and_grad(loss, w, xs)(w, xs)
    torch.testing.assert_close(got[0], want(w, xs))
    torch.testing.assert_close(got[1], torch.func.grad(want)(w, xs))


def test_fxtools_hvp_vjp_and_weighted_laplacian_called_inside_a_loss():
    torch.manual_seed(1)
    w, xs, s = torch.randn(3, 5, dtype=D), torch.randn(2, 3, dtype=D), torch.randn(3, 2, dtype=D)

    def loss(w, xs):
        hv = fxtools.hvp(lambda x: _u(w, x), xs[0])(xs[0], xs[1])
        _, (gx,) = fxtools.vjp(lambda x: torch.tanh(x @ w), xs[0])(xs[0], torch.ones(5, dtype=D))
        _, ds = fxtools.laplacian(lambda x: _u(w, x), xs[0], sigma=s)(xs[0], s)
        return (hv**2).sum() + (gx**3).sum() + ds

    def want(w, xs):
        hv = _hess(w, xs[0]) @ xs[1]
        gx = torch.func.vjp(lambda x: torch.tanh(x @ w), xs[0])[1](torch.ones(5, dtype=D))[0]
        return (hv**2).sum() + (gx**3).sum() + (s.T @ _hess(w, xs[0]) @ s).trace()

    torch.testing.assert_close(fxtools.grad(loss, w, xs)(w, xs), torch.func.grad(want)(w, xs))


def test_fxtools_transform_without_program_form_is_refused_naming_the_line():
    w, x = torch.randn(3, 5, dtype=D), torch.randn(3, dtype=D)
    with pytest.raises(fxtools.FxtoolsError, match=r"bilaplacian is called inside.*test_heldout_m.py"):
        fxtools.grad(lambda w, x: fxtools.bilaplacian(lambda x: _u(w, x), x)(x)[1], w, x)


def test_pinn_autograd_grad_of_a_slice_with_an_unbounded_dim():
    """A PINN residual by ``torch.autograd.grad`` of ``gx[:, i]`` at a dynamic batch size was refused
    as specialised (``B < 2**63 - 1``, recorded by PyTorch's slice decomposition in the replayed
    backward); now one module serves every batch size."""
    from torch.export import Dim

    torch.manual_seed(0)
    w = torch.randn(2, 8, dtype=D)

    def loss(w, xs, f):
        xs = xs.detach().requires_grad_(True)
        u = torch.tanh(xs @ w).sum(-1)
        (gx,) = torch.autograd.grad(u, xs, torch.ones_like(u), create_graph=True)
        lap = torch.zeros_like(u)
        for i in range(xs.shape[1]):
            lap = lap + torch.autograd.grad(gx[:, i], xs, torch.ones_like(gx[:, i]), create_graph=True)[0][:, i]
        return ((lap + f) ** 2).mean()

    def want(w, xs, f):
        lap = torch.func.vmap(lambda x: torch.func.hessian(lambda x: torch.tanh(x @ w).sum())(x).trace())(xs)
        return ((lap + f) ** 2).mean()

    batch = Dim("batch")
    gm = fxtools.grad(loss, w, torch.randn(6, 2, dtype=D), torch.randn(6, dtype=D), dynamic_shapes=(None, {0: batch}, {0: batch}))
    for n in (6, 3):
        xs, f = torch.randn(n, 2, dtype=D), torch.randn(n, dtype=D)
        torch.testing.assert_close(gm(w, xs, f), torch.func.grad(want)(w, xs, f))


def test_inplace_on_a_linear_output_under_nested_vmap_of_hessian():
    """``y = F.linear(x[None], w); y.add_(b)`` in a per-point network, batched by ``torch.func.vmap``
    (of ``hessian``: a PINN's Laplacian) inside a loss, was refused as an alias fxtools cannot
    follow: vmap's batching rule reshapes ``mm``'s result with ``_unsafe_view``, which shares its
    storage without declaring it."""
    torch.manual_seed(0)
    w, b, xs = torch.randn(6, 3, dtype=D), torch.randn(6, dtype=D), torch.randn(5, 3, dtype=D)

    def u(w, x):
        y = torch.nn.functional.linear(x[None], w)
        y.add_(b).mul_(0.5)
        return torch.tanh(y).sum()

    def loss(w, xs):
        return torch.func.vmap(lambda x: torch.func.hessian(lambda y: u(w, y))(x).trace())(xs).pow(2).sum()

    torch.testing.assert_close(fxtools.grad(loss, w, xs)(w, xs), torch.func.grad(loss)(w, xs))
