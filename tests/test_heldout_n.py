"""Held-out models (batch n): training paths on models written from scratch.

Each test is a model that gave a wrong answer or a crash before its fix: a submodule reachable
under two names (``self.shared`` also an entry of ``self.blocks``), whose parameters
``fxtools.functional`` (so ``fxtools.compile``, ``fxtools.split``, ``fxtools.grad`` of a
functional model) left as the FakeTensors it traced with, and a mixture-of-experts layer whose
top-k routing gives data-dependent sizes (``nonzero``), on which ``fxtools.policies.budget``
crashed counting FLOPs. The oracle is eager autograd in float64: losses, gradients, parameters
and buffers after SGD steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtools

D = torch.float64


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def _train_like_eager(make, batches, policy, steps=2):
    """``fxtools.compile(model, policy=policy)`` trains as the eager model does: same losses,
    gradients, parameters and buffers after each SGD step, on every batch."""
    torch.manual_seed(0)
    eager = make().to(D)
    model = copy.deepcopy(eager)
    compiled = fxtools.compile(model, *batches[0], policy=policy)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        for args in batches:
            want, got = eager(*args), compiled(*args)
            assert type(got) is torch.Tensor
            _close(got, want)
            opt_e.zero_grad()
            opt_c.zero_grad()
            want.backward()
            got.backward()
            for (name, p), q in zip(eager.named_parameters(), model.parameters()):
                assert type(q) is nn.Parameter, name
                _close(q.grad, p.grad)
            opt_e.step()
            opt_c.step()
            for b, c in zip(eager.buffers(), model.buffers()):
                _close(c, b)


class _Shared(nn.Module):
    """A block used twice through a ModuleList that also holds it under its own name, and an
    output layer tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.shared = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.blocks = nn.ModuleList([self.shared, nn.Tanh(), self.shared, self.bn])
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, y):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h), y)


def test_submodule_under_two_names_keeps_its_parameters():
    torch.manual_seed(0)
    model = _Shared().to(D)
    idx, y = torch.randint(0, 10, (6,)), torch.randint(0, 10, (6,))
    own = dict(model.named_parameters())
    params = dict(own)
    fxtools.split(model, idx, y)
    fxtools.grad(fxtools.functional(model), params, idx, y)
    for name, p in model.named_parameters():
        assert p is own[name], name  # was a FakeTensor left by the trace
    assert model.blocks[0].weight is model.shared.weight
    batches = [(idx, y), (torch.randint(0, 10, (9,)), torch.randint(0, 10, (9,)))]
    for policy in ("recompute_cheap", fxtools.policies.budget(0.6)):
        _train_like_eager(_Shared, batches, policy, steps=1)


class _MoE(nn.Module):
    """Top-2 routing over 4 experts: each expert runs on the rows routed to it (``nonzero``,
    data-dependent sizes), its outputs added back with ``index_add``."""

    def __init__(self, d=8, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, 16) * 0.3)
        self.w2 = nn.Parameter(torch.randn(experts, 16, d) * 0.3)

    def forward(self, x):
        xf = x.reshape(-1, x.shape[-1])
        top_p, top_i = self.gate(xf).softmax(-1).topk(2, -1)
        out = torch.zeros_like(xf)
        for e in range(self.w1.shape[0]):
            mask = top_i == e
            rows = mask.any(-1).nonzero().squeeze(-1)
            w = (top_p * mask).sum(-1)[rows]
            h = F.gelu(xf[rows] @ self.w1[e]) @ self.w2[e]
            out = out.index_add(0, rows, h * w[:, None])
        return (out**2).mean()


def test_moe_routing_under_a_memory_budget():
    torch.manual_seed(3)
    batches = [(torch.randn(2, 5, 8, dtype=D),) for _ in range(3)]  # a new routing each batch
    _train_like_eager(_MoE, batches, fxtools.policies.budget(0.3), steps=1)


