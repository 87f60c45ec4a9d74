"""``torch.no_grad()`` blocks that read or write tensors requiring grad the program closes over
(a module's parameters): spectral normalisation's power iteration (``F.normalize(..., out=u)``),
weight clipping in place, an exponential moving average of a student's weights, a scale computed
from a weight. The generated code has no ``no_grad`` block, so it must read such values detached:

- building does not fail where eager runs (``out=`` and a parameter's in-place write refuse
  arguments that require grad);
- autograd run over the generated code (a gradient penalty: ``fxtools.grad`` in ``x``, then
  ``backward`` to the parameters) treats the block's values as constants, as eager does.

Oracle: eager autograd in float64 (``create_graph=True`` for the second order), the modules'
buffers and parameters compared after each call.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import fxtools

D = torch.float64


def _close(got, want, what=""):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _spectral_mlp():
    sn = torch.nn.utils.parametrizations.spectral_norm
    return torch.nn.Sequential(sn(torch.nn.Linear(4, 6)), torch.nn.Tanh(), sn(torch.nn.Linear(6, 1))).to(D)


class _Scaled(torch.nn.Module):
    """A scale computed from the weight under no_grad, then used with the weight."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3).to(D)

    def forward(self, x):
        with torch.no_grad():
            s = self.lin.weight.norm() + self.lin.bias.abs().sum()
        return torch.tanh(self.lin(x) / s).sum(-1)


class _Clipped(torch.nn.Module):
    """WGAN's weight clipping inside the forward: a parameter written in place under no_grad."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3).to(D)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.3, 0.3)
        return torch.sin(self.lin(x)).sum(-1)


class _Ema(torch.nn.Module):
    """A teacher updated from the student in place under no_grad (BYOL, MoCo), then read."""

    def __init__(self):
        super().__init__()
        self.student = torch.nn.Linear(4, 3).to(D)
        self.teacher = torch.nn.Linear(4, 3).to(D).requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)
        return (self.student(x) * self.teacher(x)).tanh().sum(-1)


class _Normalized(torch.nn.Module):
    """``F.normalize(..., out=)`` of a parameter's product into a buffer, as spectral norm does."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3).to(D)
        self.register_buffer("u", torch.ones(3, dtype=D))

    def forward(self, x):
        with torch.no_grad():
            F.normalize(self.lin.weight @ self.lin.weight.T @ self.u, dim=0, out=self.u)
        return torch.tanh(self.lin(x) @ self.u.clone())


MODELS = {"spectral_norm": _spectral_mlp, "scaled": _Scaled, "clipped": _Clipped, "ema": _Ema, "normalized": _Normalized}


def _state(model):
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


@pytest.mark.parametrize("name", list(MODELS))
def test_gradient_and_state_equal_eager_over_calls(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=D)
    g = fxtools.grad(lambda x: model(x).sum(), x)
    for call in range(3):
        xr = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(eager(xr).sum(), xr)
        _close(g(x), want, f"call {call}: gradient")
        for a, b in zip(_state(model), _state(eager)):
            _close(a, b, f"call {call}: parameters and buffers")
        for a, b in zip(model.parameters(), eager.parameters()):
            assert (a.requires_grad, a.is_leaf) == (b.requires_grad, b.is_leaf), "parameters stay leaves as in eager"
        x = x + 0.1


