"""MeanFlow training with fxtools: the network's JVP inside the loss, compiled.

MeanFlow (Geng et al., 2025) trains a network ``u(z, r, t)`` for the average velocity between times
``r`` and ``t``; its target needs ``du/dt`` along the flow, a forward-mode JVP of the network taken
inside the loss. ``fxtools.compile`` traces that ``torch.func.jvp`` into fxtools' own forward mode
(attention included, which has no forward-mode kernel on CPU), shares the network's forward
between ``u`` and ``dudt``, and trains with one forward and one backward graph.

Run ``python examples/meanflow.py`` (``--inductor`` to compile the graphs with Inductor,
``--steps N``). It checks the first step's gradients against eager PyTorch (MATH attention).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxtools


class Block(nn.Module):
    """A DiT block: adaptive LayerNorm (shift, scale, gate from the time embedding), attention, GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.modulation = nn.Linear(d, 6 * d)

    def forward(self, x, c):
        b, n, d = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(c))[:, None].chunk(6, dim=-1)
        h = self.norm(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + gate1 * self.proj(a)
        h = self.norm(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class DiT(nn.Module):
    """Tokens ``z`` [b, n, channels] and times ``r``, ``t`` [b] -> the average velocity ``u`` [b, n, channels]."""

    def __init__(self, channels=4, d=64, heads=4, depth=2, tokens=16):
        super().__init__()
        self.inp = nn.Linear(channels, d)
        self.pos = nn.Parameter(torch.randn(tokens, d) * 0.02)
        self.freqs = nn.Buffer(torch.exp(-torch.arange(d // 4) * (4.0 / d)))
        self.time = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))
        self.out = nn.Linear(d, channels)

    def embed(self, s):
        angles = s[:, None] * 1000 * self.freqs
        return torch.cat([angles.sin(), angles.cos()], -1)

    def forward(self, z, r, t):
        c = self.time(torch.cat([self.embed(t), self.embed(t - r)], -1))
        x = self.inp(z) + self.pos
        for block in self.blocks:
            x = block(x, c)
        return self.out(x)


class MeanFlowLoss(nn.Module):
    """MeanFlow's loss: ``u`` and its derivative along the flow from one ``torch.func.jvp``."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, z, r, t, v):
        u, dudt = torch.func.jvp(self.net, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
        target = (v - (t - r)[:, None, None] * dudt).detach()
        return (u - target).pow(2).mean()


def batch(b=8, n=16, channels=4, generator=None):
    """Noise ``e``, data ``x``, times ``r <= t``: the point ``z`` on the flow and its velocity ``v``."""
    e, x = torch.randn(2, b, n, channels, generator=generator)
    r, t = torch.rand(2, b, generator=generator).sort(0).values
    z = (1 - t)[:, None, None] * x + t[:, None, None] * e
    return z, r, t, e - x


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inductor", action="store_true", help="compile fxtools' graphs with Inductor")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    loss = MeanFlowLoss(DiT())
    eager = copy.deepcopy(loss)
    step = fxtools.compile(loss, compiler="inductor" if args.inductor else None)
    opt = torch.optim.AdamW(loss.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(0)
    for i in range(args.steps):
        data = batch(generator=g)
        opt.zero_grad()
        value = step(*data)
        value.backward()
        if i == 0:  # the same gradients as eager PyTorch (whose jvp of attention needs the MATH kernel)
            with sdpa_kernel(SDPBackend.MATH):
                eager(*data).backward()
            for (name, p), q in zip(loss.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
            print("first step: gradients equal eager PyTorch's")
        opt.step()
        if i % 5 == 0 or i == args.steps - 1:
            print(f"step {i}: loss {value.item():.4f}")


if __name__ == "__main__":
    main()
