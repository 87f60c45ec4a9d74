"""fxtools against PyTorch: transform time, run time, saved memory and graph size.

Run with ``fxtools bench`` (or ``python benchmarks/bench.py``); ``--quick`` for a short smoke
run. Everything is measured in this one process, on the CPU, with torch's current number of
threads. For each model (MLP, SmallCNN, a tiny GPT, a GPT-2-sized GPT):

- transform time: ``fxtools.grad`` (capture + differentiate + simplify + render) against
  ``aot_function`` (AOTAutograd with a no-op compiler: tracing the joint graph and partitioning
  it into forward and backward, measured as the first forward+backward call minus one steady-state
  forward+backward) and against ``make_fx`` of ``torch.func.grad`` (one joint graph, no partition);
- forward+backward time of the generated code against eager autograd (``torch.autograd.grad``);
- saved activations (bytes kept from the forward for the backward, parameters and inputs not
  counted): eager autograd through ``torch.autograd.graph.saved_tensors_hooks``, AOTAutograd
  from its forward graph's outputs, fxtools from its graph (forward values that the backward reads);
- graph size: compute nodes of fxtools' backward (the nodes that do not compute the loss) against
  AOTAutograd's backward graph, and of the whole graph against ``make_fx``'s joint.

Then the transform time of a GPT as the number of layers grows (1 to 24) goes to
``benchmarks/scaling.png`` (needs matplotlib; skipped without it). Results are printed and
written to ``benchmarks/results.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import operator
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.fx as fx

import fxtools
from fxtools.cli import examples
from fxtools.graph.nodes import count_compute_nodes
from fxtools.transforms.reverse import ancestors

HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_time(fn, reps, warmup=0, collect=True):
    """Median wall time of ``fn()``; ``collect`` runs the garbage collector (untimed) before each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if collect:
            gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_median_times(fa, fb, reps, warmup=2):
    """Median times of ``fa()`` and ``fb()`` called alternately (fairer when other load comes and goes)."""
    return interleaved_median_times([fa, fb], reps, warmup)


def interleaved_median_times(fns, reps, warmup=2):
    """Median time of each function, the functions called in turn ``reps`` times."""
    for _ in range(warmup):
        for f in fns:
            f()
    times = [[] for _ in fns]
    for _ in range(reps):
        for f, acc in zip(fns, times):
            gc.collect()
            start = time.perf_counter()
            f()
            acc.append(time.perf_counter() - start)
    return tuple(statistics.median(t) for t in times)


def markdown_header(titles) -> str:
    """The title row and rule line of a Markdown table of results."""
    titles = list(titles)
    return "| " + " | ".join(titles) + " |\n" + "|---" * len(titles) + "|"


def nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# ---------------------------------------------------------------------------------------------
# The three transforms
# ---------------------------------------------------------------------------------------------


def fxtools_transform(loss_fn, args, rules="readable"):
    with fxtools.rule_set(rules):
        return fxtools.grad(loss_fn, *args)


def with_buffers(loss_fn, args):
    """``(f, (params, buffers, *inputs))``: the model's buffers as an argument too.

    AOTAutograd and make_fx functionalize the program and refuse in-place updates of tensors they
    did not receive as inputs (BatchNorm's running statistics), so they get the buffers explicitly.
    """
    model = loss_fn.__fxtools_module__
    buffers = dict(model.named_buffers())

    def f(params, buffers, *inputs):
        return torch.func.functional_call(model, {**params, **buffers}, inputs)

    return f, (args[0], buffers, *args[1:])


def aot_transform(loss_fn, args):
    """aot_function with no-op compilers, run once forward and backward; returns (fw, bw) graphs."""
    from torch._functorch.aot_autograd import aot_function

    loss_fn, args = with_buffers(loss_fn, args)

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm

        return compiler

    fn = aot_function(loss_fn, fw_compiler=keep("fw"), bw_compiler=keep("bw"))
    params = {k: v.detach().requires_grad_(True) for k, v in args[0].items()}
    loss = fn(params, *args[1:])
    torch.autograd.grad(loss, list(params.values()))
    return graphs["fw"], graphs["bw"]


def make_fx_transform(loss_fn, args):
    from torch.fx.experimental.proxy_tensor import make_fx

    loss_fn, args = with_buffers(loss_fn, args)
    return make_fx(torch.func.grad(loss_fn))(*args)


