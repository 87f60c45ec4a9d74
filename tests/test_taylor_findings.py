"""Taylor mode on the programs a new user wrote (issue 37's adversarial findings), float64, against
torch.func: each once crashed or was refused naming an op the user never wrote."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from taylor_oracle import F64, close, randn, trace_of_hessian

import fxtools

pytestmark = pytest.mark.usefixtures("float64")


def second_derivative(f, x, v, w):
    """``d^2/dt^2 f(x + t v + t^2/2 w)`` at 0: ``v' H v + J w``, by torch.func."""
    out = f(x)
    H = torch.func.hessian(f)(x).reshape(*out.shape, x.numel(), x.numel())
    return H @ v.reshape(-1) @ v.reshape(-1) + torch.func.jvp(f, (x,), (w,))[1]


def slice_assignment(x):
    z = torch.zeros(6, dtype=x.dtype)
    z[1:5] = x**2  # the stencil idiom
    return z.sin() * z.sum()


def in_place_on_slices(x):
    z = x.clone() * 2
    z[1:3] *= x[:2]
    z[2:] += 1
    z[:2].mul_(x[2:].exp())
    return z.exp()


PROGRAMS = {
    "pow_zero": lambda x: x**0 * x.sin() + x.pow(0.0) * x**2 + x**0,
    "max_min_of_two": lambda x: torch.max(x, 2 * x.flip(0)) + torch.min(x.sin(), x.cos()) * x,
    "infinity_norm": lambda x: torch.linalg.vector_norm(x, math.inf) * x.sin() + x.norm(-math.inf) * x,
    "normalize": lambda x: F.normalize(x.view(2, 2), dim=1).sin().reshape(4) * x,
    "as_other": lambda x: (
        (x * x).view_as(x)
        + (x[:1] * x[1:2]).expand_as(x) * x
        + x.exp().reshape_as(x.view(2, 2)).sum(0).repeat(2)
        + x.sin().type_as(x)
    ),
    "slice_assignment": slice_assignment,
    "in_place_on_slices": in_place_on_slices,
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_laplacian_and_jet_of_adversarial_programs(name):
    f = PROGRAMS[name]
    x = randn(4, seed=1)
    lap = fxtools.laplacian(f, x)
    jet = fxtools.jet(f, x, order=2)
    for seed in (2, 3):
        x, v, w = randn(4, seed=seed), randn(4, seed=seed + 10), randn(4, seed=seed + 20)
        out, delta = lap(x)
        close(out, f(x))
        close(delta, trace_of_hessian(f, x))
        out, (d1, d2) = jet(x, (v, w))
        close(d1, torch.func.jvp(f, (x,), (v,))[1])
        close(d2, second_derivative(f, x, v, w))


def test_pow_zero_inside_vmap():
    """``x ** 0`` has no Taylor terms: a constant, also when the module is batched."""
    f = PROGRAMS["pow_zero"]
    xs = randn(3, 4, seed=4)
    lap = fxtools.laplacian(lambda x: f(x).sum(), xs[0])
    for batched in (torch.func.vmap(lap), fxtools.vmap(lap, xs)):
        out, delta = batched(xs)
        close(out, torch.func.vmap(lambda x: f(x).sum())(xs))
        close(delta, torch.stack([trace_of_hessian(lambda x: f(x).sum(), x) for x in xs]))


def mlp_with(layer):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), layer, nn.Tanh(), nn.Linear(5, 2)).to(F64)


@pytest.mark.parametrize("transform", ["laplacian", "jet"])
def test_batch_norm_in_train_mode_leaves_buffers_as_eager(transform):
    model = mlp_with(nn.BatchNorm1d(5))
    eager = copy.deepcopy(model)
    x = randn(6, 4, seed=5)
    gm = fxtools.laplacian(model, x) if transform == "laplacian" else fxtools.jet(model, x, order=1)
    for name, buf in model.named_buffers():  # building reads the buffers, never writes them
        assert not buf.requires_grad and buf.is_leaf, name
        close(buf, dict(eager.named_buffers())[name])
    for _ in range(2):
        out = gm(x)[0] if transform == "laplacian" else gm(x, (x,))[0]
        close(out, eager(x))
    for (name, buf), want in zip(model.named_buffers(), eager.buffers()):
        assert not buf.requires_grad and buf.is_leaf, name
        close(buf, want)
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    model(x).sum().backward()  # the next eager step runs


def test_batch_norm_laplacian_matches_torch_func():
    model = mlp_with(nn.BatchNorm1d(5))
    x = randn(6, 4, seed=6)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    def f(x):
        return torch.func.functional_call(model, (params, {k: v.clone() for k, v in buffers.items()}), (x,))

    _, delta = fxtools.laplacian(model, x)(x)
    close(delta.detach(), trace_of_hessian(f, x))
    model.eval()
    _, delta = fxtools.laplacian(model, x)(x)
    close(delta.detach(), trace_of_hessian(model, x).detach())


