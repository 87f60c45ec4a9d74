"""The small tanh MLP u(x) of the PINN tests (``torch.autograd.grad`` of it inside a loss), in float64."""

from __future__ import annotations

import torch


def mlp_params(seed: int, d: int = 2, w: int = 6) -> dict[str, torch.Tensor]:
    """Seeded float64 weights of u: R^d -> R with one hidden layer of width w."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(d, w, generator=g, dtype=torch.float64) / d**0.5,
        "b1": torch.randn(w, generator=g, dtype=torch.float64),
        "w2": torch.randn(w, generator=g, dtype=torch.float64) / w**0.5,
    }


def u(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The network's value at each row of x."""
    return torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
