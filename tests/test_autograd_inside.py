"""``torch.autograd.grad`` inside a program fxtools transforms (PINN input derivatives, WGAN-GP's
gradient penalty), taken from the trace (``capture/autograd_grad.py``). The oracle is eager
PyTorch in float64: the same function run with autograd, differentiated again by autograd."""

from __future__ import annotations

import pinn_mlp
import pytest
import torch
import torch.nn.functional as F

import fxtools

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def _heat_residual(p, x):
    """u_t - u_xx at points x = (x, t): two autograd.grad calls, the second of the first's result."""
    x = x.requires_grad_()
    u = pinn_mlp.u(p, x)
    (du,) = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)
    (d2u,) = torch.autograd.grad(du[:, 0].sum(), x, create_graph=True)
    return (du[:, 1] - d2u[:, 0]).pow(2).mean() + 0.1 * u.pow(2).mean()


def _two_inputs(p, x):
    """Gradients with respect to a leaf and a computed value, one of them unused."""
    x = x.requires_grad_()
    h = x * 2.0
    u = pinn_mlp.u(p, h)
    du_dx, du_dh, unused = torch.autograd.grad(u.sum(), [x, h, p["b1"] * 0], create_graph=True, allow_unused=True)
    assert unused is None
    return (du_dx * du_dh).sum() + u.sum()


def _first_order_only(p, x):
    """create_graph=False: the gradient is a constant for the outer derivative."""
    x = x.requires_grad_()
    u = pinn_mlp.u(p, x)
    (du,) = torch.autograd.grad(u.sum(), x, retain_graph=True)
    return (du.pow(2) * x).sum() + u.pow(2).sum()


def _functional_jacobian(p, x):
    """torch.autograd.functional.jacobian (autograd.grad per output element) inside the loss."""
    jac = torch.autograd.functional.jacobian(lambda y: torch.tanh(y @ p["w1"] + p["b1"]) * p["w2"], x[0], create_graph=True)
    return jac.pow(2).sum()


def _eager_grad(f, p, x):
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    return list(torch.autograd.grad(f(leaves, x.clone()), list(leaves.values())))


@pytest.mark.parametrize("f", [_heat_residual, _two_inputs, _first_order_only, _functional_jacobian])
def test_autograd_grad_in_a_loss_matches_eager_double_backward(f):
    p, x = pinn_mlp.mlp_params(0), torch.rand(5, 2, dtype=D)
    gm = fxtools.grad(f, p, x)
    for a in (x, torch.rand(2, 5, dtype=D).T):  # other values, a transposed layout
        torch.testing.assert_close(list(gm(p, a).values()), _eager_grad(f, p, a), **TOL)


def test_autograd_grad_in_a_loss_under_jvp_and_value_and_grad():
    p, x = pinn_mlp.mlp_params(1), torch.rand(4, 2, dtype=D)
    v = {k: torch.randn_like(t) for k, t in p.items()}
    _, tangent = fxtools.jvp(_heat_residual, p, x)(p, x, v, torch.zeros_like(x))[:2]
    leaves = {k: t.clone().requires_grad_() for k, t in p.items()}
    want = sum((g * v[k]).sum() for k, g in zip(p, _eager_grad(_heat_residual, p, x)))
    torch.testing.assert_close(tangent, want, **TOL)
    value, grads = fxtools.value_and_grad(_heat_residual, p, x)(p, x)
    torch.testing.assert_close(value, _heat_residual(leaves, x.clone()), **TOL)
    torch.testing.assert_close(list(grads.values()), _eager_grad(_heat_residual, p, x), **TOL)


class _Critic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(F.softplus(self.a(x)))


class _WGANGP(torch.nn.Module):
    """The critic's loss with the gradient penalty with respect to interpolated samples."""

    def __init__(self):
        super().__init__()
        self.critic = _Critic()

    def forward(self, real, fake, eps):
        mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
        score = self.critic(mixed)
        (g,) = torch.autograd.grad(score, mixed, torch.ones_like(score), create_graph=True, retain_graph=True)
        penalty = (g.norm(2, dim=1) - 1).pow(2).mean()
        return self.critic(fake).mean() - self.critic(real).mean() + 10 * penalty


def test_wgan_gp_gradient_penalty_trains_under_compile():
    torch.manual_seed(0)
    model, eager = _WGANGP().double(), _WGANGP().double()
    eager.load_state_dict(model.state_dict())
    step = fxtools.compile(model)
    g = torch.Generator().manual_seed(3)
    for n in (4, 6):
        real, fake = torch.randn(2, n, 3, generator=g, dtype=D)
        eps = torch.rand(n, 1, generator=g, dtype=D)
        model.zero_grad()
        eager.zero_grad()
        step(real, fake, eps).backward()
        eager(real, fake, eps).backward()
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)


