"""A physics-informed network for a Poisson problem in 5 dimensions, trained with fxtools.laplacian.

The problem: ``-Δu = f`` on the cube ``[0, 1]^5`` with ``u = g`` on its boundary, where
``f(x) = π² Σ_i sin(π x_i)`` and ``g(x) = Σ_i sin(π x_i)`` (so ``u(x) = Σ_i sin(π x_i)`` solves it).
The network ``u_θ`` is an MLP; the loss is the mean squared residual ``Δu_θ + f`` at random interior
points plus the mean squared boundary error.

fxtools makes three modules once: the Laplacian of ``u_θ`` at one point (collapsed Taylor mode: one
forward pass carrying the value, the 5 first-order directions and the summed second-order term),
that module batched over the points (``fxtools.vmap``), and the gradient of the loss with respect to
``θ`` (``fxtools.grad``, which traces through the generated Laplacian code). Each step of Adam then
runs the generated gradient code.

Run: ``python examples/pinn_poisson.py`` (prints the Laplacian's code and the loss as it trains).
"""

from __future__ import annotations

import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/src")  # this checkout's fxtools, when run as a script

import fxtools  # noqa: E402

DIM = 5


def init_params(width: int, generator: torch.Generator) -> dict:
    def layer(n_in, n_out):
        return torch.randn(n_in, n_out, generator=generator) / math.sqrt(n_in), torch.zeros(n_out)

    (w0, b0), (w1, b1), (w2, b2) = layer(DIM, width), layer(width, width), layer(width, 1)
    return {"w0": w0, "b0": b0, "w1": w1, "b1": b1, "w2": w2, "b2": b2}


def u(params: dict, x: torch.Tensor) -> torch.Tensor:
    """The network at one point ``x`` of shape (5,): a scalar."""
    h = torch.tanh(x @ params["w0"] + params["b0"])
    h = torch.tanh(h @ params["w1"] + params["b1"])
    return (h @ params["w2"] + params["b2"]).squeeze(-1)


def source(x):
    return math.pi**2 * torch.sin(math.pi * x).sum(-1)


def boundary_value(x):
    return torch.sin(math.pi * x).sum(-1)


def sample(batch: int, generator: torch.Generator):
    """Interior points, and boundary points (one coordinate set to 0 or 1)."""
    inside = torch.rand(batch, DIM, generator=generator)
    edge = torch.rand(batch, DIM, generator=generator)
    face = torch.randint(0, DIM, (batch,), generator=generator)
    edge[torch.arange(batch), face] = torch.randint(0, 2, (batch,), generator=generator).to(edge.dtype)
    return inside, edge


def make_loss_grad(params, inside, edge):
    """The generated modules: the Laplacian at a point, batched, and the loss's gradient."""
    laplacian = fxtools.laplacian(u, params, inside[0], argnums=1)
    batched = fxtools.vmap(laplacian, params, inside, in_dims=(None, 0))
    boundary = fxtools.vmap(u, params, edge, in_dims=(None, 0))

    def loss(params, inside, edge):
        _, lap = batched(params, inside)
        residual = lap + source(inside)
        return (residual**2).mean() + ((boundary(params, edge) - boundary_value(edge)) ** 2).mean()

    return laplacian, fxtools.value_and_grad(loss, params, inside, edge)


def train(steps=500, batch=64, width=32, lr=3e-3, seed=0, verbose=False):
    """Train with Adam; returns (first loss, last loss)."""
    generator = torch.Generator().manual_seed(seed)
    params = init_params(width, generator)
    laplacian, value_and_grad = make_loss_grad(params, *sample(batch, generator))
    if verbose:
        print(laplacian.code)
    state = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in params.items()}
    losses = []
    for step in range(1, steps + 1):
        value, grads = value_and_grad(params, *sample(batch, generator))
        losses.append(value.item())
        for k, g in grads.items():  # Adam
            m, v = state[k]
            m.mul_(0.9).add_(g, alpha=0.1)
            v.mul_(0.999).addcmul_(g, g, value=0.001)
            params[k] = params[k] - lr * (m / (1 - 0.9**step)) / ((v / (1 - 0.999**step)).sqrt() + 1e-8)
        if verbose and step % 100 == 0:
            print(f"step {step}: loss {value.item():.4f}")
    return losses[0], sum(losses[-10:]) / len(losses[-10:])


if __name__ == "__main__":
    first, last = train(verbose=True)
    print(f"loss: {first:.3f} -> {last:.3f}")
