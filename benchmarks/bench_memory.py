"""Peak memory of generated code: frees only where they matter (``fxtools.codegen.pycode``)
against torch.fx's default of freeing every value after its last use.

Run ``python benchmarks/bench_memory.py`` (``--quick``: a 2-layer GPT).

``--budgets`` measures memory budgets instead, on a GPT (``--config small``: 2 layers, width 128,
4 heads, vocabulary 512, 4 x 64 tokens; ``--config gpt2``: GPT-2's shape, width 768, 12 heads,
vocabulary 50257, with 4 layers and 1 x 128 tokens; float32): eager PyTorch; ``torch.compile``
(backend ``aot_eager_decomp_partition``, and Inductor with ``--inductor``) with
``torch._functorch.config.activation_memory_budget`` at 1.0, 0.5, 0.2 and 0.05; ``fxtools.compile``
with ``policy=fxtools.policies.budget(b)`` at the same budgets, without a compiler and with
Inductor (``compiler="inductor"``); and ``budget(peak=)`` at ``torch.compile``'s measured peaks.
Every run is measured the same way, as a training step (``loss.backward()``): the bytes saved for
the backward beyond parameters and inputs (what ``torch.autograd.graph.saved_tensors_hooks`` sees,
each storage once), the measured peak of one step (``fxtools.training.budget.allocated_peak``: the
profiler's CPU allocations and frees in time order, plus the parameters and inputs), fxtools'
predicted peak, and the median step time (CPU time of the process, one thread); ratios are against eager and against ``torch.compile``
with the same compiler at the same budget, all measured in the same run. ``--svg`` draws
fxtools' frontier.

Without ``--budgets``, the model is the ``gpt`` example at the size ``bench.py`` calls "GPT-2 124M" (12 layers, width 768, vocabulary 50257,
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

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/src")  # this checkout's fxtools, when run as a script


def _peak_of_call(fn, args) -> int:
    from fxtools.training.budget import allocated_peak

    return allocated_peak(lambda: fn(*args))


def peak_bytes(gm: fx.GraphModule, args) -> tuple[int, int]:
    """(peak bytes of ``gm``'s own code, peak bytes of fx's free-everything code for the same graph)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # the same graph, printed by fx's own generator
    plain = fx.GraphModule(gm, graph)
    assert " = None" in plain.code
    gm.forward(*args)  # warm up (first calls allocate caches)
    plain.forward(*args)
    return _peak_of_call(gm.forward, args), _peak_of_call(plain.forward, args)


# --------------------------------------------------------------------------------------------
# memory budgets
# --------------------------------------------------------------------------------------------

BUDGETS = (1.0, 0.5, 0.2, 0.05)


def _storage_bytes(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _autograd_step(model, inputs):
    """Forward + backward under autograd; returns the bytes the saved-tensor hooks saw beyond the parameters and inputs."""
    owned = _storage_bytes([*model.parameters(), *inputs])
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in owned:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)
    loss.backward()
    return sum(seen.values())


