"""fxtools + Inductor against torch.compile: training-step time, compile time, saved bytes.

Run ``python benchmarks/bench_compile.py`` (``--quick`` for the small size only, few repetitions).
Everything is measured in this one process, on the CPU, with ``--threads`` threads (default 1:
steadier on a shared machine). Two GPT-style models (``fxtools.cli.examples.gpt``, float32,
``--attention explicit`` by default: nanoGPT's softmax attention with its causal mask held as a
buffer and sliced, or ``sdpa``):

- small: 2 layers, 4 heads, width 128, vocabulary 512, batch 4 x 64 tokens;
- GPT-2 size: 12 layers, 12 heads, width 768, vocabulary 50257 (124M parameters), by default
  batch 2 x 128 tokens (``--gpt2-tokens``; GPT-2's 1024 takes tens of seconds a step on a small CPU).

Each is trained (``loss = model(idx, targets); loss.backward()``; no optimizer step) by: eager;
``torch.compile(model)`` (default Inductor); ``fxtools.compile(model, compiler="inductor")`` with
the fused and with the readable rule set; ``fxtools.compile(model)`` without a compiler, with the
fused and with the readable rule set (the readable one runs the code ``fxtools.grad`` prints).

- step time: median over repetitions, the variants called in turn (``bench.interleaved_median_times``),
  and the ratio to torch.compile's step in the same run;
- compile time: the first step (tracing, partitioning, compiling) minus the median step;
- saved bytes: what the forward keeps for the backward, parameters and inputs not counted, each
  storage once. Eager: tensors packed through ``saved_tensors_hooks``; torch.compile and fxtools:
  the tensors the step's autograd node holds (``saved_tensors``, and fxtools' activation list).

Results are printed and written to ``benchmarks/results_compile.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import sys
import time

import torch

import fxtools
from fxtools.cli import examples

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import interleaved_median_times, log  # noqa: E402

VARIANTS = (
    "eager",
    "torch.compile",
    "fxtools+inductor fused",
    "fxtools+inductor readable",
    "fxtools fused (no compiler)",
    "fxtools readable (no compiler)",
)


def make(variant, model):
    if variant == "eager":
        return model
    if variant == "torch.compile":
        return torch.compile(model)
    if variant == "fxtools+inductor fused":
        return fxtools.compile(model, compiler="inductor", rules="fused")
    if variant == "fxtools+inductor readable":
        return fxtools.compile(model, compiler="inductor", rules="readable")
    if variant == "fxtools readable (no compiler)":
        return fxtools.compile(model, rules="readable")
    return fxtools.compile(model)


def step(model, inputs):
    def run():
        for p in model.parameters():
            p.grad = None
        loss = model(*inputs)
        loss.backward()

    return run


def _storages(tensors, exclude):
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = t.untyped_storage().data_ptr()
        if key in exclude or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _autograd_nodes(root):
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(n for n, _ in node.next_functions)


def saved_bytes(variant, compiled, model, inputs):
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {x.untyped_storage().data_ptr() for x in inputs}
    if variant == "eager":
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            loss = compiled(*inputs)
        return _storages(packed, exclude)
    loss = compiled(*inputs)
    tensors = []
    for node in _autograd_nodes(loss.grad_fn):
        if type(node).__name__ in ("CompiledFunctionBackward", "_SplitFunctionBackward"):
            tensors += list(node.saved_tensors) + list(getattr(node, "fxtools_saved", None) or [])
    return _storages(tensors, exclude)


def measure(name, model, inputs, reps, variants=VARIANTS):
    log(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, tokens {tuple(inputs[0].shape)}")
    rows = {}
    steps = []
    for variant in variants:
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        gc.collect()
        start = time.perf_counter()
        compiled = make(variant, m)
        step(m if variant == "eager" else compiled, inputs)()  # first step: traces and compiles
        first = time.perf_counter() - start
        s = step(compiled, inputs)
        steps.append(s)
        rows[variant] = {"first": first, "saved": saved_bytes(variant, compiled, m, inputs)}
        log(f"  {variant}: first step {first:.2f} s")
    times = interleaved_median_times(steps, reps, warmup=1)
    for variant, t in zip(variants, times):
        rows[variant]["step"] = t
        rows[variant]["compile"] = max(rows[variant]["first"] - t, 0.0)
    return rows


def table(name, rows):
    eager = rows["eager"]
    base = rows.get("torch.compile", {"step": float("nan"), "compile": 0.0, "saved": float("nan")})
    lines = [
        f"**{name}**",
        "",
        "| | step (median) | vs eager | vs torch.compile | compile time | vs torch.compile | saved for backward | vs torch.compile |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, r in rows.items():
        compile_time = "-" if variant == "eager" else f"{r['compile']:.1f} s"
        compile_ratio = "-" if variant == "eager" or not base["compile"] else f"{r['compile'] / base['compile']:.2f}x"
        lines.append(
            f"| {variant} | {r['step'] * 1e3:.1f} ms | {r['step'] / eager['step']:.2f}x | {r['step'] / base['step']:.2f}x | "
            f"{compile_time} | {compile_ratio} | {r['saved'] / 2**20:.2f} MiB | {r['saved'] / max(base['saved'], 1):.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small size only (5 repetitions unless --reps)")
    parser.add_argument("--size", choices=("small", "gpt2", "both"), default="both")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gpt2-tokens", type=int, nargs=2, default=(2, 128), metavar=("BATCH", "SEQ"))
    parser.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS, help="eager is always run")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results_compile.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False  # compile times from scratch, for every variant alike
    sizes = []
    if args.quick or args.size in ("small", "both"):
        small = dict(n_layer=2, n_head=4, n_embd=128, vocab_size=512, block_size=64)
        sizes.append(("small GPT (2 layers, width 128, 4x64 tokens)", small, (4, 64), 30))
    if not args.quick and args.size in ("gpt2", "both"):
        b, t = args.gpt2_tokens
        sizes.append((f"GPT-2 size (124M parameters, {b}x{t} tokens)", dict(), (b, t), 5))
    out = [
        "# fxtools + Inductor against torch.compile (`benchmarks/bench_compile.py`)",
        "",
        f"{datetime.date.today()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} thread(s), float32, {args.attention} attention.",
        "",
    ]
    for name, config, (batch, seq), reps in sizes:
        size = "tiny" if config else "gpt2"
        model, inputs = examples.gpt(size, attention=args.attention, batch=batch, seq_len=seq, **config)
        variants = ("eager", *(v for v in args.variants if v != "eager"))
        rows = measure(name, model, inputs, args.reps or (5 if args.quick else reps), variants)
        text = table(name, rows)
        print(text + "\n", flush=True)
        out += [text, ""]
    with open(args.out, "w") as f:
        f.write("\n".join(out))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