def eager_fw_bw(loss_fn, args):
    params = {k: v.detach().requires_grad_(True) for k, v in args[0].items()}
    loss = loss_fn(params, *args[1:])
    return torch.autograd.grad(loss, list(params.values()))


# ---------------------------------------------------------------------------------------------
# Graph statistics
# ---------------------------------------------------------------------------------------------

_VIEWS = {
    "view",
    "expand",
    "transpose",
    "t",
    "permute",
    "reshape",
    "unsqueeze",
    "squeeze",
    "contiguous",
    "view_as",
    "expand_as",
    "flatten",
    "unflatten",
    "detach",
    "alias",
    "_unsafe_view",
    "split",
}


def _name(node):
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t)).split(".")[0]


def _inputs_and_their_views(gm: fx.GraphModule) -> set:
    """Placeholders, constants, and the getters and views of those (memory of the inputs)."""
    inputs = set()
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr") or (
            n.all_input_nodes
            and all(a in inputs for a in n.all_input_nodes)
            and (n.target is operator.getitem or n.target is getattr or _name(n) in _VIEWS)
        ):
            inputs.add(n)
    return inputs


def fxtools_split_stats(gm: fx.GraphModule):
    """(forward compute nodes, backward compute nodes, saved bytes) of a value_and_grad graph.

    The forward is every node the returned loss depends on; the backward is the rest. Saved
    values are forward values read by backward nodes, leaving out parameters, inputs, constants
    and views of those.
    """
    out = next(n for n in gm.graph.nodes if n.op == "output")
    forward = ancestors([out.args[0][0]])
    inputs = _inputs_and_their_views(gm)
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n.target is not operator.getitem]
    n_fw = sum(1 for n in compute if n in forward)
    saved = set()
    for n in gm.graph.nodes:
        if n not in forward and n.op != "output":
            saved.update(a for a in n.all_input_nodes if a in forward and a not in inputs)
    saved_bytes = 0
    for n in saved:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        saved_bytes += sum(nbytes(v) for v in vals)
    return n_fw, len(compute) - n_fw, saved_bytes


def aot_stats(fw: fx.GraphModule, bw: fx.GraphModule, n_user_outputs=1):
    def compute(g):
        return sum(1 for n in g.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)

    out = next(n for n in fw.graph.nodes if n.op == "output")
    primals = _inputs_and_their_views(fw)  # a transposed weight is a view: it costs no memory
    saved = {a for a in out.args[0][n_user_outputs:] if isinstance(a, fx.Node) and a not in primals}
    saved_bytes = sum(nbytes(a.meta.get("val")) for a in saved)
    return compute(fw), compute(bw), saved_bytes


def make_fx_nodes(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)


def eager_saved_bytes(loss_fn, args):
    """Bytes autograd keeps for the backward of ``loss_fn(*args)``, without parameters and inputs."""
    params = {k: v.detach().requires_grad_(True) for k, v in args[0].items()}
    skip = {t.untyped_storage().data_ptr() for t in params.values()}
    skip |= {t.untyped_storage().data_ptr() for t in args[1:] if isinstance(t, torch.Tensor)}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(params, *args[1:])
    del loss
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def models(quick: bool):
    yield "MLP (8-16-4, batch 6)", lambda: examples.mlp()
    yield "SmallCNN (4x3x8x8)", lambda: examples.small_cnn()
    yield "GPT tiny (2 layers, width 16, 2x8 tokens)", lambda: examples.gpt("tiny")
    if quick:
        yield (
            "GPT 4 layers, width 128 (1x32 tokens)",
            lambda: examples.gpt("gpt2", batch=1, seq_len=32, n_layer=4, n_embd=128, n_head=4, vocab_size=1024),
        )
    else:
        yield "GPT-2 124M (12 layers, width 768, 1x64 tokens)", lambda: examples.gpt("gpt2", batch=1, seq_len=64)


