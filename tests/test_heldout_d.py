"""Held-out adversarial programs (JVP losses, budgets, NaN finding, compiled modules): the findings
of a review, each minimised to a cheap regression test against eager PyTorch in float64.

- A module buffer the program reassigns (``self.avg = 0.9 * self.avg + 0.1 * m``, the EMA idiom)
  was replaced by a traced value while fxtools captured the program, and the first call of the
  compiled module refused it ("was replaced by another object"); it is now written in place, as
  eager's values are, through fxtools.grad, fxtools.compile (with and without Inductor) and backend().
- Any other tensor assigned to a module attribute (``self.last_metric = m``) left a FakeTensor in
  the module (a crash at its next use, a value never updated): refused, naming the line.
- Outputs of a compiled step that autograd connects to no input (a ``.detach()``-ed metric, a value of
  buffers only) had a ``grad_fn``; eager gives none, and keeping one (a buffer assigned from it under
  ``torch.compile``) made the next step's backward run into the previous step's graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxtools

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


class EMAModel(nn.Module):
    """A JVP loss whose scale is an exponential moving average kept in a buffer, reassigned each step."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x, v):
        u, du = torch.func.jvp(lambda x: torch.tanh(self.fc(x)), (x,), (v,))
        self.scale = 0.9 * self.scale + 0.1 * du.abs().mean(0).detach()
        return ((u - du.detach()) / self.scale).pow(2).mean()


def _data(seed, b=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, generator=g, dtype=D), torch.randn(b, 3, generator=g, dtype=D)


@pytest.mark.parametrize("how", ["compile", "backend"])  # Inductor: checked by hand (its cold compile costs ~30 s)
def test_a_reassigned_buffer_is_written_in_place(how):
    torch.manual_seed(0)
    model = EMAModel().double()
    eager = copy.deepcopy(model)
    if how == "backend":
        torch._dynamo.reset()
        step = torch.compile(model, backend=fxtools.backend())
    else:
        step = fxtools.compile(model, compiler="inductor" if how == "inductor" else None)
    for i in range(3):
        x, v = _data(i)
        got, want = step(x, v), eager(x, v)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(model.scale, eager.scale, **TOL)
        torch.testing.assert_close(model.fc.weight.grad, eager.fc.weight.grad, **TOL)
    assert type(model.scale) is torch.Tensor


def test_a_reassigned_buffer_through_fxtools_grad():
    torch.manual_seed(0)
    model = EMAModel().double()
    eager = copy.deepcopy(model)
    loss = fxtools.functional(model)
    params = {k: p.detach() for k, p in model.named_parameters()}
    x, v = _data(0)
    gm = fxtools.grad(loss, params, x, v)
    assert type(model.scale) is torch.Tensor and torch.equal(model.scale, torch.ones(3, dtype=D))  # tracing wrote nothing
    got = gm(params, x, v)
    want = torch.func.grad(fxtools.functional(eager))(params, x, v)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(model.scale, eager.scale, **TOL)


class Metric(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        u = torch.tanh(self.fc(x))
        self.last_metric = u.abs().max().detach()
        return u.pow(2).mean()


def test_a_tensor_assigned_to_a_plain_attribute_is_refused_naming_the_line():
    model = Metric().double()
    x, _ = _data(1)
    with pytest.raises(fxtools.FxtoolsError, match=r"self.last_metric = u.abs\(\).max\(\).detach\(\).*register_buffer"):
        fxtools.compile(model)(x)
    assert "last_metric" not in vars(model)  # no traced value left behind


def test_outputs_connected_to_no_input_have_no_grad_fn():
    w = torch.randn(3, 3, dtype=D, requires_grad=True)

    def f(x, buf):
        u = torch.tanh(x @ w)
        return u.pow(2).mean(), u.mean(0).detach(), buf * 2

    x, buf = _data(2)
    want = [o.requires_grad for o in f(x, buf)]
    assert want == [True, False, False]
    torch._dynamo.reset()
    for step in (fxtools.compile(f), torch.compile(f, backend=fxtools.backend())):
        outs = step(x, buf)
        assert [o.requires_grad for o in outs] == want
        torch.testing.assert_close(torch.autograd.grad(outs[0], w)[0], torch.autograd.grad(f(x, buf)[0], w)[0], **TOL)


def test_a_tangent_direction_computed_under_no_grad():
    """The JVP's direction computed by the same network under ``no_grad`` (consistency models' targets):
    forward mode's code was moved into the ``no_grad`` block, beside the direction it reads, and its
    values became constants of the backward (a gradient off by 2.1, silently)."""
    g = torch.Generator().manual_seed(0)
    w, x = (torch.randn(3, 3, generator=g, dtype=D) for _ in range(2))

    def loss(w, x):
        with torch.no_grad():
            d = torch.tanh(x @ w)
        u, du = torch.func.jvp(lambda x: torch.sin(x @ w), (x,), (d,))
        return (u - du).pow(2).sum()

    torch.testing.assert_close(fxtools.grad(loss, w, x)(w, x), torch.func.grad(loss)(w, x), **TOL)
    model = nn.Linear(3, 3, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w.T)

    def module_loss(x):
        with torch.no_grad():
            d = torch.tanh(model(x))
        u, du = torch.func.jvp(lambda x: torch.tanh(model(x)), (x,), (d,))
        return (u - du).pow(2).mean()

    fxtools.compile(module_loss)(x).backward()
    want = torch.autograd.grad(module_loss(x), model.weight)[0]
    torch.testing.assert_close(model.weight.grad, want, **TOL)


class ParamJvpLoss(nn.Module):
    """A loss with the network's JVP along one weight (a tangent of 0.1s) times its value."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(7, 12), nn.Linear(12, 6)

    def forward(self, x, t):
        xt = torch.cat([x, t[:, None]], -1)
        u, du = torch.func.jvp(
            lambda w: self.b(torch.tanh(nn.functional.linear(xt, w, self.a.bias))),
            (self.a.weight,),
            (torch.ones_like(self.a.weight) * 0.1,),
        )
        return (u * du).mean()


def test_a_budget_level_no_candidate_reaches_takes_the_least_peak():
    """A budget level where no candidate both fits its bytes and recomputes at least what the
    larger levels do takes the least peak that fits (it crashed: ``min() arg is an empty sequence``)."""
    torch.manual_seed(0)
    model = ParamJvpLoss().double()
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(3, 6, generator=g, dtype=D), torch.rand(3, generator=g, dtype=D)
    loss = fxtools.functional(model)
    params = {k: p.detach() for k, p in model.named_parameters()}
    split = fxtools.split(loss, params, x, t, policy=fxtools.policies.budget(0.3))
    value, grads = split.vjp(params, x, t)
    want = torch.func.grad_and_value(loss)(params, x, t)
    torch.testing.assert_close(value, want[1], **TOL)
    for k in params:
        torch.testing.assert_close(grads[0][k], want[0][k], **TOL)