@pytest.mark.parametrize("name", list(MODELS))
def test_gradient_penalty_to_the_parameters_equals_eager(name):
    """Autograd over the generated gradient: the no_grad block's values are constants (0.35 off
    on ``scaled`` when its scale was differentiated)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=D)
    g = fxtools.grad(lambda x: model(x).sum(), x)
    params, eager_params = list(model.parameters()), list(eager.parameters())
    trained = [i for i, p in enumerate(params) if p.requires_grad]
    penalty = (g(x).norm(dim=-1) - 1).pow(2).mean()
    got = torch.autograd.grad(penalty, [params[i] for i in trained], allow_unused=True, materialize_grads=True)
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(eager(xr).sum(), xr, create_graph=True)
    want = torch.autograd.grad(
        (gx.norm(dim=-1) - 1).pow(2).mean(), [eager_params[i] for i in trained], allow_unused=True, materialize_grads=True
    )
    for i, a, b in zip(trained, got, want):
        _close(a, b, f"penalty gradient of parameter {i}")


def test_spectral_norm_trains_under_compile_as_eager():
    torch.manual_seed(0)
    model = _spectral_mlp()
    eager = copy.deepcopy(model)
    step = fxtools.compile(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    for k in range(3):
        x = torch.randn(5, 4, dtype=D)
        got, want = step(x).pow(2).mean(), eager(x).pow(2).mean()
        got.backward()
        want.backward()
        _close(got, want, f"step {k}: loss")
        for a, b in zip(model.parameters(), eager.parameters()):
            _close(a.grad, b.grad, f"step {k}: gradient")
        for a, b in zip(model.buffers(), eager.buffers()):
            _close(a, b, f"step {k}: power iteration's vectors")
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_the_code_detaches_at_the_block_and_reads_the_clipped_parameter():
    """Readable: the clipped weight is written through a detached alias, and the forward reads the
    parameter itself afterwards (so its gradient to the parameter is eager's)."""
    model = _Clipped()
    x = torch.randn(5, 4, dtype=D)
    lines = [line.strip() for line in fxtools.grad(lambda x: model(x).sum(), x).code.splitlines()]
    assert "model_lin_weight_detach = torch.detach(model_lin_weight)" in lines, lines
    assert any(line.endswith("model_lin_weight_detach.clamp_(min=-0.3, max=0.3)") for line in lines), lines
    assert "lin = torch.nn.functional.linear(x, model_lin_weight, bias=model_lin_bias)" in lines, lines
    assert sum("= self.model_lin_weight" in line for line in lines) == 1, lines


@pytest.mark.parametrize("name", list(MODELS))
def test_jvp_hvp_and_vmap_equal_eager_and_keep_parameters_leaves(name):
    """Forward mode lets tangents through ``no_grad`` (the block's parameters are read detached
    there), ``vmap``'s code has no ``no_grad`` block: each builds, equals eager (the JVP of a sum
    is its gradient's dot product with the tangent; the HVP eager's double backward), updates the
    state as eager does, and leaves the parameters leaves (a JVP made the EMA teacher a non-leaf
    while building, vmap's code when called)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    eager = copy.deepcopy(model)
    x, v = torch.randn(5, 4, dtype=D), torch.randn(5, 4, dtype=D)
    built = {
        "jvp": fxtools.jvp(lambda x: model(x).sum(), x),
        "hvp": fxtools.hvp(lambda x: model(x).sum(), x),
        "vmap": fxtools.vmap(lambda x: model(x), x),
    }
    for kind, gm in built.items():
        xr = x.clone().requires_grad_()
        out = eager(xr)
        (g,) = torch.autograd.grad(out.sum(), xr, create_graph=True)
        if kind == "jvp":
            value, tangent = gm(x, v)
            _close(value, out.sum(), "jvp value")
            _close(tangent, (g * v).sum(), "jvp tangent")
        elif kind == "hvp":
            (want,) = torch.autograd.grad((g * v).sum(), xr, allow_unused=True, materialize_grads=True)
            _close(gm(x, v), want, "hvp")
        else:
            _close(gm(x), out, "vmap")
        for a, b in zip(_state(model), _state(eager)):
            _close(a, b, f"{kind}: parameters and buffers")
        assert all(p.is_leaf for p in model.parameters()), f"{kind} left a parameter tracked by autograd"


def test_autograd_over_vmap_code_sees_a_no_grad_block_of_the_inputs_as_constant():
    """vmap's code has no ``no_grad`` block: the values entering one are read detached, so autograd
    run over the batched code equals autograd over ``torch.func.vmap`` of the program."""

    def f(x):
        with torch.no_grad():
            s = x.abs().amax(-1, keepdim=True)
        return torch.sin(x) / s

    x = torch.randn(6, 4, dtype=D)
    batched = fxtools.vmap(f, x)
    xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    (got,) = torch.autograd.grad(batched(xr).pow(2).sum(), xr)
    (want,) = torch.autograd.grad(torch.func.vmap(f)(xe).pow(2).sum(), xe)
    _close(got, want, "gradient through the batched code")
    assert "x_detach = torch.detach(x)" in [line.strip() for line in batched.code.splitlines()], batched.code
