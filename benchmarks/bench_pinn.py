"""A PINN training step: the gradient of a loss containing the Laplacian, fxtools against torch.func and folx.

The loss of a physics-informed network for ``Δu = f`` with ``u = 0`` on the boundary, over a batch of
``B`` interior points and ``B`` boundary points: ``mean((Δu(x) - f(x))^2) + mean(u(x_b)^2)``, with
``f(x) = Σ_i sin(x_i)`` and ``u`` an MLP ``D -> W tanh -> ... -> W tanh -> 1`` (``--layers`` hidden
layers). Each variant returns the loss and its gradient with respect to the parameters:

- ``fxtools``: ``fxtools.value_and_grad`` of the loss built on ``fxtools.vmap(fxtools.laplacian(u))``
  (the generated gradient module, made once, not timed);
- ``fxtools + Inductor``: that module compiled by ``torch.compile``;
- ``torch.func``: ``torch.func.grad_and_value`` of the loss with the Laplacian as the trace of
  ``torch.func.hessian`` (``jacfwd(jacrev)``), vmapped over the points;
- ``folx``: ``jax.jit(jax.value_and_grad)`` of the loss with folx's ``forward_laplacian``, when
  ``import jax, folx`` works (run this script with the side environment's python:
  ``bash ../shared/anchors/setup_taylor_anchors.sh DIR``, then ``DIR/jax/bin/python``, with a ``.pth``
  file naming this project's site-packages so that torch imports too).

The ``--variants`` chosen run in one process, alternating call by call, one thread each (XLA's Eigen
pool off), float64, medians of ``--repeat`` calls after warm-up; the process's CPU time
(``time.process_time``, all threads) is reported next to the wall time, since the machine may be
shared. JAX in the same process as torch made folx several times slower here, so compare folx with
``--variants folx`` in its own process, alternating processes. Every gradient is checked against
torch.func's. Run:
``python benchmarks/bench_pinn.py [--configs 32x64x128x2 1024x3x256x4] [--variants fxtools folx] [--repeat 15]``
(a config is ``BxDxWxL``: points, input size, width, hidden layers).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import torch  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/src")  # this checkout's fxtools, when run as a script

from bench import markdown_header  # noqa: E402  benchmarks/bench.py, beside this file

import fxtools  # noqa: E402

try:
    import jax
    import jax.numpy as jnp
    from folx import forward_laplacian

    jax.config.update("jax_enable_x64", True)
except ImportError:
    jax = None


def make_params(d: int, width: int, layers: int) -> dict:
    torch.manual_seed(0)
    sizes = [d] + [width] * layers + [1]
    params = {}
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        params[f"w{i}"] = torch.randn(n_in, n_out, dtype=torch.float64) / n_in**0.5
        params[f"b{i}"] = torch.randn(n_out, dtype=torch.float64) * 0.1
    return params


def network(tanh):
    """The network at one point ``x`` (shape ``(D,)``, a scalar out), for torch's or jax's ``tanh``."""

    def u(params: dict, x):
        n = len(params) // 2
        h = x
        for i in range(n - 1):
            h = tanh(h @ params[f"w{i}"] + params[f"b{i}"])
        return (h @ params[f"w{n - 1}"] + params[f"b{n - 1}"]).sum()

    return u


u = network(torch.tanh)


def source(x):
    return x.sin().sum(-1)


def fxtools_step(params, inside, edge):
    """``fxtools.value_and_grad`` of the loss on fxtools' vmapped Laplacian module."""
    lap = fxtools.vmap(fxtools.laplacian(u, params, inside[0], argnums=1), params, inside, in_dims=(None, 0))
    boundary = fxtools.vmap(u, params, edge, in_dims=(None, 0))

    def loss(params, inside, edge):
        _, delta = lap(params, inside)
        return ((delta - source(inside)) ** 2).mean() + (boundary(params, edge) ** 2).mean()

    return fxtools.value_and_grad(loss, params, inside, edge)


def torch_func_step():
    """torch.func: the trace of ``hessian`` (``jacfwd(jacrev)``) per point, ``grad_and_value`` over the parameters."""

    def laplacian(params, x):
        return torch.func.hessian(u, argnums=1)(params, x).trace()

    def loss(params, inside, edge):
        delta = torch.func.vmap(laplacian, in_dims=(None, 0))(params, inside)
        boundary = torch.func.vmap(u, in_dims=(None, 0))(params, edge)
        return ((delta - source(inside)) ** 2).mean() + (boundary**2).mean()

    step = torch.func.grad_and_value(loss)

    def run(params, inside, edge):
        grads, value = step(params, inside, edge)
        return value, grads

    return run


