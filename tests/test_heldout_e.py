"""Held-out adversarial programs (JVP losses, PINN operators, NaN finding): the findings of a
review, each minimised to a cheap regression test against eager PyTorch in float64.

- ``nn.GroupNorm`` of a non-contiguous tensor (``gn(x.transpose(1, 2))``, a token sequence normed
  over channels) crashed every module at its first call: the rule called ``native_group_norm``,
  whose CPU kernel refuses other layouts, on the input as it came (eager's ``group_norm`` makes
  it contiguous first); a module built on a contiguous example refused a transposed call too.
- ``torch.autograd.grad(u, x, create_graph=True)`` inside a traced program (the usual way PINN
  losses take input derivatives) gave a module returning a *FakeTensor*: the trace baked a fake
  constant (``tanh`` of the example) into the code and dropped the derivative's dependence on the
  inputs. Then refused naming the line; now the gradient is taken from the trace
  (``capture/autograd_grad.py``), and both that spelling and the torch.func one are checked
  against autograd's double backward. ``.backward()`` inside the program is still refused.
"""

from __future__ import annotations

import pinn_mlp
import pytest
import torch
import torch.nn.functional as F

import fxtools

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _group_norm_loss(x):
    w = torch.linspace(0.5, 1.5, x.shape[1], dtype=x.dtype)
    return (F.group_norm(x, 2, w, 1 - w) * torch.arange(x.shape[-1], dtype=x.dtype)).pow(2).sum()


def _transposed_group_norm_loss(x):
    return _group_norm_loss(x.transpose(1, 2))


@pytest.mark.parametrize("f, shape", [(_transposed_group_norm_loss, (3, 5, 4)), (_group_norm_loss, (3, 4, 5))])
def test_group_norm_of_a_non_contiguous_tensor(f, shape):
    g = _gen(0)
    x = torch.randn(shape, generator=g, dtype=D)
    other = torch.randn(shape[0], shape[2], shape[1], generator=g, dtype=D).transpose(1, 2)  # another layout
    grad, jvp, hvp = fxtools.grad(f, x), fxtools.jvp(f, x), fxtools.hvp(f, x)
    for a in (x, other):
        v = torch.randn(a.shape, generator=g, dtype=D)
        torch.testing.assert_close(grad(a), torch.func.grad(f)(a), **TOL)
        torch.testing.assert_close(jvp(a, v)[1], torch.func.jvp(f, (a,), (v,))[1], **TOL)
        torch.testing.assert_close(hvp(a, v), torch.func.jvp(torch.func.grad(f), (a,), (v,))[1], **TOL)


def _pinn_with_autograd_grad(p, x):
    x = x.requires_grad_(True)
    u = pinn_mlp.u(p, x)
    (du,) = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)
    return (du.pow(2).sum(-1) - 1).pow(2).mean()


def _pinn_with_backward(p, x):
    loss = pinn_mlp.u(p, x).sum()
    loss.backward()
    return loss


def test_backward_inside_a_traced_program_is_refused_naming_the_line():
    p, x = pinn_mlp.mlp_params(0, w=8), torch.rand(5, 2, dtype=D)
    with pytest.raises(fxtools.FxtoolsError, match=r"\.backward\(\).*test_heldout_e.py:\d+: .*torch.func.grad"):
        fxtools.grad(_pinn_with_backward, p, x)


def _pinn_with_torch_func(p, x):  # the same loss, written with torch.func
    du = torch.func.vmap(torch.func.grad(lambda y: pinn_mlp.u(p, y)))(x)
    return (du.pow(2).sum(-1) - 1).pow(2).mean()


@pytest.mark.parametrize("loss", [_pinn_with_autograd_grad, _pinn_with_torch_func])
def test_an_input_derivative_loss_matches_eager_double_backward(loss):
    p, x = pinn_mlp.mlp_params(1, w=8), torch.rand(5, 2, dtype=D)
    gm = fxtools.grad(loss, p, x)
    for a in (x, torch.rand(2, 5, dtype=D).T):
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        want = torch.autograd.grad(_pinn_with_autograd_grad(leaves, a.clone()), list(leaves.values()))  # eager double backward
        torch.testing.assert_close(list(gm(p, a).values()), list(want), **TOL)


class _TokenDenoiser(torch.nn.Module):
    """A consistency-model denoiser of token sequences: Fourier time embedding, FiLM, GroupNorm
    over channels of a (batch, tokens, channels) tensor (so of a transposed view)."""

    def __init__(self, d=8):
        super().__init__()
        self.register_buffer("freq", torch.linspace(1.0, 4.0, 4))
        self.film = torch.nn.Linear(8, 2 * d)
        self.inp = torch.nn.Linear(d, d)
        self.gn = torch.nn.GroupNorm(2, d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x, t):
        a = t[:, None] * self.freq
        scale, shift = self.film(torch.cat([a.sin(), a.cos()], -1))[:, None].chunk(2, -1)
        h = F.silu(self.inp(x))
        h = self.gn(h.transpose(1, 2)).transpose(1, 2) * (1 + scale) + shift
        return self.out(h)


