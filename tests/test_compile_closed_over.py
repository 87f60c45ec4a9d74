"""fxtools.compile of programs that read tensors requiring grad from outside their arguments (a
global model inside a loss function, a closed-over weight): the tensors are inputs of the graphs,
and their ``.grad`` is what eager autograd accumulates. Oracle: eager autograd in float64."""

import pytest
import torch
import torch.nn as nn

import fxtools

D = torch.float64


def _x(*shape, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=D, generator=g).requires_grad_(requires_grad)


def _model_and_weight():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(D), _x(3, 3, seed=5, requires_grad=True)


def _loss_of(model, w):
    def loss(x, y, *, scale=1.0):
        return ((model(x @ w) - y) ** 2).mean() * scale + (w**2).sum() * 0.1

    return loss


def test_a_loss_function_reading_a_model_and_a_weight_trains_as_eager():
    """Several AdamW steps: the loss, the closed-over leaves' gradients, the argument's gradient
    and the parameters after each step equal eager's (a keyword argument among the inputs)."""
    (m1, w1), (m2, w2) = _model_and_weight(), _model_and_weight()
    compiled, eager = fxtools.compile(_loss_of(m1, w1)), _loss_of(m2, w2)
    leaves1, leaves2 = [w1, *m1.parameters()], [w2, *m2.parameters()]
    opt1, opt2 = torch.optim.AdamW(leaves1, lr=0.05), torch.optim.AdamW(leaves2, lr=0.05)
    y = _x(5, 1, seed=2)
    for step in range(3):
        x1, x2 = _x(5, 3, seed=10 + step, requires_grad=True), _x(5, 3, seed=10 + step, requires_grad=True)
        opt1.zero_grad()
        opt2.zero_grad()
        got, want = compiled(x1, y, scale=2.0), eager(x2, y, scale=2.0)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)
        for a, b in zip(leaves1, leaves2):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
        opt1.step()
        opt2.step()
        for a, b in zip(leaves1, leaves2):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert len(compiled._runners) == 1  # one split served every step


GLOBAL_W = _x(3, seed=1, requires_grad=True)


def _reads_global(x):
    return (x * GLOBAL_W).sin().sum()


def test_a_rebound_global_tensor_is_the_one_differentiated():
    global GLOBAL_W
    x = _x(4, 3)
    compiled = fxtools.compile(_reads_global)
    old = GLOBAL_W
    try:
        for seed in (1, 2):
            GLOBAL_W = _x(3, seed=seed, requires_grad=True)
            compiled(x).backward()
            torch.testing.assert_close(GLOBAL_W.grad, (x * GLOBAL_W).cos().mul(x).sum(0).detach(), rtol=1e-12, atol=1e-12)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), _reads_global(x))
        assert old.grad is None
    finally:
        GLOBAL_W = old


class ReadsAGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3).to(D)

    def forward(self, x):
        return (self.lin(x) @ GLOBAL_W).tanh().sum()


def test_a_compiled_module_reading_a_global_tensor():
    model = ReadsAGlobal()
    x = _x(4, 3)
    fxtools.compile(model)(x).backward()
    got = [GLOBAL_W.grad, *(p.grad for p in model.parameters())]
    GLOBAL_W.grad = None
    model.zero_grad()
    model(x).backward()
    want = [GLOBAL_W.grad, *(p.grad for p in model.parameters())]
    GLOBAL_W.grad = None
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_closed_over_leaf_that_does_not_require_grad_stays_a_constant(requires_grad):
    torch.manual_seed(0)
    model = nn.Linear(5, 1).double().requires_grad_(requires_grad)

    def loss_fn(x):
        return model(x).pow(2).mean()

    x = _x(3, 5, requires_grad=True)
    fxtools.compile(loss_fn, x)(x).backward()
    got = [x.grad, model.weight.grad]
    x.grad = model.weight.grad = None
    loss_fn(x).backward()
    for a, b in zip(got, [x.grad, model.weight.grad]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