def folx_step(params, inside, edge):
    """folx's forward Laplacian (``sparsity_threshold=0``: dense, as fxtools) and ``jax.value_and_grad``, jitted."""
    jparams = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    u_jax = network(jnp.tanh)

    def loss(p, inside, edge):
        delta = jax.vmap(lambda x: forward_laplacian(lambda y: u_jax(p, y), sparsity_threshold=0)(x).laplacian)(inside)
        boundary = jax.vmap(lambda x: u_jax(p, x))(edge)
        return jnp.mean((delta - jnp.sin(inside).sum(-1)) ** 2) + jnp.mean(boundary**2)

    step = jax.jit(jax.value_and_grad(loss))
    ji, je = jnp.asarray(inside.numpy()), jnp.asarray(edge.numpy())

    def run(params, inside, edge):
        value, grads = step(jparams, ji, je)
        jax.block_until_ready(grads)
        return value, grads

    return run


def median_times(methods, args, repeat: int) -> dict:
    """Each method's median wall and CPU time, alternating call by call (the machine is shared)."""
    for fn in methods.values():
        fn(*args)
    wall: dict = {name: [] for name in methods}
    cpu: dict = {name: [] for name in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            w, c = time.perf_counter(), time.process_time()
            fn(*args)
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in methods}


def check(methods, args) -> None:
    """Every variant's loss and gradient against torch.func's, in float64."""
    value, grads = methods["torch.func"](*args)
    for name, fn in methods.items():
        got_value, got = fn(*args)
        for k, g in grads.items():
            err = (torch.tensor(got[k].__array__()) - g).abs().max()
            scale = g.abs().max().clamp_min(1e-30)
            assert err / scale < 1e-9, f"{name}'s gradient of {k} differs from torch.func's by {float(err / scale):.3g}"
        assert abs(float(got_value) - float(value)) <= 1e-9 * abs(float(value)), f"{name}'s loss differs"


def run(configs, repeat: int, variants) -> None:
    for config in configs:
        b, d, width, layers = (int(s) for s in config.split("x"))
        params = make_params(d, width, layers)
        inside = torch.rand(b, d, dtype=torch.float64)
        edge = torch.rand(b, d, dtype=torch.float64)
        args = (params, inside, edge)
        methods = {"torch.func": torch_func_step()}
        if {"fxtools", "fxtools + Inductor"} & set(variants):
            step = fxtools_step(*args)
            methods["fxtools"] = step
            if "fxtools + Inductor" in variants:
                methods["fxtools + Inductor"] = torch.compile(step)
        if "folx" in variants and jax is not None:
            methods["folx"] = folx_step(*args)
        check(methods, args)
        methods = {name: fn for name, fn in methods.items() if name in variants}
        times = median_times(methods, args, repeat)
        print(_row(config, times, load=os.getloadavg()[0]), flush=True)


COLUMNS = ["fxtools", "fxtools + Inductor", "folx", "torch.func"]
HEADER = markdown_header(["B x D x W x L", *(f"{c} ms (cpu)" for c in COLUMNS), "fxtools / folx", "+ Inductor / folx", "load"])


def _row(config, t, load) -> str:
    def ms(name):
        return f"{t[name][0] * 1e3:.2f} ({t[name][1] * 1e3:.2f})" if name in t else "-"

    def ratio(a, b):
        return f"{t[a][1] / t[b][1]:.2f}x" if a in t and b in t else "-"

    return (
        f"| {config} | "
        + " | ".join(ms(c) for c in COLUMNS)
        + f" | {ratio('fxtools', 'folx')} | {ratio('fxtools + Inductor', 'folx')} | {load:.1f} |"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["32x64x128x2", "32x256x128x2", "1024x3x256x4", "1024x16x256x4"])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["fxtools", "fxtools + Inductor"],
        help=f"which of {COLUMNS} to time (all are checked against torch.func; separate processes for separate variants avoid one runtime slowing the other)",
    )
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, jax {jax.__version__ if jax else '-'}, one thread, float64, "
        f"median of {opts.repeat}; ratios of CPU times"
    )
    print(HEADER)
    run(opts.configs, opts.repeat, opts.variants)


if __name__ == "__main__":
    main()
