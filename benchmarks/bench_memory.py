"""Peak memory of generated code: frees only where they matter (``fxtools.codegen.pycode``)
against torch.fx's default of freeing every value after its last use.

Run ``python benchmarks/bench_memory.py`` (``--quick``: a 2-layer GPT). The model is the ``gpt``
example at the size ``bench.py`` calls "GPT-2 124M" (12 layers, width 768, vocabulary 50257,
batch 1 x 64 tokens, float32); the module is its ``fxtools.grad`` (forward and backward in one
function). The same graph is run with the code fxtools writes and with fx's own code generator
(``;  x = None`` after every last use), and the peak of the bytes allocated by the CPU allocator
during the call is read from ``torch.profiler`` (``profile_memory=True``: every allocation and
free, summed in order). CPU tensors have no ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/src")  # this checkout's fxtools, when run as a script


def _peak_of_call(fn, args) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    # each op's own allocations and frees (children excluded), and those outside any op ("[memory]")
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def peak_bytes(gm: fx.GraphModule, args) -> tuple[int, int]:
    """(peak bytes of ``gm``'s own code, peak bytes of fx's free-everything code for the same graph)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # the same graph, printed by fx's own generator
    plain = fx.GraphModule(gm, graph)
    assert " = None" in plain.code
    gm.forward(*args)  # warm up (first calls allocate caches)
    plain.forward(*args)
    return _peak_of_call(gm.forward, args), _peak_of_call(plain.forward, args)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer GPT instead of GPT-2 124M")
    opts = parser.parse_args(argv)
    import fxtools
    from fxtools.cli.examples import as_loss, gpt

    torch.set_num_threads(1)
    overrides = {"n_layer": 2} if opts.quick else {}
    model, inputs = gpt("gpt2", batch=1, seq_len=64, **overrides)
    f, args = as_loss(model, inputs)
    gm = fxtools.grad(f, *args)
    readable, everything = peak_bytes(gm, args)
    lines = gm.code.count("\n")
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    n_fx = fx.GraphModule(gm, graph).code.count(" = None")
    n_del = sum(1 for line in gm.code.splitlines() if line.lstrip().startswith("del "))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"GPT-2 {'2-layer' if opts.quick else '124M'} grad, 1x64 tokens, float32, {platform.machine()}, torch {torch.__version__}, {when}"
    )
    print(f"code lines: {lines}; fx writes {n_fx} `= None` frees, fxtools {n_del} `del` lines")
    print(f"peak MB: fxtools {readable / 2**20:.2f}, fx free-everything {everything / 2**20:.2f} ({readable / everything:.4f}x)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
