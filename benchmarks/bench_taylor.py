"""The Laplacian of an MLP: fxtools' collapsed Taylor mode against torch.func.

For an MLP ``D -> 128 -> 128 -> 1`` with two tanh layers and a batch of 32 inputs, the Laplacian of
the output with respect to each input (``D`` = 16, 64, 256, 1024), in float64 and float32:

- ``fxtools``: ``fxtools.vmap(fxtools.laplacian(f, x))`` over the batch (one generated module,
  made once, not timed);
- ``trace of hessian``: ``torch.func.vmap`` over the batch of ``torch.func.hessian(f)(x).trace()``;
- ``vmap of hvp``: ``torch.func.vmap`` over the batch of the sum over the basis vectors ``e_i`` of
  ``e_i . H e_i``, with ``H e_i`` by ``jvp`` of ``grad`` batched over the basis (``torch.func.vmap``);
- ``batched u(X)``: ``fxtools.laplacian`` of the network written on the batch, without vmap (its
  rows are independent, so the directions are those of one point, pushed through all rows);
- ``jet-for-pytorch``: the collapsed Laplacian of "Collapsing Taylor Mode AD" (``jet.laplacian``,
  vmapped over the batch), when ``import jet`` works: run this script with the side environment's
  python (``bash ../shared/anchors/setup_taylor_anchors.sh DIR``, then ``DIR/jet/bin/python``; if
  that venv lacks torch, a ``.pth`` file naming this project's site-packages adds it).

One process, one thread (``--threads``), the median of ``--repeat`` calls after a warm-up; peak
memory is the largest amount of memory the CPU allocator holds during one call (``torch.profiler``
with ``profile_memory=True``). Every fxtools result is checked against the trace of the Hessian.
Run: ``python benchmarks/bench_taylor.py [--dims 16 64] [--dtypes float64] [--repeat 7] [--batch 1024]
[--variants fxtools "fxtools + Inductor"]`` (``--variants`` times only those, still checked against
the trace of the Hessian).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/src")  # this checkout's fxtools, when run as a script

from bench import markdown_header  # noqa: E402  benchmarks/bench.py, beside this file

import fxtools  # noqa: E402

WIDTH, BATCH = 128, 32


def make_mlp(d: int, dtype):
    torch.manual_seed(0)
    params = {
        "w0": torch.randn(d, WIDTH, dtype=dtype) / d**0.5,
        "b0": torch.randn(WIDTH, dtype=dtype) * 0.1,
        "w1": torch.randn(WIDTH, WIDTH, dtype=dtype) / WIDTH**0.5,
        "b1": torch.randn(WIDTH, dtype=dtype) * 0.1,
        "w2": torch.randn(WIDTH, dtype=dtype) / WIDTH**0.5,
    }

    def f(x):
        h = torch.tanh(x @ params["w0"] + params["b0"])
        h = torch.tanh(h @ params["w1"] + params["b1"])
        return h @ params["w2"]

    def column(x):  # the same network, its output of shape (1,)
        h = torch.tanh(x @ params["w0"] + params["b0"])
        h = torch.tanh(h @ params["w1"] + params["b1"])
        return h @ params["w2"].unsqueeze(1)

    f.column = column  # type: ignore[attr-defined]
    f.params = params  # type: ignore[attr-defined]
    return f


def trace_of_hessian(f):
    return torch.func.vmap(lambda x: torch.func.hessian(f)(x).trace())


def vmap_of_hvp(f):
    def lap(x):
        basis = torch.eye(x.numel(), dtype=x.dtype)
        hvp = torch.func.vmap(lambda v: torch.func.jvp(torch.func.grad(f), (x,), (v,))[1])(basis)
        return (hvp * basis).sum()

    return torch.func.vmap(lap)


def fxtools_laplacian(f, xs):
    lap = fxtools.laplacian(f, xs[0])
    batched = fxtools.vmap(lap, xs)
    return lambda x: batched(x)[1]


def fxtools_inductor(f, xs):
    """The vmapped Laplacian module compiled by Inductor (``--inductor``)."""
    lap = fxtools.laplacian(f, xs[0])
    return torch.compile(fxtools.vmap(lap, xs), backend="inductor")


def fxtools_batched(f, xs):
    """The Laplacian of ``u(X)`` written on the whole batch, without vmap (rows are independent)."""

    def u(X):
        h = torch.tanh(X @ f.params["w0"] + f.params["b0"])
        h = torch.tanh(h @ f.params["w1"] + f.params["b1"])
        return h @ f.params["w2"]

    lap = fxtools.laplacian(u, xs)
    return lambda x: lap(x)[1]


def jet_for_pytorch(f, xs):
    try:
        import jet
    except ImportError:
        return None
    return torch.func.vmap(jet.laplacian(f.column, (xs[0],)))  # its rules lack dot: the last layer as a matrix


def median_times(methods, x, repeat: int) -> tuple[dict, dict]:
    """Each method's median wall time and CPU time (the process's, all threads), the methods
    alternating call by call (the machine is shared: CPU time leaves out the time others took)."""
    for fn in methods.values():
        fn(x)
    times: dict = {name: [] for name in methods}
    cpu: dict = {name: [] for name in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            t, c = time.perf_counter(), time.process_time()
            fn(x)
            cpu[name].append(time.process_time() - c)
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}, {name: statistics.median(ts) for name, ts in cpu.items()}


def peak_bytes(fn, x) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(x)
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def run(dims, dtypes, repeat, inductor=False, batch=BATCH, variants=None):
    """One row per dtype and ``D``; ``variants`` (names of ``COLUMNS``) limits the timed methods,
    the trace of the Hessian still being the reference every result is checked against."""
    rows = []
    for dtype in dtypes:
        for d in dims:
            f = make_mlp(d, dtype)
            xs = torch.randn(batch, d, dtype=dtype)
            methods = {
                "fxtools": fxtools_laplacian(f, xs),
                "trace of hessian": trace_of_hessian(f),
                "vmap of hvp": vmap_of_hvp(f),
                "batched u(X)": fxtools_batched(f, xs),
                "jet-for-pytorch": jet_for_pytorch(f, xs),
                "fxtools + Inductor": fxtools_inductor(f, xs) if inductor else None,
            }
            ref = methods["trace of hessian"](xs)
            methods = {name: fn for name, fn in methods.items() if fn is not None and name in (variants or methods)}
            tol = 1e-10 if dtype == torch.float64 else 1e-3
            for name, fn in methods.items():
                got = fn(xs)
                got = got[1] if isinstance(got, tuple) else got
                err = ((got.reshape(ref.shape) - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                assert err < tol, f"{name}'s Laplacian differs from torch.func's by {err:.3g} (D={d}, {dtype})"
            times, cpu = median_times(methods, xs, repeat)
            peaks = {name: peak_bytes(fn, xs) for name, fn in methods.items()}
            rows.append((str(dtype).removeprefix("torch."), d, times, peaks, cpu))
            print(_row(rows[-1]), flush=True)
            print("  CPU ms: " + ", ".join(f"{name} {c * 1e3:.2f}" for name, c in cpu.items()), flush=True)
    return rows


COLUMNS = ["fxtools", "batched u(X)", "jet-for-pytorch", "trace of hessian", "vmap of hvp", "fxtools + Inductor"]
HEADER = markdown_header(
    ["dtype", "D", *(f"{c} ms" for c in COLUMNS)]
    + ["fxtools / trace", "fxtools / jet-for-pytorch", "batched / fxtools", "fxtools MB", "trace MB"]
)


def mb(peaks, name) -> str:
    return f"{peaks[name] / 2**20:.1f}" if name in peaks else "-"


def _row(row) -> str:
    dtype, d, t, p, _ = row

    def ms(name):
        return f"{t[name] * 1e3:.2f}" if name in t else "-"

    def ratio(a, b):
        return f"{t[a] / t[b]:.2f}x" if a in t and b in t else "-"

    return (
        f"| {dtype} | {d} | " + " | ".join(ms(c) for c in COLUMNS) + f" | {ratio('fxtools', 'trace of hessian')} "
        f"| {ratio('fxtools', 'jet-for-pytorch')} | {ratio('batched u(X)', 'fxtools')} "
        f"| {mb(p, 'fxtools')} | {mb(p, 'trace of hessian')} |"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--inductor", action="store_true", help="add fxtools' module compiled by Inductor")
    parser.add_argument("--batch", type=int, default=BATCH, help="points per batch")
    parser.add_argument("--variants", nargs="+", choices=COLUMNS, help="time only these (default: all)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {opts.threads} thread(s), batch {opts.batch}, width {WIDTH}, median of {opts.repeat}"
    )
    print(HEADER)
    dtypes = [getattr(torch, name) for name in opts.dtypes]
    run(opts.dims, dtypes, opts.repeat, opts.inductor or "fxtools + Inductor" in (opts.variants or ()), opts.batch, opts.variants)


if __name__ == "__main__":
    main()
