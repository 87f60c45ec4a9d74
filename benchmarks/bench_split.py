"""fxtools.split / fxtools.compile against eager autograd: saved bytes and forward+backward time.

Run ``python benchmarks/bench_split.py`` (``--quick`` for a small smoke run). For a GPT-2-sized
model (``examples.gpt("gpt2")``: 12 layers, 12 heads, width 768, vocabulary 50257, 124M
parameters, float32), by default at batch 1 and sequence length 256 rather than GPT-2's 1024
(a full-size step takes tens of seconds on a small CPU), everything measured in this one process:

- saved bytes: what the forward keeps alive for the backward, parameters and inputs not counted,
  each storage once. Eager autograd: tensors packed through
  ``torch.autograd.graph.saved_tensors_hooks`` during ``loss = model(idx, targets)``. fxtools:
  the tensors ``Split.forward`` returns as ``saved``, by the same rule;
- forward+backward time: median over repetitions (interleaved with eager's) of
  ``loss = model(idx, targets); loss.backward()`` through ``fxtools.compile(model, policy=...)``
  against the same on the eager model; the ratio is fxtools / eager.

Results are printed and written to ``benchmarks/results_split.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time

import torch

import fxtools
from fxtools.cli import examples


def _storages(tensors, exclude):
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in exclude or key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def eager_saved_bytes(model, inputs, exclude):
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)
    total = _storages(packed, exclude)
    del loss, packed
    return total


def split_saved_bytes(sp, model, inputs, exclude):
    args = (dict(model.named_parameters()), *inputs)
    with torch.no_grad():
        _, saved = sp.forward(*sp.flatten(*args))
    return _storages(saved, exclude)


def step(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    return loss


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--size", default="gpt2")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--policies", default="save_all,recompute_cheap,dots_saveable")
    parser.add_argument("--quick", action="store_true", help="tiny GPT, 2 repetitions")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results_split.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.batch, args.seq, args.reps = "tiny", 2, 8, 2
    torch.manual_seed(0)
    model, inputs = examples.gpt(args.size, batch=args.batch, seq_len=args.seq, dtype=torch.float32)
    model.train()
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {x.untyped_storage().data_ptr() for x in inputs}
    nparams = sum(p.numel() for p in model.parameters())
    policies = [p for p in args.policies.split(",") if p]

    eager_bytes = eager_saved_bytes(model, inputs, exclude)
    compiled, build = {}, {}
    for policy in policies:
        t0 = time.perf_counter()
        compiled[policy] = fxtools.compile(model, *inputs, policy=policy)
        build[policy] = time.perf_counter() - t0
    # warm up, then interleave repetitions
    step(model, inputs)
    for c in compiled.values():
        step(c, inputs)
    times = {"eager": [], **{p: [] for p in policies}}
    for _ in range(args.reps):
        for name, m in [("eager", model), *compiled.items()]:
            gc.collect()
            t0 = time.perf_counter()
            step(m, inputs)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}

    rows = [("eager autograd", eager_bytes, None, med["eager"], None)]
    for policy in policies:
        sp = compiled[policy].split
        b = split_saved_bytes(sp, model, inputs, exclude)
        rows.append((f"fxtools {policy}", b, sp.saved_bytes, med[policy], build[policy]))

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}"
    )
    lines = [
        f"# fxtools.split against eager autograd ({when})",
        "",
        f"Machine: {machine}.",
        f"Model: GPT `{args.size}` ({nparams / 1e6:.1f}M parameters), float32, batch {args.batch}, "
        f"sequence {args.seq}, training mode; {args.reps} interleaved repetitions, medians.",
        "Saved bytes: activations kept for the backward, parameters and inputs excluded, each storage once.",
        "",
        "| | saved MB | x eager | forward+backward s | x eager | split time s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, b, static, t, bt in rows:
        lines.append(
            f"| {name} | {b / 2**20:.1f} | {b / eager_bytes:.2f} | {t:.3f} | {t / med['eager']:.2f} | "
            f"{'' if bt is None else f'{bt:.1f}'} |"
        )
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
