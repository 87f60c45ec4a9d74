"""The cost of the guards (``fxtools.signature.guards``) on a GPT-2-size training step.

Run ``python benchmarks/bench_guards.py`` (``--quick``: a 4-layer GPT, for a smoke run). The
model is the ``gpt`` example at the size ``bench.py`` calls "GPT-2 124M" (12 layers, width 768,
vocabulary 50257, batch 1 x 64 tokens, float32). Measured in this one process, on the CPU:

- ``fxtools.grad`` module: median time of ``gm(params, idx, targets)`` (guarded) against
  ``gm.forward(params, idx, targets)`` (the same code, unguarded), called in turn; and the median
  time of the check alone (``gm.guards.check(args)``), which the difference of two noisy step
  medians can only bound;
- ``fxtools.compile``: median time of a training step (``loss = compiled(idx, targets);
  loss.backward()``) against the median time of choosing its graphs (``compiled._runners(...)``:
  the guards' check, which also flattens the arguments, and the ``requires_grad`` pattern).

The guards' share of a step is the check's median over the step's median; it must stay under 1%.
Results are printed and written to ``benchmarks/results_guards.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
from bench import interleaved_median_times  # benchmarks/bench.py, beside this file

import fxtools
from fxtools.cli import examples

HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg):
    print(f"[bench_guards {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_time(fn, reps, inner=1):
    """Median over ``reps`` of the mean time of ``inner`` calls (for calls far below a millisecond)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 4-layer GPT of width 128, few repetitions")
    p.add_argument("--reps", type=int, default=None)
    a = p.parse_args(argv)
    if a.quick:
        name = "GPT 4 layers, width 128 (1x32 tokens)"
        build = dict(batch=1, seq_len=32, n_layer=4, n_embd=128, n_head=4, vocab_size=1024)
    else:
        name = "GPT-2 124M (12 layers, width 768, 1x64 tokens)"
        build = dict(batch=1, seq_len=64)
    reps = a.reps or (5 if a.quick else 15)
    model, (idx, targets) = examples.gpt("gpt2", **build)
    loss_fn, args = examples.as_loss(model, (idx, targets))
    n_leaves = len(gm_leaves := torch.utils._pytree.tree_leaves(args))
    del gm_leaves
    log(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {n_leaves} argument leaves")

    log("fxtools.grad ...")
    gm = fxtools.grad(loss_fn, *args)
    guarded, bare = interleaved_median_times([lambda: gm(*args), lambda: gm.forward(*args)], reps)
    check = median_time(lambda: gm.guards.check(args), reps, inner=100)

    log("fxtools.compile ...")
    compiled = fxtools.compile(model, idx, targets)

    def step():
        model.zero_grad(set_to_none=True)
        compiled(idx, targets).backward()

    step_time = interleaved_median_times([step], reps)[0]
    cargs = compiled._args((idx, targets), {})
    choose = median_time(lambda: compiled._runners(cargs, model.training), reps, inner=100)

    rows = [
        ("fxtools.grad: gm(*args), guarded", f"{guarded * 1e3:.1f} ms"),
        ("fxtools.grad: gm.forward(*args), unguarded", f"{bare * 1e3:.1f} ms"),
        ("fxtools.grad: difference of the medians", f"{(guarded - bare) * 1e3:+.2f} ms ({(guarded - bare) / bare:+.2%})"),
        ("gm.guards.check(args) alone", f"{check * 1e6:.0f} µs ({check / bare:.3%} of the step)"),
        ("fxtools.compile: training step (forward + backward)", f"{step_time * 1e3:.1f} ms"),
        (
            "fxtools.compile: choosing the graphs (guards + requires_grad)",
            f"{choose * 1e6:.0f} µs ({choose / step_time:.3%} of the step)",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [
        f"# The guards' cost ({name})",
        "",
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads, medians of {reps} steps; {n_leaves} argument leaves "
        "(parameters, idx, targets).",
        "",
        "| measurement | time |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in rows]
    text = "\n".join(lines) + "\n"
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if not a.quick:
        with open(os.path.join(HERE, "results_guards.md"), "w") as fh:
            fh.write(text)
    worst = max(check / bare, choose / step_time)
    print(f"guards' share of a step: {worst:.3%} (must be under 1%)")
    return 0 if worst < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
