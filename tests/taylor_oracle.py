"""The oracle of the Taylor-mode tests: torch.func in float64."""

from __future__ import annotations

import torch

F64 = torch.float64


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def trace_of_hessian(f, x):
    """The Laplacian of every output element, from torch.func's Hessian."""
    out = f(x)
    H = torch.func.hessian(f)(x).reshape(*out.shape, x.numel(), x.numel())
    return H.diagonal(0, -2, -1).sum(-1)


def rademacher(shape):
    """Entries +-1, drawn as the generated code draws them (so a seeded estimate can be replayed)."""
    return (2 * torch.randint(0, 2, shape) - 1).to(F64)
