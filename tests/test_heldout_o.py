"""Held-out programs (batch o): JVP losses as trained (time embeddings, stop-gradients, adaptive
weights, dropout, bf16 autocast, other batch sizes and layouts at call time), PINNs on batches, and
NaN tracing in training.

Each test is a program a demanding user writes; those marked "was" gave a silent wrong answer, a
false refusal or a false report before their fix. The oracle is PyTorch itself: torch.func /
torch.autograd in float64, eager autocast for bf16 programs.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtools

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


# --------------------------------------------------------------------------------------------
# JVP losses: a seeded generator of consistency-model / MeanFlow-style losses
# --------------------------------------------------------------------------------------------


def sinusoidal(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=t.dtype, device=t.device) / half)
    a = t[:, None] * freqs[None]
    return torch.cat([torch.sin(a), torch.cos(a)], -1)


class Net(nn.Module):
    """``x`` [b, 4] and a time ``t`` [b] -> a velocity [b, 4]; the time enters through an embedding."""

    def __init__(self, embedding: str, norm: str, act: str, p: float):
        super().__init__()
        self.embedding, self.p = embedding, p
        self.inp = nn.Linear(4, 16)
        self.time = nn.Linear(8 if embedding != "linear" else 1, 16)
        self.fourier = nn.Parameter(torch.randn(4)) if embedding == "fourier" else None
        self.norm = nn.RMSNorm(16) if norm == "rms" else nn.Identity()
        self.act = {"silu": F.silu, "gelu": F.gelu, "tanh": torch.tanh, "softplus": F.softplus}[act]
        self.out = nn.Linear(16, 4)

    def forward(self, x, t):
        if self.embedding == "sinusoidal":
            e = sinusoidal(t, 8)
        elif self.embedding == "fourier":  # learned frequencies: the tangent of t reaches them
            a = 2 * math.pi * t[:, None] * self.fourier[None]
            e = torch.cat([a.sin(), a.cos()], -1)
        else:
            e = t[:, None]
        h = self.act(self.norm(self.inp(x) + self.time(e)))
        h = F.dropout(h, self.p, self.training)
        return self.out(h)


class JvpLoss(nn.Module):
    """``u, du/dt`` by a JVP along ``(v, 1)``; the target stops the gradient (``.detach()``) or not;
    an adaptive weight ``1 / sqrt(loss.detach() + c)`` per sample, or none."""

    def __init__(self, net, spelling: str, detach: bool, adaptive: bool):
        super().__init__()
        self.net, self.spelling, self.detach, self.adaptive = net, spelling, detach, adaptive

    def forward(self, x, t, v):
        if self.spelling == "torch.func.jvp":
            u, du = torch.func.jvp(self.net, (x, t), (v, torch.ones_like(t)))
        else:
            import torch.autograd.forward_ad as fwAD

            with fwAD.dual_level():
                u, du = fwAD.unpack_dual(self.net(fwAD.make_dual(x, v), fwAD.make_dual(t, torch.ones_like(t))))
        target = v - t[:, None] * du
        if self.detach:
            target = target.detach()
        per_sample = (u - target).pow(2).mean(-1)
        if self.adaptive:
            per_sample = per_sample / (per_sample.detach() + 1e-3).sqrt()
        return per_sample.mean()


def random_jvp_loss(seed):
    rnd = random.Random(seed)
    config = dict(
        embedding=rnd.choice(["sinusoidal", "fourier", "linear"]),
        norm=rnd.choice(["rms", "none"]),
        act=rnd.choice(["silu", "gelu", "tanh", "softplus"]),
        p=rnd.choice([0.0, 0.2]),
    )
    loss = dict(spelling=rnd.choice(["torch.func.jvp", "forward_ad"]), detach=rnd.random() < 0.5, adaptive=rnd.random() < 0.5)
    torch.manual_seed(seed)
    return JvpLoss(Net(**config), **loss).double(), (config, loss)


def jvp_batch(g, b, layout):
    """``x, t, v`` of batch size ``b``; ``layout="strided"``: x and v non-contiguous (a transpose, a step)."""
    if layout == "strided":
        x = torch.randn(4, b, generator=g, dtype=D).T
        v = torch.randn(b, 8, generator=g, dtype=D)[:, ::2]
    else:
        x, v = torch.randn(b, 4, generator=g, dtype=D), torch.randn(b, 4, generator=g, dtype=D)
    return x, torch.rand(b, generator=g, dtype=D), v


@pytest.mark.parametrize("seed", range(2))
def test_random_jvp_losses_train_as_eager_at_several_batch_sizes_and_layouts(seed):
    """fxtools.compile of a random JVP loss: AdamW steps at batch sizes and layouts other than the
    first call's give eager's losses and parameters (float64, dropout drawn under the same seed)."""
    eager, _ = random_jvp_loss(seed)
    compiled = copy.deepcopy(eager)
    step = fxtools.compile(compiled)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    g = torch.Generator().manual_seed(100 + seed)
    for i, (b, layout) in enumerate([(5, "contiguous"), (3, "strided"), (5, "strided")]):
        args = jvp_batch(g, b, layout)
        values = []
        for model, run, opt in zip((eager, compiled), (eager, step), opts):
            opt.zero_grad()
            torch.manual_seed(1000 * seed + i)
            value = run(*args)
            value.backward()
            opt.step()
            values.append(value.detach())
        torch.testing.assert_close(values[1], values[0], **TOL)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_random_jvp_loss_gradients_equal_torch_func():
    """fxtools.grad of random JVP losses (dropout off) equals torch.func.grad of the same loss."""
    for seed in range(10, 14):
        module, _ = random_jvp_loss(seed)
        module.eval()
        loss = fxtools.functional(module)
        params = {k: p.detach() for k, p in module.named_parameters()}
        args = jvp_batch(torch.Generator().manual_seed(seed), 4, "contiguous")
        got = fxtools.grad(loss, params, *args)(params, *args)
        want = torch.func.grad(loss)(params, *args)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m, k=k, seed=seed: f"seed {seed}, {k}: {m}")


# --------------------------------------------------------------------------------------------
# Autocast: programs traced below autograd
# --------------------------------------------------------------------------------------------


class NoGradScale(nn.Module):
    """A scale computed under ``torch.no_grad()`` (a constant of the gradient), in or out of an
    autocast region of its own."""

    def __init__(self, inner_region: bool):
        super().__init__()
        self.fc, self.inner_region = nn.Linear(4, 4), inner_region

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.inner_region):
            h = self.fc(x)
        with torch.no_grad():
            scale = h.float().pow(2).mean().sqrt()
        return (h.float() / scale).pow(2).sum()


@pytest.mark.parametrize("inner_region", [False, True])
def test_no_grad_block_in_a_program_traced_below_autograd_is_a_constant(inner_region):
    """Was: a program under (or holding) an autocast region is traced below autograd, where no
    grad-mode switch was recorded: the ``no_grad`` block was differentiated, gradients off by 70%."""
    torch.manual_seed(0)
    eager = NoGradScale(inner_region)
    compiled = copy.deepcopy(eager)
    step = fxtools.compile(compiled)
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = eager(x), step(x)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6)
    if inner_region:  # fxtools.grad (no outer region) of the same module
        loss = fxtools.functional(eager)
        params = {k: p.detach() for k, p in eager.named_parameters()}
        got_grads = fxtools.grad(loss, params, x)(params, x)
        want_grads = torch.func.grad(loss)(params, x)
        for k in want_grads:
            torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-6, atol=1e-6)


def test_jvp_loss_under_bf16_autocast_trains():
    """Was refused (the JVP's functorch level entered in a trace below autograd): a JVP loss made
    and called under ``torch.autocast(bfloat16)``. Now fxtools' own forward mode computes it on the
    region's casts; equal to eager autocast within bfloat16's precision, at two batch sizes."""
    torch.manual_seed(0)
    eager = JvpLoss(Net("sinusoidal", "rms", "silu", 0.0), "torch.func.jvp", detach=True, adaptive=True)
    compiled = copy.deepcopy(eager)
    step = fxtools.compile(compiled)
    g = torch.Generator().manual_seed(1)
    for b in (6, 3):
        x, t, v = (a.float() for a in jvp_batch(g, b, "contiguous"))
        for m in (eager, compiled):
            m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = eager(x, t, v), step(x, t, v)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            scale = p.grad.abs().max().item() + 1e-3
            assert (q.grad - p.grad).abs().max().item() <= 3e-2 * scale, name


# --------------------------------------------------------------------------------------------
# PINNs on batches
# --------------------------------------------------------------------------------------------

ACTIVATIONS = {
    "tanh": torch.tanh,
    "sin": torch.sin,
    "softplus": F.softplus,
    "softplus_beta": lambda x: F.softplus(x, beta=2.0, threshold=5.0),
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "mish": F.mish,
}


def random_pinn(seed):
    """A seeded MLP u: R^d -> R (residual or not, with or without a boundary factor) and a field R^d -> R^d."""
    rnd = random.Random(seed)
    d, width, depth = rnd.choice([2, 3]), rnd.choice([4, 8]), rnd.choice([1, 2])
    acts = [ACTIVATIONS[rnd.choice(sorted(ACTIVATIONS))] for _ in range(depth)]
    g = torch.Generator().manual_seed(seed)
    dims = [d] + [width] * depth
    layers = [
        (torch.randn(dims[i], dims[i + 1], generator=g, dtype=D) / dims[i] ** 0.5, torch.randn(dims[i + 1], generator=g, dtype=D))
        for i in range(depth)
    ]
    w_out = torch.randn(width, d, generator=g, dtype=D)
    residual, boundary = rnd.random() < 0.5, rnd.random() < 0.5

    def hidden(x):
        h = x
        for (w, b), act in zip(layers, acts):
            z = act(h @ w + b)
            h = h + z if residual and z.shape == h.shape else z
        return h

    def u(x):
        out = (hidden(x) @ w_out).sum(-1)
        return out * (1 - (x * x).sum(-1)) if boundary else out

    def field(x):
        return hidden(x) @ w_out

    return d, u, field


@pytest.mark.parametrize("seed", range(2))
def test_random_pinn_operators_on_batches_equal_torch_func(seed):
    """Laplacian, divergence, bi-Laplacian and a third-order jet of random MLPs, batched by
    fxtools.vmap over points in a strided layout, against torch.func in float64."""
    d, u, field = random_pinn(seed)
    g = torch.Generator().manual_seed(100 + seed)
    xs = torch.randn(d, 5, generator=g, dtype=D).T  # points as the columns' transpose: not contiguous
    _, lap = fxtools.vmap(fxtools.laplacian(u, xs[0]), xs)(xs)
    torch.testing.assert_close(lap, torch.func.vmap(lambda x: torch.func.hessian(u)(x).trace())(xs), **TOL)
    _, div = fxtools.vmap(fxtools.divergence(field, xs[0]), xs)(xs)
    torch.testing.assert_close(div, torch.func.vmap(lambda x: torch.func.jacfwd(field)(x).trace())(xs), **TOL)
    _, bilap = fxtools.vmap(fxtools.bilaplacian(u, xs[0]), xs)(xs)
    want = torch.func.vmap(lambda x: torch.einsum("iijj->", torch.func.hessian(torch.func.hessian(u))(x)))(xs)
    torch.testing.assert_close(bilap, want, rtol=1e-8, atol=1e-8)
    v, zero = torch.randn(d, generator=g, dtype=D), torch.zeros(d, dtype=D)
    _, (_, _, d3) = fxtools.jet(u, xs[0], order=3)(xs[0], (v, zero, zero))

    def along(f):
        return lambda x: torch.func.jvp(f, (x,), (v,))[1]

    torch.testing.assert_close(d3, along(along(along(u)))(xs[0]), **TOL)


class Pinn(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.l1, self.l2, self.act = nn.Linear(3, 8), nn.Linear(8, 1), act

    def u(self, x):
        return self.l2(self.act(self.l1(x))).squeeze(-1)


@pytest.mark.parametrize("act, compile_too", [(torch.sin, True), (F.softplus, False)])
def test_vmap_of_hessian_of_a_closed_over_network_in_a_loss(act, compile_too):
    """Was refused (an AssertionError inside vmap): ``vmap(hessian(net.u))`` in a loss that closes
    over the network, whose parameters require grad, for every activation but tanh (PyTorch's C++
    autograd viewed a batched gradient below the fake mode). Through fxtools.grad and
    fxtools.compile (the parameters' .grad, another batch size), against torch.func / eager."""
    torch.manual_seed(0)
    net = Pinn(act).double()
    twin = copy.deepcopy(net)

    def residual(model, xs, f):
        lap = torch.func.vmap(lambda x: torch.func.hessian(model.u)(x).trace())(xs)
        return ((lap + f) ** 2).mean()

    g = torch.Generator().manual_seed(1)
    xs, f = torch.randn(5, 3, generator=g, dtype=D), torch.randn(5, generator=g, dtype=D)
    got = fxtools.grad(lambda xs, f: residual(net, xs, f), xs, f)(xs, f)
    want = torch.func.grad(lambda xs, f: residual(net, xs, f))(xs, f)
    torch.testing.assert_close(got, want, **TOL)
    if not compile_too:
        return
    step = fxtools.compile(lambda xs, f: residual(twin, xs, f))
    for n in (3,):
        xs, f = torch.randn(n, 3, generator=g, dtype=D), torch.randn(n, generator=g, dtype=D)
        for m in (net, twin):
            m.zero_grad()
        residual(net, xs, f).backward()
        step(xs, f).backward()
        for (name, p), q in zip(net.named_parameters(), twin.parameters()):
            if p.grad is None:  # the Laplacian does not depend on the last bias
                assert q.grad is None, name
                continue
            torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


# --------------------------------------------------------------------------------------------
# Where a NaN came from
# --------------------------------------------------------------------------------------------


@pytest.fixture
def nan_filled_empty_tensors():
    """PyTorch's deterministic mode fills ``torch.empty`` with NaN: uninitialized memory that holds
    NaN bit patterns, every time."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_uninitialized_memory_is_no_origin(nan_filled_empty_tensors):
    """Was: dropout's mask is ``empty_like`` then drawn; the rerun read the empty tensor before its
    draw and reported its bits (NaN) as the first non-finite value of a clean program."""

    def f(x, w):
        h = F.dropout(x @ w, 0.5, True)
        out = torch.empty_like(h)
        out.copy_(h * 2)
        return out.pow(2).sum()

    assert fxtools.find_nonfinite(f, torch.randn(4, 3), torch.randn(3, 5)) is None


class Huge(nn.Module):
    """Returns finite values whose sum overflows float32, beside a finite loss, with dropout."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 64)

    def forward(self, x):
        h = F.dropout(self.fc(x).abs() + 1, 0.5, self.training) * 1e37
        return h, (h * 1e-37).pow(2).mean()


def test_check_finite_does_not_fail_a_finite_step(nan_filled_empty_tensors):
    """Was: the cheap check of the forward fails (the sum overflows), its rerun then reported the
    dropout mask's uninitialized memory, or, running the backward with cotangents of ones (the step
    gets zeros for ``h``), an overflow the step never computes: a NonFiniteError on a finite step.
    Now the step runs on, bit for bit the unchecked one (dropout's draws too)."""
    torch.manual_seed(0)
    checked_model = Huge()
    plain_model = copy.deepcopy(checked_model)
    checked, plain = fxtools.compile(checked_model, check_finite=True), fxtools.compile(plain_model)
    x = torch.randn(4, 3)
    for step in range(2):
        outs = []
        for run in (checked, plain):
            torch.manual_seed(step)
            h, value = run(x)
            value.backward()
            outs.append((h, value, torch.rand(2)))  # the generators after the step, too
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    for p, q in zip(checked_model.parameters(), plain_model.parameters()):
        assert torch.equal(p.grad, q.grad)


class BufferNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(3, 3), nn.BatchNorm1d(3)

    def forward(self, x):
        h = self.bn(self.fc(x))
        return h.pow(2).mean()


def test_a_buffer_holding_a_nan_is_an_input_of_the_step():
    """Was: reported as a forward value made by the line that reads it (``h = self.bn(...)``)."""
    model = BufferNet().eval()
    with torch.no_grad():
        model.bn.running_var[1] = float("nan")
    report = fxtools.find_nonfinite(model, torch.randn(4, 3))
    assert report.phase == "input" and report.line is None and "running_var" in report.name
    assert "already held a NaN" in str(report)
    compiled = fxtools.compile(model, check_finite=True)
    with pytest.raises(fxtools.NonFiniteError) as info:
        compiled(torch.randn(4, 3))
    assert info.value.report.phase == "input" and "running_var" in info.value.report.name
