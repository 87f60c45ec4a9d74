"""Held-out programs (batch s): MeanFlow-style JVP losses on DiT-like networks, mixed-dtype norms,
and tensor parallel (2 processes).

Each test is a program a demanding user writes; those marked "was" gave a crash, a false refusal
or a silent wrong answer before their fix. The oracle is PyTorch in float64 (torch.func /
torch.autograd; norms written out where ``torch.func.jvp`` of ``nn.LayerNorm`` drops second-order
terms, docs/jvp_losses.md), or an unsharded model trained in eager.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import sys
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxtools

TOL = dict(rtol=1e-9, atol=1e-10)


# --------------------------------------------------------------------------------------------
# a small DiT: adaptive LayerNorm, SDPA attention, GroupNorm, tanh-GELU MLP, dropout (eval)
# --------------------------------------------------------------------------------------------


def _layer_norm(x, eps, written_out):
    if written_out:  # the same function, for torch.func's reference (its LayerNorm JVP drops terms)
        m = x.mean(-1, keepdim=True)
        return (x - m) / torch.sqrt(((x - m) ** 2).mean(-1, keepdim=True) + eps)
    return F.layer_norm(x, x.shape[-1:], eps=eps)


def _group_norm(mod, x, written_out):
    """``mod`` (``nn.GroupNorm`` over the channels ``d``) of tokens ``x`` [b, n, d]."""
    if written_out:
        b, n, d = x.shape
        g = x.transpose(1, 2).reshape(b, mod.num_groups, -1)
        m = g.mean(-1, keepdim=True)
        g = (g - m) / torch.sqrt(((g - m) ** 2).mean(-1, keepdim=True) + mod.eps)
        return (g.reshape(b, d, n) * mod.weight[:, None] + mod.bias[:, None]).transpose(1, 2)
    return mod(x.transpose(1, 2)).transpose(1, 2)


def _time_embedding(s, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=s.dtype) / half)
    a = s[:, None] * freqs[None] * 1000
    return torch.cat([a.sin(), a.cos()], -1)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.gn = nn.GroupNorm(2, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(approximate="tanh"), nn.Dropout(0.1), nn.Linear(2 * d, d))
        self.written_out = False

    def forward(self, x, c):
        b, n, d = x.shape
        s1, sc1, g1, s2, sc2, g2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        h = _layer_norm(x, 1e-6, self.written_out) * (1 + sc1) + s1
        q, k, v = self.qkv(h).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        x = x + g1 * self.proj(a.transpose(1, 2).reshape(b, n, d))
        h = _group_norm(self.gn, x, self.written_out) * (1 + sc2) + s2
        return x + g2 * self.mlp(h)


class DiT(nn.Module):
    def __init__(self, ch=3, d=16, heads=2, depth=2):
        super().__init__()
        self.d = d
        self.inp = nn.Linear(ch, d)
        self.time = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))
        self.out = nn.Linear(d, ch)

    def forward(self, z, r, t):
        c = self.time(torch.cat([_time_embedding(t, self.d), _time_embedding(t - r, self.d)], -1))
        x = self.inp(z)
        for block in self.blocks:
            x = block(x, c)
        return self.out(x)


class MeanFlow(nn.Module):
    """MeanFlow's loss with the tangents ``(dz, dr, dt) = (v, dr, dt)``; the target detached or not."""

    def __init__(self, net, dr, dt, detach):
        super().__init__()
        self.net, self.dr, self.dt, self.detach = net, dr, dt, detach

    def forward(self, z, r, t, v):
        u, dudt = torch.func.jvp(self.net, (z, r, t), (v, torch.full_like(r, self.dr), torch.full_like(t, self.dt)))
        target = v - (t - r)[:, None, None] * dudt
        if self.detach:
            target = target.detach()
        return (u - target).pow(2).mean()


def _data(b, seed, n=5, ch=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    e, x = torch.randn(2, b, n, ch, generator=g, dtype=dtype)
    r, t = torch.rand(2, b, generator=g, dtype=dtype).sort(0).values
    z = (1 - t)[:, None, None] * x + t[:, None, None] * e
    return z, r, t, e - x


def _reference(model, args):
    """Gradients of ``model`` (a copy, norms written out) by torch.func.jvp inside and autograd."""
    ref = copy.deepcopy(model).double()
    for m in ref.modules():
        if isinstance(m, Block):
            m.written_out = True
    with sdpa_kernel(SDPBackend.MATH):
        loss = ref(*[a.double() for a in args])
    return dict(zip([n for n, _ in ref.named_parameters()], torch.autograd.grad(loss, list(ref.parameters()))))


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def _strided(t):
    """``t``'s values in a non-contiguous layout (every other element of a larger tensor)."""
    return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]


