"""A MeanFlow training step (the network's JVP inside the loss): fxtools against eager and torch.compile.

Run ``python benchmarks/bench_jvp_loss.py`` (``--quick``: fewer repetitions). One process, CPU,
float32, ``--threads`` threads (default 1). The model is ``examples/meanflow.py``'s DiT (adaptive
LayerNorm, attention, GELU MLP, time embedding; ``--depth`` blocks of width ``--width``, batch
``--batch`` x ``--tokens`` tokens) in its ``MeanFlowLoss`` (``torch.func.jvp`` of the network,
target detached). A step is ``loss(*batch).backward()`` (no optimizer step). Variants:

- eager: ``torch.func.jvp`` under ``sdpa_kernel(SDPBackend.MATH)``, the only eager path that runs
  (the CPU flash kernel has no forward-mode formula);
- ``torch.compile(loss)`` (Inductor): whether it runs, and its step when it does;
- ``fxtools.compile(loss, compiler="inductor")`` and ``fxtools.compile(loss)`` (no compiler).

Step time: median over repetitions, the variants called in turn, as wall time and as the thread's
CPU time (with one thread, the work itself: on a shared machine it moves far less with the load
than wall time does; the load average is printed with the results); peak memory: the CPU
allocator's peak during one step beyond what it held before (``fxtools.training.budget.allocated_peak``).
Results are printed and appended to ``benchmarks/results_jvp_loss.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxtools
from fxtools.training.budget import allocated_peak

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from bench import log  # noqa: E402
from meanflow import DiT, MeanFlowLoss, batch  # noqa: E402


def steps(args):
    """variant -> a function running one training step (or the error that stops the variant)."""
    torch.manual_seed(0)
    loss = MeanFlowLoss(DiT(d=args.width, heads=4, depth=args.depth, tokens=args.tokens))
    data = batch(args.batch, args.tokens, generator=torch.Generator().manual_seed(0))
    out = {}

    eager = copy.deepcopy(loss)

    def eager_step():
        with sdpa_kernel(SDPBackend.MATH):
            eager(*data).backward()

    out["eager (torch.func.jvp, MATH attention)"] = eager_step
    variants = {
        "torch.compile (Inductor)": lambda m: torch.compile(m),
        "fxtools.compile(compiler='inductor')": lambda m: fxtools.compile(m, compiler="inductor"),
        "fxtools.compile (no compiler)": lambda m: fxtools.compile(m),
    }
    for name, make in variants.items():
        compiled = make(copy.deepcopy(loss))
        try:
            log(f"compiling {name}")
            compiled(*data).backward()
            out[name] = lambda c=compiled: c(*data).backward()
        except Exception as e:  # noqa: BLE001 - reported in the results
            out[name] = f"fails: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return out


def interleaved_medians(fns, reps, warmup=2):
    """Median wall and thread-CPU time of each function, the functions called in turn ``reps`` times."""
    for _ in range(warmup):
        for f in fns:
            f()
    wall, cpu = [[] for _ in fns], [[] for _ in fns]
    for _ in range(reps):
        for f, w, c in zip(fns, wall, cpu):
            gc.collect()
            start, start_cpu = time.perf_counter(), time.thread_time()
            f()
            c.append(time.thread_time() - start_cpu)
            w.append(time.perf_counter() - start)
    return [statistics.median(w) for w in wall], [statistics.median(c) for c in cpu]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = steps(args)
    runnable = {k: v for k, v in variants.items() if callable(v)}
    load = os.getloadavg()[0]
    wall, cpu = interleaved_medians(list(runnable.values()), reps=3 if args.quick else 10)
    times, cpus = dict(zip(runnable, wall)), dict(zip(runnable, cpu))
    load = max(load, os.getloadavg()[0])
    peaks = {k: allocated_peak(v) for k, v in runnable.items()}
    eager = next(iter(runnable))
    lines = [
        f"## {datetime.date.today()}: width {args.width}, depth {args.depth}, batch {args.batch} x {args.tokens} tokens, "
        f"float32, {args.threads} thread(s), torch {torch.__version__}, {platform.machine()}, load average {load:.1f} "
        f"on {os.cpu_count()} cores",
        "",
        "| variant | step (ms) | vs eager | CPU time (ms) | vs eager | peak memory (MB) | vs eager |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in variants.items():
        if name in runnable:
            lines.append(
                f"| {name} | {times[name] * 1e3:.1f} | {times[name] / times[eager]:.2f}x | "
                f"{cpus[name] * 1e3:.1f} | {cpus[name] / cpus[eager]:.2f}x | "
                f"{peaks[name] / 2**20:.1f} | {peaks[name] / peaks[eager]:.2f}x |"
            )
        else:
            lines.append(f"| {name} | {v} | | | | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(HERE, "results_jvp_loss.md"), "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