def _median_time(fn, reps) -> float:
    """Median CPU time of ``fn()`` in this process (``time.process_time``: on a machine shared with
    other jobs, wall time mostly measures their load; with one thread this is the step's compute)."""
    import time

    times = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return sorted(times)[len(times) // 2]


def _clear_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def _measure_autograd(model, inputs, reps):
    base = sum(_storage_bytes([*model.parameters(), *inputs]).values())
    saved = _autograd_step(model, inputs)  # also warms up (compiles)
    _clear_grads(model)  # freed before the profile: the gradients are allocated during the step
    from fxtools.training.budget import allocated_peak

    peak = base + allocated_peak(lambda: _autograd_step(model, inputs))

    def step():
        _clear_grads(model)
        _autograd_step(model, inputs)

    return saved, peak, _median_time(step, reps)


def _measure_fxtools(model, inputs, policy, reps, compiler=None, svg=None):
    """``fxtools.compile(model, policy=policy, compiler=compiler)`` (the training path: fused rules)
    measured as autograd steps are; returns the split too (its saved bytes and predicted peak),
    and the compiled module."""
    import fxtools

    compiled = fxtools.compile(model, *inputs, policy=policy, compiler=compiler)
    sp = compiled.split
    if svg:
        sp.frontier([k / 40 for k in range(1, 41)], path=svg)
    return sp, _measure_autograd(compiled, inputs, reps), compiled


CONFIGS = {
    "small": (
        "small GPT (2 layers, width 128, 4 heads, vocabulary 512, 4x64 tokens, float32)",
        dict(batch=4, seq_len=64, n_layer=2, n_head=4, n_embd=128, vocab_size=512, block_size=64),
    ),
    "gpt2": (
        "GPT-2-shaped GPT (4 layers, width 768, 12 heads, vocabulary 50257, 1x128 tokens, float32)",
        dict(batch=1, seq_len=128, n_layer=4, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    ),
}


def _alternating(steps, reps) -> list[float]:
    """Median CPU time of each of ``steps`` over ``reps`` rounds, one step of each per round in
    turn: on a shared machine the compared variants see the same load."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(reps):
        for k, step in enumerate(steps):
            times[k].append(_median_time(step, 1))
    return [sorted(t)[len(t) // 2] for t in times]


def _step_of(model, inputs):
    def step():
        _clear_grads(model)
        _autograd_step(model, inputs)

    return step


def _budget_rows(model, inputs, opts) -> list[dict]:
    """One row per run: eager, torch.compile and fxtools at every budget (per compiler), and
    fxtools' peak form at torch.compile's peaks. At each budget the ``torch.compile`` and fxtools
    steps are timed alternately (``_alternating``)."""
    import torch._functorch.config as functorch_config

    import fxtools

    reps, rows = opts.reps, []

    def add(run, compiler, b, measured, sp=None):
        saved, peak, t = measured
        predicted = None if sp is None else sp.predicted_peak
        rows.append(dict(run=run, compiler=compiler, budget=b, saved=saved, peak=peak, time=t, predicted=predicted))

    add("eager", "-", "-", _measure_autograd(model, inputs, reps))
    compilers = [] if opts.inductor_only else [("aot_eager_decomp_partition", None)]
    compilers += [("inductor", "inductor")] if opts.inductor or opts.inductor_only else []
    for backend, compiler in compilers:
        pairs = []
        for b in BUDGETS:
            torch._dynamo.reset()
            with functorch_config.patch(activation_memory_budget=b):
                compiled = torch.compile(model, backend=backend)
                ref = _measure_autograd(compiled, inputs, 1)
                svg = opts.svg if b == 1.0 and compiler is None else None
                sp, ours, ours_module = _measure_fxtools(model, inputs, fxtools.policies.budget(b), 1, compiler, svg)
                t_ref, t_ours = _alternating([_step_of(compiled, inputs), _step_of(ours_module, inputs)], reps)
            pairs.append((b, (ref[0], ref[1], t_ref), sp, (ours[0], ours[1], t_ours)))
        torch._dynamo.reset()
        for b, ref, _, _ in pairs:
            add("torch.compile", backend, b, ref)
        for b, _, sp, ours in pairs:
            add("fxtools budget(b)", backend, b, ours, sp)
    if opts.inductor_only:
        return rows
    from fxtools.training import budget

    first = fxtools.compile(model, *inputs, policy=fxtools.policies.budget(1.0)).split
    least = min(peak for _, peak in budget.Problem(first._partition).peak_candidates())
    for r in [r for r in rows if r["run"] == "torch.compile" and r["compiler"] == "aot_eager_decomp_partition"]:
        target, run = r["peak"], f"fxtools budget(peak=torch.compile {r['budget']}'s)"
        if target < least:
            target, run = least, f"fxtools budget(peak=least), for torch.compile {r['budget']}"
        sp, measured, _ = _measure_fxtools(model, inputs, fxtools.policies.budget(peak=target), reps)
        add(run, "aot_eager_decomp_partition", f"{target / 1e6:.2f} MB", measured, sp)
    return rows


def _ratio(a, b) -> str:
    return "-" if b is None or not b else f"{a / b:.2f}x"


def budgets_table(opts) -> str:
    """The memory-budget table (Markdown) for ``opts.config``."""
    from fxtools.cli.examples import gpt

    torch.set_num_threads(1)
    title, config = CONFIGS[opts.config]
    model, inputs = gpt("gpt2", **config)
    rows = _budget_rows(model, inputs, opts)
    eager = rows[0]
    reference = {(r["compiler"], r["budget"]): r for r in rows if r["run"] == "torch.compile"}
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"{title}, {platform.machine()}, {platform.processor() or '?'}, 1 thread, torch {torch.__version__}, {when}, "
        f"median CPU time of {opts.reps} steps",
        "",
        "| run | compiler | budget | saved MB | saved / eager | saved / torch.compile | predicted peak MB "
        "| measured peak MB | peak / torch.compile | step ms | step / eager | step / torch.compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = reference.get((r["compiler"], r["budget"])) if r["run"].startswith("fxtools") else None
        ref = ref or {}
        pred = "-" if r["predicted"] is None else f"{r['predicted'] / 1e6:.2f}"
        lines.append(
            f"| {r['run']} | {r['compiler']} | {r['budget']} | {r['saved'] / 1e6:.2f} | {_ratio(r['saved'], eager['saved'])} "
            f"| {_ratio(r['saved'], ref.get('saved'))} | {pred} | {r['peak'] / 1e6:.2f} | {_ratio(r['peak'], ref.get('peak'))} "
            f"| {r['time'] * 1e3:.1f} | {_ratio(r['time'], eager['time'])} | {_ratio(r['time'], ref.get('time'))} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer GPT instead of GPT-2 124M")
    parser.add_argument("--budgets", action="store_true", help="the memory-budget table instead")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="with --budgets: the model")
    parser.add_argument("--inductor", action="store_true", help="with --budgets: torch.compile with Inductor too")
    parser.add_argument("--inductor-only", action="store_true", help="with --budgets: Inductor only (no aot_eager rows)")
    parser.add_argument("--reps", type=int, default=20, help="with --budgets: steps timed per row")
    parser.add_argument("--svg", default=None, help="with --budgets: draw fxtools' frontier to this path")
    opts = parser.parse_args(argv)
    if opts.budgets:
        print(budgets_table(opts))
        return
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