def bench_model(name, build, reps, run_reps):
    log(f"{name}: building")
    model, inputs = build()
    loss_fn, args = examples.as_loss(model, inputs)
    row = {"model": name, "params": sum(p.numel() for p in args[0].values())}
    # Separate copies so that BatchNorm's running statistics of one method do not affect another.
    copies = {k: examples.as_loss(copy.deepcopy(model), inputs) for k in ("fx", "fused", "aot", "mfx", "eager")}

    log(f"{name}: fxtools.grad x{reps}")
    gms = []
    row["fxtools_s"] = median_time(lambda: gms.append(fxtools_transform(*copies["fx"])), reps)
    del gms
    gm = fxtools.value_and_grad(copies["fx"][0], *copies["fx"][1])  # the same pipeline; its output names the loss (statistics)
    log(f"{name}: fxtools.grad with the fused rule set x{reps}")
    gms = []
    row["fused_s"] = median_time(lambda: gms.append(fxtools_transform(*copies["fused"], rules="fused")), reps)
    del gms
    with fxtools.rule_set("fused"):
        gm_fused = fxtools.value_and_grad(copies["fused"][0], *copies["fused"][1])

    log(f"{name}: eager forward+backward")
    row["eager_run_s"] = median_time(lambda: eager_fw_bw(*copies["eager"]), run_reps, warmup=2, collect=False)
    log(f"{name}: aot_function x{reps}")
    graphs = []
    first = median_time(lambda: graphs.append(aot_transform(*copies["aot"])), reps)
    row["aot_s"] = max(first - row["eager_run_s"], 0.0)
    fw, bw = graphs[-1]
    del graphs
    log(f"{name}: make_fx(torch.func.grad) x{reps}")
    joints = []
    try:
        row["make_fx_s"] = median_time(lambda: joints.append(make_fx_transform(*copies["mfx"])), reps)
        row["make_fx_nodes"] = make_fx_nodes(joints[-1])
    except Exception as exc:  # noqa: BLE001
        log(f"{name}: make_fx failed: {type(exc).__name__}: {exc}")
        row["make_fx_s"], row["make_fx_nodes"] = float("nan"), None
    del joints

    log(f"{name}: generated code forward+backward")
    fx_fn, fx_args = copies["fx"]
    fused_args = copies["fused"][1]
    row["fxtools_run_s"], row["fused_run_s"], row["eager_run_s"] = interleaved_median_times(
        [lambda: gm(*fx_args), lambda: gm_fused(*fused_args), lambda: eager_fw_bw(*copies["eager"])], run_reps
    )
    # correctness guard: the numbers are only worth reporting if the gradients agree
    want = eager_fw_bw(*examples.as_loss(copy.deepcopy(model), inputs))
    for key, g, a in (("max_grad_diff", gm, fx_args), ("fused_max_grad_diff", gm_fused, fused_args)):
        loss, grads = g(*a)
        row[key] = max((x - w).abs().max().item() for x, w in zip(grads.values(), want))

    n_fw, n_bw, saved = fxtools_split_stats(gm)
    row.update(fxtools_nodes=count_compute_nodes(gm), fxtools_fw_nodes=n_fw, fxtools_bw_nodes=n_bw, fxtools_saved=saved)
    n_fw, n_bw, saved = fxtools_split_stats(gm_fused)
    row.update(fused_nodes=count_compute_nodes(gm_fused), fused_fw_nodes=n_fw, fused_bw_nodes=n_bw, fused_saved=saved)
    a_fw, a_bw, a_saved = aot_stats(fw, bw)
    row.update(aot_fw_nodes=a_fw, aot_bw_nodes=a_bw, aot_saved=a_saved)
    row["eager_saved"] = eager_saved_bytes(*copies["eager"])
    log(f"{name}: fxtools {row['fxtools_s']:.3f} s, aot {row['aot_s']:.3f} s, make_fx {row['make_fx_s']:.3f} s")
    return row


def bench_scaling(layers, width, seq_len, vocab, reps=3):
    rows = []
    for n in layers:
        log(f"scaling: GPT with {n} layers, width {width}")
        model, inputs = examples.gpt(
            "gpt2", batch=1, seq_len=seq_len, n_layer=n, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab
        )
        loss_fn, args = examples.as_loss(model, inputs)
        t_fx = median_time(lambda: fxtools_transform(loss_fn, args), reps)
        t_run = median_time(lambda: eager_fw_bw(loss_fn, args), 3, warmup=1, collect=False)
        t_aot = max(median_time(lambda: aot_transform(loss_fn, args), reps) - t_run, 0.0)
        try:
            t_mfx = median_time(lambda: make_fx_transform(loss_fn, args), reps)
        except Exception:  # noqa: BLE001
            t_mfx = float("nan")
        rows.append({"layers": n, "fxtools_s": t_fx, "aot_s": t_aot, "make_fx_s": t_mfx})
        log(f"  fxtools {t_fx:.2f} s, aot {t_aot:.2f} s, make_fx {t_mfx:.2f} s")
        del model, inputs, loss_fn, args
        gc.collect()
    return rows


