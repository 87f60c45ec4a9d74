"""Build time alone: ``fxtools.split`` (readable) against ``aot_function``, in one process.

``python benchmarks/bench_build.py [--reps 5] [--layers 12]`` (``taskset -c 1`` in front on a shared
machine): the GPT-2-sized model of ``bench_issue33.py`` (width 768, 12 heads, vocabulary 50257, 1 x 64
tokens, one thread), one warm-up build of each, then ``--reps`` alternating builds; prints the CPU
seconds of each (``bench_issue33.py``'s measures: ``aot_function``'s first forward+backward call less a
steady one) and the ratio of the medians, and how much of each was Python's cyclic garbage collector
(CPU seconds inside collections during the whole measure, from ``gc.callbacks``; ``fxtools.split`` pauses the collector while it
builds and pays one deferred young-generation collection after, while ``aot_function``'s time moves by
0.1-0.5 s with the number of full collections that fall inside it). The quick check of issue 33's build
goal (<= 0.4x); the other numbers of the issue are ``bench_issue33.py``'s.

``--stages`` (no ``aot_function``): where a split build's time goes instead, as CPU milliseconds of
each stage of ``fxtools.split`` (medians of ``--reps`` builds) and the number of FakeTensor dispatches
each makes (PyTorch's fake execution of one op, about 0.2 ms even when its cache answers), so that a
change in build time shows with its stage and whether it is fxtools' code or more tracing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_issue33 import _aot_build, _split_build  # noqa: E402

from fxtools.cli import examples  # noqa: E402

# the stages of ``fxtools.split`` (names it calls in ``fxtools.training.partition``), in order
STAGES = ("front", "reverse", "simplify", "_Partition", "_forward_graph", "_backward_graph", "_described")


@contextlib.contextmanager
def _stage_clocks(times: dict, dispatches: collections.Counter):
    """Time each stage of ``fxtools.split`` and count the FakeTensor dispatches made in it while inside."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxtools.training import partition

    current = ["other"]
    originals = {name: getattr(partition, name) for name in STAGES}

    def timed(name, fn):
        def stage(*args, **kwargs):
            outer, current[0] = current[0], name
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] = times.get(name, 0.0) + time.process_time() - start
                current[0] = outer

        return stage

    dispatch = FakeTensorMode.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        dispatches[current[0]] += 1
        return dispatch(self, func, types, args, kwargs)

    for name, fn in originals.items():
        setattr(partition, name, timed(name, fn))
    FakeTensorMode.__torch_dispatch__ = counted
    try:
        yield
    finally:
        FakeTensorMode.__torch_dispatch__ = dispatch
        for name, fn in originals.items():
            setattr(partition, name, fn)


def stages(model, inputs, reps: int) -> None:
    """Print the CPU milliseconds and FakeTensor dispatches of each stage of a split build."""
    runs: dict = collections.defaultdict(list)
    dispatches: collections.Counter = collections.Counter()
    for _ in range(reps):
        times: dict = {}
        start = time.process_time()
        with _stage_clocks(times, dispatches):
            _split_build(model, inputs)
        times["total"] = time.process_time() - start
        for k, v in times.items():
            runs[k].append(v)
    print(f"| stage | CPU ms (median of {reps}) | FakeTensor dispatches per build |")
    print("|---|---:|---:|")
    for name in (*STAGES, "total"):
        count = sum(dispatches.values()) if name == "total" else dispatches[name]
        print(f"| {name} | {1000 * statistics.median(runs[name]):.1f} | {count // reps} |")


@contextlib.contextmanager
def _gc_clock(spent: list):
    """Append the CPU seconds spent in Python's garbage collections inside the block, and their count by generation."""
    state = {"start": 0.0, "total": 0.0, "runs": [0, 0, 0]}

    def clock(phase, info):
        if phase == "start":
            state["start"] = time.process_time()
        else:
            state["total"] += time.process_time() - state["start"]
            state["runs"][info["generation"]] += 1

    gc.callbacks.append(clock)
    try:
        yield
    finally:
        gc.callbacks.remove(clock)
        spent.append((state["total"], tuple(state["runs"])))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="alternating builds of each")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--stages", action="store_true", help="each stage of a split build instead (no aot_function)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*boxed arguments.*")
    torch.set_num_threads(1)
    model, inputs = examples.gpt("gpt2", "sdpa", batch=1, seq_len=64, dtype=torch.float32, n_layer=args.layers)
    _split_build(model, inputs)  # first use loads the rules and PyTorch's decompositions
    if args.stages:
        stages(model, inputs, args.reps)
        return
    _aot_build(model, inputs)
    split, aot, split_gc, aot_gc = [], [], [], []
    for _ in range(args.reps):
        with _gc_clock(split_gc):
            split.append(_split_build(model, inputs)[1])
        with _gc_clock(aot_gc):
            aot.append(_aot_build(model, inputs)[1])
    ms, ma = statistics.median(split), statistics.median(aot)
    print(f"split {ms:.3f} s, aot_function {ma:.3f} s (CPU, medians of {args.reps}): {ms / ma:.3f}x")
    for name, times, spent in (("split", split, split_gc), ("aot_function", aot, aot_gc)):
        collections_ = " ".join(f"{t:.3f} (gc {g:.3f}, {r[2]} full)" for t, (g, r) in zip(times, spent))
        print(f"{name}: {collections_}")


if __name__ == "__main__":
    main()
