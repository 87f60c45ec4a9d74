"""Folding (``fxtools.codegen.fold``): how many lines it saves, and that it costs no time.

Run ``python benchmarks/bench_folding.py``. On the ``gpt`` example with one block (the issue's
"GPT block"): the lines of ``fxtools.grad``'s code (forward and backward in one function) and of
``fxtools.split``'s backward, folded (``gm.code``) and flat (``fold.flat_code(gm)``), counting
every line of the function body (frees too); then the fastest of many calls of each module,
folded and flat (a copy recompiled ``with fold.flat()``), their calls interleaved,, on a larger block (``--width``,
``--seq``) so that the kernels, not Python, take the time.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/src")  # this checkout's fxtools, when run as a script

import fxtools  # noqa: E402
from fxtools.cli import examples  # noqa: E402
from fxtools.codegen import fold  # noqa: E402


def body_lines(code: str) -> int:
    return sum(1 for line in code.splitlines() if line.startswith("    "))


def modules(**sizes):
    """(name, module, arguments) of the GPT block's grad and split backward."""
    f, args = examples.example("gpt", n_layer=1, **sizes)
    grad = fxtools.grad(f, *args)
    model, inputs = examples.gpt(n_layer=1, **sizes)
    loss, largs = examples.as_loss(model, inputs)
    sp = fxtools.split(loss, *largs)
    _, saved = sp.forward(*sp.flatten(*largs))
    cts = [torch.ones(c.shape, dtype=c.dtype) for c in sp.cotangents]
    return [("grad", grad, args), ("split backward", sp.backward, (*saved, *cts))]


def best_times(gms, args, repeat: int) -> list[float]:
    """Fastest call of each module, in seconds, their calls interleaved: on a busy machine the
    minimum is what the code costs, the rest is other processes (as ``timeit`` advises)."""
    times: list[list[float]] = [[] for _ in gms]
    for gm in gms:
        gm(*args)
    for r in range(repeat):
        order = list(zip(gms, times))
        for gm, ts in order if r % 2 else order[::-1]:  # neither always runs first
            start = time.perf_counter()
            gm(*args)
            ts.append(time.perf_counter() - start)
    return [min(ts) for ts in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=30)
    opts = parser.parse_args()
    print("lines of the function body (GPT example, one block)")
    total_folded = total_flat = 0
    for name, gm, _ in modules():
        folded, flat = body_lines(gm.code), body_lines(fold.flat_code(gm))
        total_folded, total_flat = total_folded + folded, total_flat + flat
        print(f"  {name:15s} flat {flat:4d}  folded {folded:4d}  ({folded / flat:.2f}x)")
    print(f"  {'together':15s} flat {total_flat:4d}  folded {total_folded:4d}  ({total_folded / total_flat:.2f}x)")
    print(f"\nfastest of {opts.repeat} calls (width {opts.width}, {opts.seq} tokens, float32, CPU)")
    torch.manual_seed(0)
    for name, gm, args in modules(n_embd=opts.width, seq_len=opts.seq, block_size=opts.seq):
        flat_gm = copy.deepcopy(gm)
        with fold.flat():
            flat_gm.recompile()
        assert flat_gm.code != gm.code
        folded, flat = best_times([gm, flat_gm], args, opts.repeat)
        print(f"  {name:15s} flat {flat * 1e3:7.2f} ms  folded {folded * 1e3:7.2f} ms  ({folded / flat:.3f}x)")


if __name__ == "__main__":
    main()