def plot(rows, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return None
    x = [r["layers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label in (
        ("fxtools_s", "fxtools.grad"),
        ("aot_s", "aot_function (nop compiler)"),
        ("make_fx_s", "make_fx(torch.func.grad)"),
    ):
        ax.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("transformer layers")
    ax.set_ylabel("transform time (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _mb(b):
    return f"{b / 2**20:.2f} MB" if b >= 2**20 else f"{b / 1024:.1f} kB"


def _ratio(a, b):
    return f"{a / b:.2f}x" if b else "-"


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def tables(rows, scaling, scaling_note):
    out = [
        "### Transform time (median; lower is better)",
        "",
        "| model | params | fxtools | fxtools fused | aot_function | make_fx(grad) | fxtools / aot | fxtools / make_fx |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['params']:,} | {r['fxtools_s']:.3f} s | {r['fused_s']:.3f} s | {r['aot_s']:.3f} s | "
            f"{r['make_fx_s']:.3f} s | {_ratio(r['fxtools_s'], r['aot_s'])} | "
            f"{_ratio(r['fxtools_s'], r['make_fx_s'])} |"
        )
    out += [
        "",
        "### Forward + backward run time (median; readable rules, fused rule set, eager)",
        "",
        "| model | readable | fused | eager autograd | readable / eager | fused / eager | max abs grad difference (readable, fused) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['fxtools_run_s'] * 1e3:.2f} ms | {r['fused_run_s'] * 1e3:.2f} ms | "
            f"{r['eager_run_s'] * 1e3:.2f} ms | {_ratio(r['fxtools_run_s'], r['eager_run_s'])} | "
            f"{_ratio(r['fused_run_s'], r['eager_run_s'])} | {r['max_grad_diff']:.2g}, {r['fused_max_grad_diff']:.2g} |"
        )
    out += [
        "",
        "### Saved activations (kept from forward for backward; parameters and inputs not counted)",
        "",
        "| model | fxtools | fxtools fused | AOTAutograd | eager autograd | fxtools / eager | fused / eager |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {_mb(r['fxtools_saved'])} | {_mb(r['fused_saved'])} | {_mb(r['aot_saved'])} | "
            f"{_mb(r['eager_saved'])} | {_ratio(r['fxtools_saved'], r['eager_saved'])} | "
            f"{_ratio(r['fused_saved'], r['eager_saved'])} |"
        )
    out += [
        "",
        "### Graph size (compute nodes)",
        "",
        "| model | fxtools fw / bw / total | fused fw / bw / total | AOTAutograd fw / bw | make_fx joint | "
        "fxtools bw / aot bw | fused bw / aot bw |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['fxtools_fw_nodes']} / {r['fxtools_bw_nodes']} / {r['fxtools_nodes']} | "
            f"{r['fused_fw_nodes']} / {r['fused_bw_nodes']} / {r['fused_nodes']} | "
            f"{r['aot_fw_nodes']} / {r['aot_bw_nodes']} | {r['make_fx_nodes']} | "
            f"{_ratio(r['fxtools_bw_nodes'], r['aot_bw_nodes'])} | {_ratio(r['fused_bw_nodes'], r['aot_bw_nodes'])} |"
        )
    if scaling:
        out += [
            "",
            f"### Transform time against depth ({scaling_note})",
            "",
            "| layers | fxtools | aot_function | make_fx(grad) | fxtools / aot |",
            "|---:|---:|---:|---:|---:|",
        ]
        for r in scaling:
            out.append(
                f"| {r['layers']} | {r['fxtools_s']:.2f} s | {r['aot_s']:.2f} s | {r['make_fx_s']:.2f} s | "
                f"{_ratio(r['fxtools_s'], r['aot_s'])} |"
            )
    return "\n".join(out)


NOTES = """\
How it is measured (benchmarks/bench.py, one process, CPU):

- *fxtools*: `fxtools.grad(loss, params, *inputs)`: capture, functionalize, differentiate, simplify and
  render, on FakeTensors, with the readable rules (the default); *fused*: the same inside
  `fxtools.rule_set("fused")` (backwards call PyTorch's fused backward kernels, as `fxtools.compile` does). Run times, saved bytes and node counts use `fxtools.value_and_grad` (the same
  pipeline; its output tells the loss apart, which separates forward from backward nodes).
- *aot_function*: `torch._functorch.aot_autograd.aot_function` with compilers that return the graph
  unchanged, timed over its first forward+backward call (tracing the joint graph, partitioning it)
  minus the median eager forward+backward time (its first call also runs the model once).
- *make_fx(grad)*: `make_fx(torch.func.grad(loss))(params, *inputs)`, one joint graph of ATen ops, not
  simplified or partitioned.
- Run times: the generated GraphModule against `torch.autograd.grad` of the eager model, both with
  the same torch threads, medians after two warm-up calls.
- Saved activations: eager via `torch.autograd.graph.saved_tensors_hooks` (unique storages); AOTAutograd
  from the extra outputs of its forward graph; fxtools from its single graph (values on the loss's
  dependency path that backward nodes read), an estimate from shapes that counts each such value once.
- Compute nodes: calls other than `getitem`; fxtools' "backward" is every node the loss does not depend on.
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fxtools bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small models only, no GPT-2, short scaling sweep")
    p.add_argument("--reps", type=int, default=None, help="repetitions of each transform (default 5, GPT-2: 3)")
    p.add_argument("--layers", default=None, help="layer counts of the scaling sweep (default 1,2,4,8,12,16,24)")
    p.add_argument("--width", type=int, default=768, help="width of the GPTs in the scaling sweep (default 768)")
    p.add_argument("--no-scaling", action="store_true", help="skip the scaling sweep")
    p.add_argument("--out", default=os.path.join(HERE, "results.md"), help="where to write the markdown report")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for everything (default: torch's current setting); on a loaded machine "
        "1 avoids OpenMP threads waiting for each other",
    )
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd")
    if a.threads:
        torch.set_num_threads(a.threads)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    load_before = os.getloadavg()

    start = time.perf_counter()
    log(f"machine: {machine()}")
    log("warming up (first calls import and register)")
    warm_fn, warm_args = examples.as_loss(*examples.mlp())
    fxtools_transform(warm_fn, warm_args)
    aot_transform(warm_fn, warm_args)
    make_fx_transform(warm_fn, warm_args)

    rows = []
    for name, build in models(a.quick):
        big = "GPT-2" in name
        reps = a.reps or (3 if big else 5)
        rows.append(bench_model(name, build, reps, run_reps=10 if big else 30))
        gc.collect()

    scaling, note, png = [], "", None
    if not a.no_scaling:
        layers = [int(s) for s in (a.layers or ("1,2,4" if a.quick else "1,2,4,8,12,16,24")).split(",")]
        width = 128 if a.quick and a.width == 768 else a.width
        vocab = 1024 if a.quick else 50257
        reps = 1 if a.quick else 3
        note = f"GPT, width {width}, {max(1, width // 64)} heads, vocabulary {vocab}, 1x64 tokens, median of {reps}"
        scaling = bench_scaling(layers, width, 64, vocab, reps)
        png = plot(
            scaling, os.path.join(os.path.dirname(a.out), "scaling.png"), f"Transform time of a GPT (width {width}) by depth"
        )

    table = tables(rows, scaling, note)
    total = time.perf_counter() - start
    load_after = os.getloadavg()
    header = (
        f"# fxtools benchmarks\n\n{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} {time.strftime('%Z')}; "
        f"{machine()}.\nTotal benchmark time {total / 60:.1f} min{' (--quick)' if a.quick else ''}; "
        f"1-minute load average {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end "
        "(other processes shared the CPUs: absolute times are noisy, ratios less so).\n"
        f"Command: `fxtools bench {' '.join(argv if argv is not None else sys.argv[1:])}`"
        + (
            " (one thread: with more threads than free cores, OpenMP threads wait for each other and "
            "small ops slow down by orders of magnitude)"
            if a.threads == 1
            else ""
        )
        + ".\n"
    )
    text = (
        header + "\n" + table + "\n" + (f"\n![transform time by depth]({os.path.basename(png)})\n" if png else "") + "\n" + NOTES
    )
    print(table)
    with open(a.out, "w") as fh:
        fh.write(text)
    log(f"wrote {a.out}" + (f" and {png}" if png else "") + f" in {total / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
