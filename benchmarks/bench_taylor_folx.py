"""folx's forward Laplacian (JAX, jitted) on the MLP of ``bench_taylor.py``, for a same-core comparison.

The side environment: ``bash ../shared/anchors/setup_taylor_anchors.sh DIR``, then
``taskset -c 1 DIR/jax/bin/python benchmarks/bench_taylor_folx.py --dims 64 256`` and, on the same
core, ``taskset -c 1 python benchmarks/bench_taylor.py --inductor --dims 64 256 --dtypes float64``.
One thread (XLA's Eigen pool off), float64, batch 32 (``--batch``), width 128, median of ``--repeat`` calls after
the jit's warm-up (wall and the process's CPU time); the result is checked against ``jax.hessian``'s trace.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from folx import forward_laplacian  # noqa: E402

jax.config.update("jax_enable_x64", True)
WIDTH, BATCH = 128, 32


def run(d: int, repeat: int, batch: int = BATCH) -> tuple[float, float]:
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    w0 = jax.random.normal(keys[0], (d, WIDTH)) / d**0.5
    b0 = jax.random.normal(keys[1], (WIDTH,)) * 0.1
    w1 = jax.random.normal(keys[2], (WIDTH, WIDTH)) / WIDTH**0.5
    b1 = jax.random.normal(keys[3], (WIDTH,)) * 0.1
    w2 = jax.random.normal(keys[4], (WIDTH,)) / WIDTH**0.5

    def f(x):
        h = jnp.tanh(x @ w0 + b0)
        h = jnp.tanh(h @ w1 + b1)
        return h @ w2

    lap = jax.jit(jax.vmap(lambda x: forward_laplacian(f, sparsity_threshold=0)(x).laplacian))
    xs = jax.random.normal(keys[5], (batch, d))
    ref = jax.vmap(lambda x: jnp.trace(jax.hessian(f)(x)))(xs)
    got = lap(xs).block_until_ready()
    assert float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))) < 1e-10
    times, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        lap(xs).block_until_ready()
        cpu.append(time.process_time() - c)
        times.append(time.perf_counter() - t)
    return statistics.median(times), statistics.median(cpu)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--batch", type=int, default=BATCH)
    opts = parser.parse_args()
    for d in opts.dims:
        wall, cpu = run(d, opts.repeat, opts.batch)
        print(
            f"| folx forward_laplacian, jit | B={opts.batch} D={d} | {wall * 1e3:.2f} ms | CPU {cpu * 1e3:.2f} ms |", flush=True
        )


if __name__ == "__main__":
    main()