class _Maml(torch.nn.Module):
    """An inner gradient step on the parameters inside the loss (a second derivative to train)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, xs, ys, xq, yq):
        params = list(self.parameters())
        inner = (self.lin(xs) - ys).pow(2).mean()
        w, b = [p - 0.1 * g for p, g in zip(params, torch.autograd.grad(inner, params, create_graph=True))]
        return (F.linear(xq, w, b) - yq).pow(2).mean()


class _NoGradScale(torch.nn.Module):
    """A value computed under no_grad between the input and the output carries no gradient."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.drop = torch.nn.Dropout(0.5).eval()  # draws nothing: replayed like any op

    def forward(self, x, y):
        x = x.clone().requires_grad_()
        h = self.drop(self.lin(x))
        with torch.no_grad():
            s = h.abs().max()
        u = (h / s).tanh() * h * y
        (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return g.pow(2).sum() + u.sum()


@pytest.mark.parametrize("cls, n_args", [(_Maml, 4), (_NoGradScale, 2)])
def test_parameter_gradients_and_no_grad_blocks_train_under_compile(cls, n_args):
    torch.manual_seed(0)
    model, eager = cls().double(), cls().double()
    eager.load_state_dict(model.state_dict())
    step = fxtools.compile(model)
    g = torch.Generator().manual_seed(4)
    args = [torch.randn(5, 3 if i % 2 == 0 else 1, generator=g, dtype=D) for i in range(n_args)]
    step(*args).backward()
    eager(*args).backward()
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **TOL)


def _backward_inside(p, x):
    loss = pinn_mlp.u(p, x).sum()
    loss.backward()
    return loss


def _grad_through_dropout(p, x):
    x = x.requires_grad_()
    u = F.dropout(pinn_mlp.u(p, x), 0.5, training=True)
    return torch.autograd.grad(u.sum(), x, create_graph=True)[0].sum()


def _grad_reading_a_value_written_later(p, x):  # eager: "modified by an inplace operation"
    x = x.requires_grad_()
    c = p["b1"] * 1.0
    u = torch.tanh(x @ p["w1"]) * c
    c.add_(1.0)
    return torch.autograd.grad(u.sum(), x, create_graph=True)[0].sum()


@pytest.mark.parametrize(
    "f, what, why",
    [
        (_backward_inside, r"\.backward\(\)", "autograd"),
        (_grad_through_dropout, "torch.autograd.grad", "random op"),
        (_grad_reading_a_value_written_later, "torch.autograd.grad", "written in place"),
    ],
)
def test_what_is_still_refused_names_the_line(f, what, why):
    p, x = pinn_mlp.mlp_params(2), torch.rand(3, 2, dtype=D)
    with pytest.raises(fxtools.FxtoolsError, match=rf"{what} \(at .*test_autograd_inside.py:\d+.*{why}"):
        fxtools.grad(f, p, x)


def test_an_unused_input_without_allow_unused_raises_eagers_error():
    def f(p, x):
        x = x.requires_grad_()
        return torch.autograd.grad(pinn_mlp.u(p, x).sum(), [x, p["b1"] * 1.0])[0].sum()

    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        fxtools.grad(f, pinn_mlp.mlp_params(3), torch.rand(3, 2, dtype=D))


def _input_gradient(p, x):
    x = x.requires_grad_()
    u = pinn_mlp.u(p, x)
    return torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]


def test_vjp_of_an_input_gradient_is_eagers_second_derivative():
    p, x = pinn_mlp.mlp_params(5), torch.rand(4, 2, dtype=D)
    v = torch.randn(4, 2, dtype=D, generator=torch.Generator().manual_seed(6))
    out, (gp, gx) = fxtools.vjp(_input_gradient, p, x)(p, x, v)
    leaves = {k: t.clone().requires_grad_() for k, t in p.items()}
    xl = x.clone().requires_grad_()
    du = _input_gradient(leaves, xl)
    want = torch.autograd.grad(du, [*leaves.values(), xl], v)
    torch.testing.assert_close(out, du.detach(), **TOL)
    torch.testing.assert_close([*gp.values(), gx], list(want), **TOL)


def _sliced_second_derivative(p, x):
    """u_xx summed over rows 1.. and every other row: slices along the marked batch size."""
    x = x.requires_grad_()
    u = pinn_mlp.u(p, x)
    (du,) = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)
    (d2u,) = torch.autograd.grad(du[1:, 0].sum() + du[::2, 1].sum(), x, create_graph=True)
    return (du[:-1, 1] - d2u[1:, 0]).pow(2).mean() + du.narrow(0, 0, 2).pow(2).sum()


def test_sliced_gradient_differentiated_again_with_a_dynamic_batch():
    """Slices along a marked size (``du[1:]``, ``du[::2]``, ``narrow``) of a first gradient,
    differentiated again: the slice's VJP and the view passes stay symbolic in the size (they
    once specialised it: a refusal). From 3 rows: at 2, PyTorch's contiguity check of a one-row
    slice guards ``batch - 1 != 1`` (docs/security.md)."""
    from torch.export import Dim

    p = pinn_mlp.mlp_params(6)
    batch = Dim("batch", min=3, max=64)
    gm = fxtools.grad(_sliced_second_derivative, p, torch.rand(5, 2, dtype=D), dynamic_shapes=(None, {0: batch}))
    for n in (3, 4, 8):
        a = torch.rand(n, 2, dtype=D)
        torch.testing.assert_close(list(gm(p, a).values()), _eager_grad(_sliced_second_derivative, p, a), **TOL)