@pytest.mark.usefixtures("float64")
def test_meanflow_dit_with_tangents_of_r_and_t_at_other_batches_and_layouts():
    """MeanFlow through a DiT (adaLN, SDPA, GroupNorm, tanh GELU, dropout in eval) with tangents
    of both times (``dr = dt = 1``) and a target that is not detached, then called at another
    batch size with non-contiguous inputs: float64 torch.func."""
    torch.manual_seed(0)
    model = MeanFlow(DiT(d=8, depth=1).eval(), dr=1.0, dt=1.0, detach=False)
    step = fxtools.compile(model)
    for b, seed, layout in ((4, 0, lambda a: a), (7, 1, _strided)):
        args = _data(b, seed)
        model.zero_grad()
        step(*map(layout, args)).backward()
        want = _reference(model, args)
        for name, g in _grads(model).items():
            torch.testing.assert_close(g, want[name], **TOL, msg=lambda m, name=name: f"batch {b}, {name}: {m}")


def test_bf16_autocast_meanflow_step_through_a_bf16_residual_layer_norm():
    """was: a crash in the backward ("expected m1 and m2 to have the same dtype") — under CPU
    autocast the LayerNorm of a bfloat16 residual with float32 weights keeps float32 statistics
    (CPU kernel), which PyTorch's fake kernel gave as bfloat16; the JVP's tangent reads them, so
    the backward's code added a float32 cotangent into the bfloat16 residual's. Now: the step runs
    and its gradients are within bfloat16's error of float64 torch.func (norms written out)."""
    torch.manual_seed(0)
    model = MeanFlow(DiT(d=8, depth=1).eval(), dr=0.0, dt=1.0, detach=False)
    args = [a.float() for a in _data(4, 0)]
    step = fxtools.compile(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = step(*args)
    loss.backward()
    want = _reference(model, args)
    worst = max(((p.grad.double() - want[n]).norm() / want[n].norm()).item() for n, p in model.named_parameters())
    assert worst < 0.1, worst


def test_norms_fake_statistics_and_layouts_are_the_cpu_kernels():
    """The fake kernels fxtools traces with give each norm's outputs the CPU kernel's dtypes and
    strides: float32 statistics for a half-precision input with float32 parameters (PyTorch's fake
    kernels: the input's dtype), and batch norm's output contiguous for a permuted input
    (PyTorch's: permuted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxtools.capture.fake_kernels import tracing_kernels

    aten = torch.ops.aten
    cases = [
        lambda x, w, b, rm, rv: aten.native_layer_norm(x, [8], w[:8].repeat(2)[:8], None, 1e-5),
        lambda x, w, b, rm, rv: aten.native_layer_norm(x, [8], None, None, 1e-5),
        lambda x, w, b, rm, rv: aten.native_group_norm(x.contiguous(), w, b, 4, 6, 8, 2, 1e-5),
        lambda x, w, b, rm, rv: aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5),
        lambda x, w, b, rm, rv: aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5),
        lambda x, w, b, rm, rv: aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5),
    ]
    for dtype, params in ((torch.float64, torch.float64), (torch.bfloat16, torch.float32)):
        x = torch.randn(4, 8, 6, dtype=dtype).transpose(1, 2)  # [4, 6, 8], permuted
        w, b, rm, rv = (
            torch.randn(6, dtype=params),
            torch.randn(6, dtype=params),
            torch.randn(6, dtype=params),
            torch.rand(6, dtype=params),
        )
        for f in cases:
            args = (x, w, b, rm, rv)
            real = f(*args)
            with tracing_kernels(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake = f(*[mode.from_tensor(a) for a in args])
            assert [(o.dtype, o.shape, o.stride()) for o in fake] == [(o.dtype, o.shape, o.stride()) for o in real]


@pytest.mark.usefixtures("float64")
def test_batch_norm_of_a_transposed_input_then_view():
    """was: a false refusal ("the .view ... cannot view its input's layout, as eager PyTorch
    refuses it") — ``BatchNorm1d`` of ``x.transpose(1, 2)`` returns a contiguous tensor on CPU,
    which PyTorch's fake kernel gave the input's permuted strides. Both modes, both paths."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(6)

        def forward(self, x):
            y = self.bn(x.transpose(1, 2))
            return (y.view(4, -1) ** 2 * torch.arange(48.0)).sum()

    x = torch.randn(4, 8, 6)
    for training in (True, False):
        torch.manual_seed(0)
        model = M().train(training)
        eager = copy.deepcopy(model)
        eager(x).backward()
        fxtools.compile(model)(x).backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"training={training}, {name}: {m}")
        torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean, **TOL)
        f = fxtools.functional(model)
        params = {k: v.detach() for k, v in model.named_parameters()}
        got = fxtools.grad(f, params, x)(params, x)
        if not training:  # torch.func refuses the running statistics' update in training
            want = torch.func.grad(f)(params, x)
            for name in want:
                torch.testing.assert_close(got[name], want[name], **TOL)


