"""Build time alone: ``fxtools.split`` (readable) against ``aot_function``, in one process.

``python benchmarks/bench_build.py [--reps 5] [--layers 12]`` (``taskset -c 1`` in front on a shared
machine): the GPT-2-sized model of ``bench_issue33.py`` (width 768, 12 heads, vocabulary 50257, 1 x 64
tokens, one thread), one warm-up build of each, then ``--reps`` alternating builds; prints the CPU
seconds of each (``bench_issue33.py``'s measures: ``aot_function``'s first forward+backward call less a
steady one) and the ratio of the medians. The quick check of issue 33's build goal (<= 0.4x); the
other numbers of the issue are ``bench_issue33.py``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_issue33 import _aot_build, _split_build  # noqa: E402

from fxtools.cli import examples  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="alternating builds of each")
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*boxed arguments.*")
    torch.set_num_threads(1)
    model, inputs = examples.gpt("gpt2", "sdpa", batch=1, seq_len=64, dtype=torch.float32, n_layer=args.layers)
    _split_build(model, inputs)  # first use loads the rules and PyTorch's decompositions
    _aot_build(model, inputs)
    split, aot = [], []
    for _ in range(args.reps):
        split.append(_split_build(model, inputs)[1])
        aot.append(_aot_build(model, inputs)[1])
    ms, ma = statistics.median(split), statistics.median(aot)
    print(f"split {ms:.3f} s, aot_function {ma:.3f} s (CPU, medians of {args.reps}): {ms / ma:.3f}x")
    print("split:", " ".join(f"{t:.3f}" for t in split))
    print("aot_function:", " ".join(f"{t:.3f}" for t in aot))


if __name__ == "__main__":
    main()