class _Amp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.ln = nn.LayerNorm(8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        return self.b(self.ln(self.bn(F.gelu(self.a(x))))).float().pow(2).mean()


def test_called_inside_autocast():
    """A compiled model called inside ``torch.autocast`` (a training loop's, with a GradScaler)
    trains as the eager model does there: its graphs were made without autocast (the backward
    crashed on bfloat16 @ float32) or, built at the first call inside the region, refused."""
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    eager = _Amp()
    models = [copy.deepcopy(eager), copy.deepcopy(eager)]
    built_before, built_inside = fxtools.compile(models[0], x), fxtools.compile(models[1])
    results = []
    for call, model in ((eager, eager), (built_before, models[0]), (built_inside, models[1])):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        losses = []
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = call(x)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach())
        results.append((losses, [t.detach().clone() for t in (*model.parameters(), *model.buffers())]))
        assert type(call(x)) is torch.Tensor and call(x).dtype == torch.float32  # outside: graphs of their own
    for losses, tensors in results[1:]:
        torch.testing.assert_close(losses, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(tensors, results[0][1], rtol=1e-6, atol=1e-7)


def test_split_built_inside_autocast_holds_its_casts():
    """``fxtools.split`` built inside ``torch.autocast``: its graphs hold the region's casts (they
    were traced at float32 and computed float32 wherever they ran). Oracle: eager autograd in the
    region."""
    torch.manual_seed(0)
    w, x = torch.randn(4, 3, requires_grad=True), torch.randn(6, 4)

    def f(w, x):
        return torch.tanh(x @ w).float().pow(2).sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        sp = fxtools.split(f, w, x)
        want = f(w, x)
    (want_grad,) = torch.autograd.grad(want, w)
    got, saved = sp.forward(w, x)
    grads = sp.backward(*saved, torch.ones(()))
    assert "bfloat16" in sp.forward.code
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grads[0], want_grad, rtol=1e-2, atol=1e-2)


def _interpolations(x, w):
    h = x * w
    a = F.interpolate(h, scale_factor=1.5, mode="bilinear", align_corners=False)
    b = F.interpolate(h, size=(x.shape[-2] + 3, x.shape[-1]), mode="bilinear", align_corners=True)
    return a.pow(2).mean() + b.sin().sum()


def test_linear_interpolation_at_symbolic_sizes():
    """``dynamic=True`` on a decoder that interpolates (bilinear; by scale and
    by size; align_corners both ways): PyTorch's upsample backward kernels fail at symbolic sizes
    (an internal assert, no meta function); the rule computes the gradient with ``index_add``."""
    torch.manual_seed(0)
    w = torch.randn(3, 1, 1, dtype=D, requires_grad=True)
    compiled = fxtools.compile(_interpolations, torch.randn(2, 3, 4, 6, dtype=D, requires_grad=True), w, dynamic=True)
    for shape in ((3, 3, 5, 7), (2, 3, 9, 4)):
        x = torch.randn(shape, dtype=D, requires_grad=True)
        got = torch.autograd.grad(compiled(x, w), (x, w))
        want = torch.autograd.grad(_interpolations(x, w), (x, w))
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert len(compiled._runners) == 1  # one pair of graphs served every size


def test_bicubic_at_symbolic_sizes_names_the_line():
    """Bicubic's backward kernel fails inside PyTorch at symbolic sizes: refused, naming the line."""
    bicubic = fxtools.compile(lambda x: F.interpolate(x, scale_factor=2, mode="bicubic").sum(), dynamic=True)
    with pytest.raises(fxtools.FxtoolsError, match=r"bicubic2d at symbolic sizes.*test_heldout_n.py:\d+"):
        bicubic(torch.randn(2, 3, 4, 6, dtype=D, requires_grad=True))


def test_autocast_state_of_a_generated_module_is_guarded():
    """A module made outside ``torch.autocast`` and called inside one would run its uncast code
    under autocast (bfloat16 gradients where eager's are float32): refused. Made inside a region,
    it runs its casts with autocast off there and outside any region (a split's backward runs after
    the region), and refuses another region. Oracle: eager autograd in the region (bfloat16
    rounding: the rules' formulas round differently from autograd's kernels)."""
    torch.manual_seed(0)
    f = lambda x, w: torch.log_softmax(torch.tanh(x @ w), -1).sum()  # noqa: E731
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    outside = fxtools.grad(f, x, w, argnums=(0, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(fxtools.InputMismatch, match="made with torch.autocast off"):
            outside(x, w)
        inside = fxtools.grad(f, x, w, argnums=(0, 1))
        got = inside(x, w)
        want = torch.autograd.grad(f(x.requires_grad_(), w.requires_grad_()), (x, w))
    x.requires_grad_(False), w.requires_grad_(False)
    assert [g.dtype for g in got] == [g.dtype for g in want] == [torch.float32] * 2
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.02)
    torch.testing.assert_close(inside(x, w), got, rtol=0, atol=0)  # the same code, outside the region
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(fxtools.InputMismatch, match="bfloat16"):
        inside(x, w)