class _ConsistencyLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _TokenDenoiser()

    def forward(self, x, t, v):
        f, df = torch.func.jvp(self.net, (x, t), (v, torch.ones_like(t)))
        return (f - (x - t[:, None, None] * df).detach()).pow(2).mean()


def test_a_consistency_loss_with_group_norm_over_tokens_trains_under_compile():
    torch.manual_seed(0)
    model = _ConsistencyLoss().double()
    eager = _ConsistencyLoss().double()
    eager.load_state_dict(model.state_dict())
    step = fxtools.compile(model)
    g = _gen(2)
    for _ in range(2):
        x, v = torch.randn(2, 3, 5, 8, generator=g, dtype=D)
        t = torch.rand(3, generator=g, dtype=D)
        model.zero_grad()
        eager.zero_grad()
        got, want = step(x, t, v), eager(x, t, v)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, **TOL)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL)


_ACTIVATIONS = {
    "silu": F.silu,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "logsigmoid": F.logsigmoid,
}


def _pinn_loss(act, nested):
    """A PINN loss: the squared Laplacian of an MLP at each point, from per-point Hessians."""

    def u(p, x):
        return act(x @ p["w1"] + p["b1"]) @ p["w2"]

    def loss(p, xs):
        h = torch.func.vmap(nested(lambda y: u(p, y)))(xs)
        return (h.diagonal(0, 1, 2).sum(-1) + 1).pow(2).mean() + u(p, xs).pow(2).mean()

    return loss


@pytest.mark.parametrize(
    "name, nested, layout",
    [
        ("silu", torch.func.hessian, (5, False)),
        ("silu", lambda f: torch.func.jacfwd(torch.func.jacrev(f)), (3, True)),
        ("mish", torch.func.hessian, (3, True)),
        ("mish", lambda f: torch.func.jacfwd(torch.func.jacrev(f)), (5, False)),
        *[(name, torch.func.hessian, (4, True)) for name in ("hardswish", "gelu_tanh", "logsigmoid")],
    ],
)
def test_per_point_hessians_of_a_network_inside_a_transformed_program(name, nested, layout):
    """``vmap(hessian(f))`` / ``vmap(jacfwd(jacrev(f)))`` inside ``fxtools.grad`` (once refused for
    SiLU and Mish, and for any activation at a transposed input: functorch's forward-mode wrappers
    asked for ``meta`` tensors under FakeTensors); oracle: eager torch.func."""
    g = _gen(4)
    p = {
        "w1": torch.randn(2, 6, generator=g, dtype=D),
        "b1": torch.randn(6, generator=g, dtype=D),
        "w2": torch.randn(6, generator=g, dtype=D),
    }
    n, transposed = layout
    xs = 2 * torch.randn(2, n, generator=g, dtype=D).T if transposed else 2 * torch.randn(n, 2, generator=g, dtype=D)
    loss = _pinn_loss(_ACTIVATIONS[name], nested)
    got, want = fxtools.grad(loss, p, xs)(p, xs), torch.func.grad(loss)(p, xs)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)


def test_per_point_hessians_of_a_module_at_a_transposed_input():
    """The same through ``fxtools.functional`` of an ``nn.Sequential`` (a point as a batch of one):
    at a transposed input forward-mode autograd once asked for ``meta`` zeros even for tanh."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    fn = fxtools.functional(net)
    p = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p, xs):
        h = torch.func.vmap(torch.func.hessian(lambda x: fn(p, x[None])[0, 0]))(xs)
        return (h.diagonal(0, 1, 2).sum(-1) + 1).pow(2).mean()

    xs = torch.rand(2, 6, generator=_gen(5), dtype=D).T
    got, want = fxtools.grad(loss, p, xs)(p, xs), torch.func.grad(loss)(p, xs)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)


def test_per_point_second_derivatives_of_a_silu_network_by_jvp_of_grad():
    """Per-point Hessian-vector products of a SiLU network (``vmap(jvp(grad))``), whose Laplacian
    matches eager ``vmap(hessian)``."""
    g = _gen(3)
    w1, w2 = torch.randn(2, 6, generator=g, dtype=D), torch.randn(6, generator=g, dtype=D)

    def u(w1, x):
        return F.silu(x @ w1) @ w2

    def loss(w1, xs):  # the Laplacian of u at each point, as a sum of two Hessian-vector products
        def lap(x):
            e = torch.eye(2, dtype=x.dtype)
            return sum(torch.func.jvp(torch.func.grad(lambda y: u(w1, y)), (x,), (e[i],))[1][i] for i in range(2))

        return torch.func.vmap(lap)(xs).pow(2).mean()

    xs = torch.randn(5, 2, generator=g, dtype=D)
    gm = fxtools.grad(loss, w1, xs)
    for a in (xs, torch.randn(2, 5, generator=g, dtype=D).T):
        want = torch.func.grad(
            lambda w: torch.func.vmap(torch.func.hessian(lambda y: u(w, y)))(a).diagonal(0, 1, 2).sum(-1).pow(2).mean()
        )(w1)
        torch.testing.assert_close(gm(w1, a), want, **TOL)
