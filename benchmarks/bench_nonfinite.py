"""The cost of looking for NaNs: ``check_finite`` against ``torch.autograd.detect_anomaly``.

Run ``python benchmarks/bench_nonfinite.py`` (``--quick`` for a smoke run; ``--inductor`` adds
``compiler="inductor"``, whose compilation takes minutes on a small CPU). For each model (GPT with
explicit causal attention, so every step carries the intended ``-inf`` of its mask), everything in
this one process, the variants of one training step (``loss = model(idx, targets);
loss.backward()``) run interleaved, and the medians are compared:

- ``fxtools.compile(model, check_finite=True)`` against ``fxtools.compile(model)`` (the issue's
  budget: at most 1.3x);
- eager under ``torch.autograd.detect_anomaly()`` against eager.

Results are printed and written to ``benchmarks/results_nonfinite.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import statistics
import time

import torch

import fxtools
from fxtools.cli import examples

MODELS = {  # name: (examples.gpt overrides, batch, sequence)
    "small GPT (2 layers, width 64)": (dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256), 8, 64),
    "larger GPT (4 layers, width 256)": (dict(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=2048), 8, 128),
}
QUICK = {"tiny GPT": (dict(), 2, 8)}


def _step(model, inputs, anomaly=False):
    model.zero_grad(set_to_none=True)
    if anomaly:
        with torch.autograd.detect_anomaly():
            model(*inputs).backward()
    else:
        model(*inputs).backward()


def check_alone(compiled, model, inputs, reps) -> tuple[float, float]:
    """Median and minimum seconds of the cheap check alone (what ``check_finite`` adds to a finite step): the
    reductions over one forward's outputs and over the gradients."""
    from fxtools.training.finite import Checker

    sp = compiled.split
    checker = Checker(sp)
    leaves = sp.flatten(dict(compiled.module.named_parameters()), *inputs)
    with torch.no_grad():
        out, _ = sp.forward(*leaves)
    outs = list(torch.utils._pytree.tree_leaves(out))
    grads = [p.detach().clone() for p in model.parameters()]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        checker.forward(leaves, outs)
        checker.backward(grads, lambda: None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def measure(overrides, batch, seq, reps, inductor) -> dict[str, float]:
    """Median seconds per step of each variant, and of the check alone."""
    torch.manual_seed(0)
    model, inputs = examples.gpt("tiny", attention="explicit", batch=batch, seq_len=seq, **overrides)
    model.train()
    variants = {
        "eager": (model, False),
        "eager + detect_anomaly": (model, True),
        "fxtools.compile": (fxtools.compile(copy.deepcopy(model), *inputs), False),
        "fxtools.compile check_finite": (fxtools.compile(copy.deepcopy(model), *inputs, check_finite=True), False),
    }
    if inductor:
        variants["inductor"] = (fxtools.compile(copy.deepcopy(model), *inputs, compiler="inductor"), False)
        variants["inductor check_finite"] = (
            fxtools.compile(copy.deepcopy(model), *inputs, compiler="inductor", check_finite=True),
            False,
        )
    for m, anomaly in variants.values():  # warm up
        _step(m, inputs, anomaly)
        _step(m, inputs, anomaly)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, (m, anomaly) in variants.items():
            gc.collect()
            t0 = time.perf_counter()
            _step(m, inputs, anomaly)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    med["check alone"], med["check alone min"] = check_alone(variants["fxtools.compile check_finite"][0], model, inputs, 3 * reps)
    return med


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny GPT, 3 repetitions")
    parser.add_argument("--inductor", action="store_true", help="also Inductor (compiles for minutes)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results_nonfinite.md"))
    parser.add_argument("--only", default="", help="only the models whose name contains this (e.g. small)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {k: v for k, v in (QUICK if args.quick else MODELS).items() if args.only in k}
    reps = 3 if args.quick else args.reps
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"
    lines = [
        f"# check_finite against detect_anomaly ({when})",
        "",
        f"Machine: {machine}. GPT with explicit causal attention, float32, training mode; one step is "
        f"`model(idx, targets).backward()`; {reps} interleaved repetitions per variant, medians. "
        "`check alone`: the cheap check's reductions over one step's outputs and gradients, "
        "timed by themselves (the machine is shared, so the end-to-end ratio is noisier).",
        "",
        "| model | eager ms | detect_anomaly ms | x eager | fxtools.compile ms | check_finite ms | x compile "
        "| check alone ms (median, min) | 1 + check / compile (median, min) |"
        + (" inductor ms | inductor check_finite ms | x inductor |" if args.inductor else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if args.inductor else ""),
    ]
    for name, (overrides, batch, seq) in models.items():
        med = measure(overrides, batch, seq, reps, args.inductor)
        row = (
            f"| {name}, batch {batch}, sequence {seq} | {med['eager'] * 1e3:.1f} | {med['eager + detect_anomaly'] * 1e3:.1f} "
            f"| {med['eager + detect_anomaly'] / med['eager']:.2f} | {med['fxtools.compile'] * 1e3:.1f} "
            f"| {med['fxtools.compile check_finite'] * 1e3:.1f} "
            f"| {med['fxtools.compile check_finite'] / med['fxtools.compile']:.2f} "
            f"| {med['check alone'] * 1e3:.2f}, {med['check alone min'] * 1e3:.2f} "
            f"| {1 + med['check alone'] / med['fxtools.compile']:.3f}, "
            f"{1 + med['check alone min'] / med['fxtools.compile']:.3f} |"
        )
        if args.inductor:
            row += (
                f" {med['inductor'] * 1e3:.1f} | {med['inductor check_finite'] * 1e3:.1f} "
                f"| {med['inductor check_finite'] / med['inductor']:.2f} |"
            )
        lines.append(row)
        print(row, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        appending = os.path.exists(args.out)
        with open(args.out, "a" if appending else "w") as f:
            f.write(("\n" if appending else "") + text)


if __name__ == "__main__":
    main()