@pytest.mark.parametrize("layer", [nn.Dropout(0.4), nn.Dropout1d(0.4)])
def test_dropout_draws_eager_numbers(layer):
    model = mlp_with(layer)
    x = randn(6, 4, seed=7) if isinstance(layer, nn.Dropout) else randn(3, 4, seed=7)
    lap = fxtools.laplacian(model, x)
    jet = fxtools.jet(model, x, order=2)
    torch.manual_seed(11)
    want = model(x)
    torch.manual_seed(11)
    close(lap(x)[0], want)
    torch.manual_seed(11)
    close(jet(x, (x, x))[0], want)
    torch.manual_seed(11)
    mask = layer(torch.ones(x.shape[0], 5, dtype=F64))
    torch.manual_seed(11)
    _, delta = lap(x)

    def f(x):  # the same mask, fixed
        return model[3](torch.tanh(model[0](x) * mask))

    close(delta.detach(), trace_of_hessian(f, x).detach())


def test_complex_input_is_refused_at_build():
    z = torch.randn(4, dtype=torch.complex128)
    for build in (lambda: fxtools.laplacian(lambda z: (z * z).sum(), z), lambda: fxtools.jet(torch.sin, z, order=2)):
        with pytest.raises(ValueError, match="real inputs.*view_as_real"):
            build()


W1, W2 = randn(3, 8, seed=30), randn(8, seed=31)


def u(x):
    h = torch.tanh(x @ W1)
    return h @ W2


def test_code_keeps_products_as_written_and_names_the_value():
    x = randn(3, seed=32)
    lap, jet = fxtools.laplacian(u, x), fxtools.jet(u, x, order=2)
    for gm, terms in ((lap, ["u_lap"]), (jet, ["u_d1", "u_d2"])):
        code = gm.code
        assert "h_matmul = x @ W1" in code and "u = h @ W2" in code, code
        assert "unsqueeze" not in code and "torch.mm" not in code and "loss" not in code, code
        for t in terms:
            assert f"{t} = " in code, code
    assert "h_matmul_d1 = series_0 @ W1" in jet.code and "h_matmul_d2 = series_1 @ W1" in jet.code
    out, delta = lap(x)
    close(out, u(x))
    close(delta, trace_of_hessian(u, x))


WHERE_PROGRAMS = {
    # the NaN-safe log: autograd's where backward sends a zero cotangent through log, 0 * inf = NaN
    "log or 0": lambda x: (torch.where(x > 0, torch.log(x), 0) ** 2).sum(),
    "log or sqrt": lambda x: (torch.where(x > 0, torch.log(x.abs() + 1), torch.sqrt(x.abs())) ** 2).sum(),
    "0 or log": lambda x: (torch.where(x <= 0, 0.0, torch.log(x)) * x).sum(),
    # where inside PyTorch's decomposition (Taylor mode has no softplus rule): autograd
    # differentiates the op by its own formula, finite where exp overflows in the other branch
    "softplus": lambda x: F.softplus(x).sum(),
}


@pytest.mark.parametrize("name", list(WHERE_PROGRAMS))
@pytest.mark.parametrize("point", [[0.0, 1.5, -2.0], [0.5, 2.0, -0.7], [800.0, 0.0, 3.0]])
def test_where_with_an_infinite_unselected_branch_matches_autograd(name, point):
    """At a point where the branch torch.where does not take has an infinite derivative, every
    transform gives PyTorch's value: NaN in the gradient, hvp, Hessian and Laplacian (autograd's
    zero cotangent times inf), finite in torch.func.jvp (forward mode selects the tangent)."""
    f, x = WHERE_PROGRAMS[name], torch.tensor(point, dtype=F64)
    v = randn(3, seed=1)
    same = dict(rtol=1e-10, atol=1e-10, equal_nan=True)
    torch.testing.assert_close(fxtools.laplacian(f, x)(x)[1], trace_of_hessian(f, x), **same)
    torch.testing.assert_close(fxtools.grad(f, x)(x), torch.func.grad(f)(x), **same)
    torch.testing.assert_close(fxtools.hvp(f, x)(x, v), torch.func.jvp(torch.func.grad(f), (x,), (v,))[1], **same)
    torch.testing.assert_close(fxtools.jvp(f, x)(x, v), torch.func.jvp(f, (x,), (v,)), **same)


def test_where_inside_a_decomposition_keeps_the_ops_own_derivative():
    """sinc's decomposition divides by x where x != 0: its Laplacian at 0 is autograd's finite value."""
    x = torch.tensor([0.0, 1.5, -2.0], dtype=F64)
    close(fxtools.laplacian(lambda x: torch.sinc(x).sum(), x)(x)[1], trace_of_hessian(lambda x: torch.sinc(x).sum(), x))
