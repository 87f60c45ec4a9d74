"""Held-out programs (batch k): ``torch.nn`` layers trained through ``fxtools.compile`` and
``fxtools.split`` with each policy, against eager autograd in float64 over training steps (an
optimizer step between them): loss, every parameter's gradient, every buffer and every parameter
after the forward (layers that update them in place: BatchNorm's running statistics,
``nn.Embedding(max_norm=...)`` renormalising its weight), then the built module at other sizes
and on non-contiguous inputs.

Each ``test_*_was_*`` test is a program that crashed, hung or was refused before its fix; the
others guard layers that were exact when this batch was written.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtools
from fxtools import policies

D = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)


def _train_against_eager(make, batches, policy, steps=2, loss_of=None):
    """Train ``make()`` (float64) eagerly and through ``fxtools.compile`` side by side: SGD steps
    on ``batches[:steps]``, then the compiled module on each later batch (other sizes, layouts)."""
    torch.manual_seed(0)
    eager = make().to(D)
    model = copy.deepcopy(eager)
    compiled = fxtools.compile(model, *batches[0], policy=policy)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, batch in enumerate(batches):
        opt_e.zero_grad()
        opt_c.zero_grad()
        rng = torch.get_rng_state()
        want = eager(*batch)
        want = want if loss_of is None else loss_of(want)
        want.backward()
        torch.set_rng_state(rng)
        got = compiled(*batch)
        got = got if loss_of is None else loss_of(got)
        got.backward()
        torch.testing.assert_close(got, want, **TOL)
        for (name, w), g in zip(eager.named_parameters(), model.parameters()):
            if w.grad is None:
                assert g.grad is None or not g.grad.any(), name
            else:
                torch.testing.assert_close(g.grad, w.grad, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")
        for (name, w), g in zip([*eager.named_buffers(), *eager.named_parameters()], [*model.buffers(), *model.parameters()]):
            torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name: f"{name} after the forward: {m}")
        if i < steps:
            opt_e.step()
            opt_c.step()
    return compiled


# --- nn.Embedding(max_norm=...) renormalises the rows it looks up in place, through
# weight.detach(): refused ("it modifies, through .detach() or .data, an input that may be
# differentiated") although no differentiable op had read the weight before the write ---


class _MaxNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6, max_norm=0.5, norm_type=1.5)
        self.bag = nn.EmbeddingBag(10, 6, max_norm=0.7, mode="sum")
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: the head reads the renormalised rows

    def forward(self, idx, flat, offsets):
        h = self.emb(idx) + self.bag(flat, offsets)[:, None]
        return F.cross_entropy(self.head(h).flatten(0, 1), idx.flatten(), label_smoothing=0.1)


def _max_norm_batch(seed, b=3, t=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (b, t), generator=g), torch.randint(0, 10, (2 * b,), generator=g), torch.arange(0, 2 * b, 2)


@pytest.mark.parametrize("policy", ["save_all", policies.budget(0.05)], ids=str)
def test_embedding_max_norm_was_refused(policy):
    batches = [_max_norm_batch(0), _max_norm_batch(1), _max_norm_batch(2, b=2, t=6)]
    _train_against_eager(_MaxNorm, batches, policy)


def test_embedding_max_norm_after_a_read_of_the_weight_is_refused_naming_the_line():
    class ReadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6, max_norm=0.5)

        def forward(self, idx):
            return (self.emb.weight * 2).sum() + self.emb(idx).pow(2).sum()  # a read before the renorm

    with pytest.raises(fxtools.FxtoolsError, match=r"test_heldout_k\.py:\d+: .*self\.emb\(idx\)"):
        fxtools.split(ReadFirst().double(), torch.tensor([1, 2]))


# --- policies.budget on a recurrence with two states (an LSTM's h and c, each read by the next
# step): the solver's "cheapest" refresh forgot values inside the recurrence, and the backward
# order recomputed it exponentially often (10 steps of nn.LSTM: 120 s and 6 GB for one split;
# a 12-step cell: a 95,793-node order for a 475-node graph). Orders are now bounded. ---


def _two_state_cell(x, w, u):
    h = c = torch.zeros(x.shape[1], w.shape[1], dtype=x.dtype)
    for t in range(x.shape[0]):
        g = x[t] @ w + h @ u
        c = torch.sigmoid(g) * c + torch.tanh(g)
        h = torch.tanh(c) * torch.sigmoid(g)
    return (h**2).sum()


def test_budget_refresh_on_a_recurrence_was_exponential():
    from fxtools.training import budget
    from fxtools.training.cuts import backward_nodes

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(10, 3, 4, dtype=D, generator=g), *(torch.randn(4, 4, dtype=D, generator=g) / 2 for _ in range(2)))
    problem = budget.Problem(fxtools.split(_two_state_cell, *args, policy="save_all")._partition)
    least = problem.frontier()[0]
    limit = budget.ORDER_GROWTH * len(problem.part.nodes) + 64
    steps = problem.refresh_steps(least, "cheapest")
    assert steps  # it still recomputes twice where that lowers the peak
    for point, _ in steps:
        assert len(backward_nodes(problem.part, point.saved, point.recomputed, point.forget)) <= limit


@pytest.mark.parametrize("policy", ["recompute_cheap", policies.budget(0.3)], ids=str)
def test_lstm_trains_with_a_budget(policy):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(3, 4, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0].pow(2).mean()

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 4, 3, dtype=D, generator=g),) for _ in range(2)]
    batches.append((torch.randn(4, 2, 3, dtype=D, generator=g).transpose(0, 1),))  # non-contiguous
    _train_against_eager(Net, batches, policy)
