"""The readable path against eager autograd: forward+backward time, with a per-op profile.

Run ``python benchmarks/bench_readable.py`` (``--config small`` or ``--layers 2`` for a quick run).
For a GPT-2-sized model (``examples.gpt("gpt2")``: width 768, 12 layers, vocabulary 50257,
float32, tied embedding and head; by default batch 1 and 64 tokens, one thread), everything in
this one process:

- ``fxtools.compile(model, rules="readable")`` (the graphs ``fxtools.split`` prints, run by
  fxtools' autograd.Function, no compiler), the same with ``rules="fused"``, and eager autograd,
  each a training step ``loss = model(idx, targets); loss.backward()``, called in turn
  ``--reps`` times after a warm-up: medians, best runs and their ratios to eager's;
- a ``torch.profiler`` profile of one step of the readable path and one of eager's: the ops whose
  self CPU time differs most, so that a regression shows with its cause; and the step's wall time
  the profiler's op time does not account for (the generated code's own work, allocation, frees);
- build time: ``fxtools.split`` (readable) against ``aot_function`` (no-op compilers, first
  forward+backward call minus a steady-state one), medians of ``--build-reps`` alternating runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time

import torch

import fxtools
from fxtools.cli import examples


def step(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    return loss


def interleaved(fns: dict, reps: int, warmup: int = 1) -> dict:
    """Wall times of each function, called in turn ``reps`` times after ``warmup`` rounds."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


def profile_ops(fn):
    """``({op name: self CPU seconds}, wall seconds)`` of one call of ``fn`` under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    return ops, wall


def profile_table(a_name, a, b_name, b, top):
    """Markdown lines: the ``top`` ops whose self CPU time differs most between ``a`` and ``b``."""
    (ops_a, wall_a), (ops_b, wall_b) = a, b
    diffs = sorted(set(ops_a) | set(ops_b), key=lambda k: -abs(ops_a.get(k, 0.0) - ops_b.get(k, 0.0)))
    lines = [
        f"| op (self CPU s) | {a_name} | {b_name} | difference |",
        "|---|---:|---:|---:|",
    ]
    for k in diffs[:top]:
        x, y = ops_a.get(k, 0.0), ops_b.get(k, 0.0)
        lines.append(f"| `{k}` | {x:.3f} | {y:.3f} | {x - y:+.3f} |")
    tot_a, tot_b = sum(ops_a.values()), sum(ops_b.values())
    lines.append(f"| all ops | {tot_a:.3f} | {tot_b:.3f} | {tot_a - tot_b:+.3f} |")
    lines.append(f"| wall time of the step | {wall_a:.3f} | {wall_b:.3f} | {wall_a - wall_b:+.3f} |")
    return lines


def aot_build(model, inputs):
    """Seconds for ``aot_function`` (no-op compilers) to trace and partition one training step."""
    from torch._functorch.aot_autograd import aot_function

    loss_fn = fxtools.functional(model)
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    fn = aot_function(loss_fn, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm)
    t0 = time.perf_counter()
    torch.autograd.grad(fn(params, *inputs), list(params.values()))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.autograd.grad(fn(params, *inputs), list(params.values()))
    return first - (time.perf_counter() - t0)


def split_build(model, inputs):
    t0 = time.perf_counter()
    with fxtools.rule_set("readable"):
        fxtools.split(fxtools.functional(model), dict(model.named_parameters()), *inputs)
    return time.perf_counter() - t0


def summary(times):
    eager_med, eager_best = statistics.median(times["eager"]), min(times["eager"])
    rows = []
    for k, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        rows.append(f"| {k} | {med:.3f} | {best:.3f} | {med / eager_med:.2f}x | {best / eager_best:.2f}x |")
    return ["| | median s | best s | median / eager | best / eager |", "|---|---:|---:|---:|---:|", *rows]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpt2", choices=["gpt2", "small"], help="small: 2 layers, vocabulary 8192")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "explicit"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--build-reps", type=int, default=3, help="0 skips the build-time comparison")
    parser.add_argument("--top", type=int, default=12, help="rows of the per-op profile")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = {"vocab_size": 8192, "n_layer": 2} if args.config == "small" else {}
    if args.layers is not None:
        overrides["n_layer"] = args.layers
    model, inputs = examples.gpt("gpt2", args.attention, batch=args.batch, seq_len=args.seq, dtype=torch.float32, **overrides)
    model.train()
    cfg = model.config
    nparams = sum(p.numel() for p in model.parameters())
    compiled = {r: fxtools.compile(model, *inputs, rules=r) for r in ("readable", "fused")}
    fns = {
        "readable": lambda: step(compiled["readable"], inputs),
        "fused": lambda: step(compiled["fused"], inputs),
        "eager": lambda: step(model, inputs),
    }
    times = interleaved(fns, args.reps)
    load = os.getloadavg()
    lines = [
        f"GPT: width {cfg.n_embd}, {cfg.n_layer} layers, vocabulary {cfg.vocab_size}, {args.attention} attention, "
        f"{nparams / 1e6:.1f}M parameters, float32, batch {args.batch} x {args.seq} tokens; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"load average {load[0]:.1f}; {args.reps} alternating steps each.",
        "",
        *summary(times),
        "",
        *profile_table("readable", profile_ops(fns["readable"]), "eager", profile_ops(fns["eager"]), args.top),
    ]
    if args.build_reps:
        builds: dict = {"split": [], "aot": []}
        for _ in range(args.build_reps):
            builds["split"].append(split_build(model, inputs))
            builds["aot"].append(aot_build(model, inputs))
        s, a = statistics.median(builds["split"]), statistics.median(builds["aot"])
        lines += ["", f"build: fxtools.split {s:.3f} s, aot_function {a:.3f} s: {s / a:.2f}x (medians of {args.build_reps})"]
    print("\n".join(lines))
    return times


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
