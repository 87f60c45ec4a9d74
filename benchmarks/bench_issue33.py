"""Every number of issue 33's "Done when", in one run: ``python benchmarks/bench_issue33.py``.

- forward+backward of a GPT-2-sized model (``bench_readable.py``'s: width 768, 12 layers,
  vocabulary 50257, float32, batch 1 x 64 tokens, one thread): ``fxtools.compile(model,
  rules="readable")``, the same with ``rules="fused"`` and eager autograd, called in turn
  (``--reps`` steps after a warm-up), medians and best runs and their ratios to eager's;
- build time: ``fxtools.split`` (readable) against ``aot_function`` with no-op compilers (its first
  forward+backward call less a steady one), medians of ``--build-reps`` alternating builds, at
  GPT-2 size and on a small GPT (``bench_readable.py --config small``: 2 layers, vocabulary 8192);
- ``import fxtools`` over ``import torch``: fresh interpreters, alternating, medians and best.

Build and import times are given as wall time and as CPU time (the process's, or the child
interpreter's): on a shared machine the wall times' ratios move with the load, the CPU times' much less.

Prints one table (goals: readable <= 1.05x and fused <= 1.00x eager, build <= 0.4x, import <= +0.3 s).
About 4-6 minutes on 2 loaded vCPUs; ``--quick`` (2 layers, fewer runs) for a check that it runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_readable import interleaved, step  # noqa: E402

import fxtools  # noqa: E402
from fxtools.cli import examples  # noqa: E402


def step_times(layers: int, reps: int) -> dict:
    """Seconds of each training step: readable, fused, eager (alternating)."""
    model, inputs = examples.gpt("gpt2", "sdpa", batch=1, seq_len=64, dtype=torch.float32, n_layer=layers)
    model.train()
    compiled = {r: fxtools.compile(model, *inputs, rules=r) for r in ("readable", "fused")}
    fns = {
        "readable": lambda: step(compiled["readable"], inputs),
        "fused": lambda: step(compiled["fused"], inputs),
        "eager": lambda: step(model, inputs),
    }
    return interleaved(fns, reps)


def _clocks():
    return time.perf_counter(), time.process_time()


def _split_build(model, inputs):
    """(wall, CPU) seconds of ``fxtools.split`` (readable) of the model."""
    w, c = _clocks()
    with fxtools.rule_set("readable"):
        fxtools.split(fxtools.functional(model), dict(model.named_parameters()), *inputs)
    w1, c1 = _clocks()
    return w1 - w, c1 - c


def _aot_build(model, inputs):
    """(wall, CPU) seconds of ``aot_function``'s first forward+backward (no-op compilers) less a steady one's."""
    from torch._functorch.aot_autograd import aot_function

    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    fn = aot_function(fxtools.functional(model), fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm)
    t = [_clocks()]
    for _ in range(2):
        torch.autograd.grad(fn(params, *inputs), list(params.values()))
        t.append(_clocks())
    return tuple((t[1][k] - t[0][k]) - (t[2][k] - t[1][k]) for k in range(2))


def build_times(model, inputs, reps: int) -> dict:
    """Wall and CPU seconds of ``fxtools.split`` and of ``aot_function``'s first call, alternating."""
    builds: dict = {k: [] for k in ("split", "aot", "split_cpu", "aot_cpu")}
    _split_build(model, inputs)  # warm: first use loads the rules and PyTorch's decompositions
    for _ in range(reps):
        for k, fn in (("split", _split_build), ("aot", _aot_build)):
            wall, cpu = fn(model, inputs)
            builds[k].append(wall)
            builds[k + "_cpu"].append(cpu)
    return builds


def import_times(reps: int) -> dict:
    """Wall and CPU seconds of ``import torch`` and ``import torch, fxtools`` in fresh interpreters, alternating."""
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    code = {"torch": "import torch", "fxtools": "import torch, fxtools"}
    times: dict = {k: [] for k in ("torch", "fxtools", "torch_cpu", "fxtools_cpu")}
    for _ in range(reps):
        for k, c in code.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", c], check=True, env=env)
            times[k].append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            times[k + "_cpu"].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return times


def row(what, a, b, goal, unit="x"):
    """A table row: ``a`` against ``b`` (lists of seconds), as a ratio (``x``) or a difference (``s``)."""
    ma, mb, ba, bb = statistics.median(a), statistics.median(b), min(a), min(b)
    if unit == "x":
        return f"| {what} | {ma:.3f} / {mb:.3f} s | {ma / mb:.2f}x | {ba / bb:.2f}x | {goal} |"
    return f"| {what} | {ma:.3f} / {mb:.3f} s | {ma - mb:+.3f} s | {ba - bb:+.3f} s | {goal} |"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 runs of each: checks that it runs")
    parser.add_argument("--reps", type=int, default=5, help="alternating training steps")
    parser.add_argument("--build-reps", type=int, default=3)
    parser.add_argument("--import-reps", type=int, default=5)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*boxed arguments.*")
    torch.set_num_threads(1)
    layers = 2 if args.quick else 12
    reps, build_reps, import_reps = (3, 1, 2) if args.quick else (args.reps, args.build_reps, args.import_reps)
    started = time.perf_counter()
    steps = step_times(layers, reps)
    gpt2, gpt2_in = examples.gpt("gpt2", "sdpa", batch=1, seq_len=64, dtype=torch.float32, n_layer=layers)
    big = build_times(gpt2, gpt2_in, build_reps)
    small, small_in = examples.gpt("gpt2", "sdpa", batch=1, seq_len=64, dtype=torch.float32, n_layer=2, vocab_size=8192)
    little = build_times(small, small_in, build_reps)
    imports = import_times(import_reps)
    load = os.getloadavg()
    lines = [
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, one thread, load average {load[0]:.1f}; GPT-2 size ({layers} layers), "
        f"{reps} alternating steps, {build_reps} alternating builds, {import_reps} imports; {time.perf_counter() - started:.0f} s",
        "",
        "| | medians | median ratio | best ratio | goal |",
        "|---|---:|---:|---:|---|",
        row("readable split / eager, fwd+bwd", steps["readable"], steps["eager"], "<= 1.05x"),
        row("fused rules / eager, fwd+bwd", steps["fused"], steps["eager"], "<= 1.00x"),
        row("build: split / aot_function, GPT-2 size, wall", big["split"], big["aot"], "<= 0.4x"),
        row("build: split / aot_function, GPT-2 size, CPU", big["split_cpu"], big["aot_cpu"], "<= 0.4x"),
        row("build: split / aot_function, small GPT, wall", little["split"], little["aot"], "<= 0.4x"),
        row("build: split / aot_function, small GPT, CPU", little["split_cpu"], little["aot_cpu"], "<= 0.4x"),
        row("`import fxtools` over `import torch`, wall", imports["fxtools"], imports["torch"], "<= +0.3 s", unit="s"),
        row("`import fxtools` over `import torch`, CPU", imports["fxtools_cpu"], imports["torch_cpu"], "<= +0.3 s", unit="s"),
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