# --------------------------------------------------------------------------------------------
# tensor parallel: one launch of 2 processes (tests/test_distributed.py's launcher)
# --------------------------------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self, d=5, h=7):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x, y):
        return ((self.down(F.gelu(self.up(x), approximate="tanh")) - y) ** 2).mean()


class _ColwiseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 6)

    def forward(self, z, t):
        return torch.tanh(self.up(z * t[:, None]))


class _JvpLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _ColwiseNet()

    def forward(self, z, t, v):
        u, dudt = torch.func.jvp(self.net, (z, t), (v, torch.ones_like(t)))
        return (dudt**2).sum() + (u**2).sum()


class _JvpBesideTP(nn.Module):
    """A JVP of a time embedding that is not tensor-parallel, feeding a Colwise/Rowwise MLP."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(1, 4)
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 4)

    def forward(self, x, t, y):
        e, de = torch.func.jvp(lambda s: torch.sin(self.emb(s[:, None])), (t,), (torch.ones_like(t),))
        h = self.down(torch.tanh(self.up(x + e + de.detach())))
        return ((h - y) ** 2).mean() + (de**2).mean()


def _tp_worker(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    results: dict = {}

    # an uneven hidden width (7 over 2 ranks), DTensors between the layers, gradient clipping and
    # AdamW with weight decay: parameters after 3 steps equal the unsharded model's in eager
    torch.manual_seed(1)
    x, y = torch.randn(6, 5), torch.randn(6, 5)

    def train(model, params):
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(x, y).backward()
            torch.nn.utils.clip_grad_norm_(params, 0.05)
            opt.step()

    torch.manual_seed(0)
    ref = _MLP()
    train(ref, list(ref.parameters()))
    torch.manual_seed(0)
    sharded = parallelize_module(
        _MLP(), mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel(input_layouts=Shard(-1))}
    )
    train(fxtools.compile(sharded, x, y), list(sharded.parameters()))
    results["uneven MLP"] = {
        n: (p.detach().full_tensor() - q.detach()).abs().max().item()
        for (n, p), q in zip(sharded.named_parameters(), ref.parameters())
    }

    # a JVP inside the loss through a Colwise layer: was a silent wrong answer (the tangent of the
    # replicated input summed over the ranks: twice eager's), now refused naming both lines
    torch.manual_seed(0)
    z, v, t = torch.randn(3, 4), torch.randn(3, 4), torch.rand(3)
    loss = parallelize_module(_JvpLoss(), mesh, {"net.up": ColwiseParallel()})
    try:
        fxtools.compile(loss, z, t, v)(z, t, v).backward()
        results["refused"] = "not refused"
    except fxtools.FxtoolsError as e:
        results["refused"] = str(e)

    # a JVP beside the tensor-parallel layers (not through them) is no DTensor step: exact
    torch.manual_seed(0)
    y = torch.randn(3, 4)
    torch.manual_seed(1)
    ref = _JvpBesideTP()
    ref(z, t, y).backward()
    torch.manual_seed(1)
    beside = parallelize_module(_JvpBesideTP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fxtools.compile(beside, z, t, y)(z, t, y).backward()
    results["JVP beside TP"] = {
        n: ((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) - q.grad).abs().max().item()
        for (n, p), q in zip(beside.named_parameters(), ref.parameters())
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_tensor_parallel_uneven_mlp_with_clipping_and_a_jvp_loss_refused():
    """2 processes: an MLP of uneven hidden width (Colwise with DTensor outputs, Rowwise taking
    them) trained with gradient clipping and AdamW through fxtools.compile equals the unsharded
    model; a MeanFlow-style JVP through a Colwise layer is refused naming the JVP's line and the
    layer's (it was a silent wrong answer)."""
    from test_distributed import launch

    with tempfile.TemporaryDirectory() as out_dir:
        ranks = launch(out_dir, 2, script=__file__)
    for rank, results in enumerate(ranks):
        for case in ("uneven MLP", "JVP beside TP"):
            errors = {n: e for n, e in results[case].items() if not e < 1e-10}
            assert not errors, f"rank {rank}, {case}: {errors}"
        message = results["refused"]
        assert "torch.func.jvp(self.net, (z, t)" in message and "self.up(z * t[:, None])" in message, message
        assert "tensor-parallel" in message, message


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _tp_worker(sys.argv[2])
