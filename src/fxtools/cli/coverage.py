"""Which mechanism differentiates each op PyTorch's OpInfo samples call.

For every OpInfo of PyTorch's ``op_db`` that supports autograd and float64 on the CPU (or, with
``dtype=torch.complex128``, whose backward supports complex128 on the CPU), the first samples are
captured (and functionalised) as fxtools captures user code; each ATen overload the
captures contain is classified by how fxtools differentiates it:

- ``hand-written``: a rule in ``fxtools.rules`` (or registered by the user);
- ``non-differentiable``: declared to carry no gradient (``detach``, comparisons, ``floor``);
- ``decomposed``: expanded into other ops by a PyTorch decomposition;
- ``derived``: given a rule traced from PyTorch's own derivative formula;
- ``failing``: none of these (fxtools raises if a gradient flows through it).

``op_db`` lives in ``torch.testing._internal`` and needs ``expecttest``; both are imported only
when a report is made. Run it as ``fxtools ops``.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..graph import meta

CATEGORIES = ("hand-written", "non-differentiable", "decomposed", "derived", "failing")


@dataclass
class Coverage:
    """op name -> category, and op name -> the OpInfos whose samples call it."""

    category: dict[str, str] = field(default_factory=dict)
    seen_in: dict[str, set[str]] = field(default_factory=dict)
    uncaptured: dict[str, str] = field(default_factory=dict)  # OpInfo -> why no sample was captured

    def counts(self) -> dict[str, int]:
        return {c: sum(1 for v in self.category.values() if v == c) for c in CATEGORIES}

    def table(self) -> str:
        width = max([len(op) for op in self.category] + [2])
        lines = [f"{'op'.ljust(width)}  {'mechanism':<18}  OpInfos"]
        for op in sorted(self.category, key=lambda o: (CATEGORIES.index(self.category[o]), o)):
            users = sorted(self.seen_in.get(op, ()))
            shown = ", ".join(users[:3]) + (f", ... ({len(users)})" if len(users) > 3 else "")
            lines.append(f"{op.ljust(width)}  {self.category[op]:<18}  {shown}")
        return "\n".join(lines)

    def summary(self) -> str:
        counts = self.counts()
        total = sum(counts.values())
        parts = ", ".join(f"{c} {n}" for c, n in counts.items())
        return f"{total} ATen overloads: {parts}"


def _op_db(dtype=torch.float64):
    try:
        import expecttest  # noqa: F401 - op_db's module imports it
    except ImportError as exc:
        raise SystemExit(
            "the coverage report uses PyTorch's OpInfo database, which needs expecttest: pip install expecttest"
        ) from exc
    from torch.testing._internal.common_methods_invocations import op_db

    if dtype.is_complex:
        return [op for op in op_db if op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")]
    return [op for op in op_db if op.supports_autograd and dtype in op.supported_dtypes("cpu")]


def opinfo_id(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def opinfo_samples(opinfo, n, dtype=torch.float64):
    """The first n CPU samples of an OpInfo in ``dtype`` (float64 or complex128), generated from a
    fixed seed.

    The sample generator runs under ``no_grad``: it is closed at once, or its ``no_grad`` exit
    would run whenever it is garbage-collected, possibly in the middle of a later trace.
    """
    torch.manual_seed(0)
    gen = iter(opinfo.sample_inputs_func(opinfo, "cpu", dtype, True))
    try:
        return list(itertools.islice(gen, n))
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()


def sample_function(opinfo, sample):
    """(f, args): f takes the sample's tensor leaves (detached), in order, and calls the op.

    The sample's ``output_process_fn_grad`` is applied, as in PyTorch's own gradient tests: it
    makes the differentiated function well defined (``linalg.eig``'s eigenvectors are only
    defined up to a phase, so the sample differentiates a phase-invariant function of them).
    """
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    process = getattr(sample, "output_process_fn_grad", None) or (lambda out: out)

    def f(*tensors):
        full = list(leaves)
        for i, t in zip(tensor_pos, tensors):
            full[i] = t
        inp, args, kwargs = pytree.tree_unflatten(full, spec)
        return process(opinfo.op(inp, *args, **kwargs))

    return f, tuple(leaves[i].detach().clone() for i in tensor_pos)


def _classify_graph(gm, category: dict) -> list[str]:
    """Classify the ops of one captured, functionalised graph; returns their names."""
    from .. import registry
    from ..capture.decompose import expand

    ops = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            ops.setdefault(str(node.target), []).append(node)
    todo = {}
    for name, nodes in ops.items():
        op = nodes[0].target
        rule = registry.lookup_node(nodes[0])
        if rule is not None:
            category.setdefault(name, "hand-written" if rule.source != "derived" else "derived")
        elif registry.is_nondifferentiable(op):
            category.setdefault(name, "non-differentiable")
        elif name not in category or category[name] == "failing":
            todo[name] = nodes
    if todo:
        try:
            expand(gm)
        except Exception:  # noqa: BLE001 - the expansion itself failed for this sample
            for name in todo:
                category.setdefault(name, "failing")
            return list(ops)
        alive = set(gm.graph.nodes)
        for name, nodes in todo.items():
            if any(n in alive and meta.RULE.on(n) for n in nodes):
                category[name] = "derived"
            elif all(n not in alive for n in nodes):
                category[name] = "decomposed"
            else:
                category.setdefault(name, "failing")
    return list(ops)


def compute(
    n_samples: int = 3, progress: Callable[[int, int, str], None] | None = None, dtype: torch.dtype = torch.float64
) -> Coverage:
    """Classify every op the OpInfo samples call in ``dtype`` (see the module docstring)."""
    from .. import rules  # noqa: F401 - registers fxtools' own rules
    from ..capture.functionalize import functionalize
    from ..capture.trace import capture, check_supported

    cov = Coverage()
    opinfos = _op_db(dtype)
    for i, opinfo in enumerate(opinfos):
        name = opinfo_id(opinfo)
        if progress is not None:
            progress(i, len(opinfos), name)
        try:
            samples = opinfo_samples(opinfo, n_samples, dtype)
        except Exception as exc:  # noqa: BLE001 - a sample generator that does not run here
            cov.uncaptured[name] = f"{type(exc).__name__}: {exc}"
            continue
        for sample in samples:
            f, args = sample_function(opinfo, sample)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cap = capture(f, args, record_stack_traces=False)
                    check_supported(cap.gm)
                    functionalize(cap.gm)
            except Exception as exc:  # noqa: BLE001 - reported, not classified
                cov.uncaptured.setdefault(name, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for op in _classify_graph(cap.gm, cov.category):
                    cov.seen_in.setdefault(op, set()).add(name)
    if progress is not None:
        progress(len(opinfos), len(opinfos), "")
    return cov


def _progress_printer(stream):
    def show(i, n, name):
        if not stream.isatty():
            if i == n or i % 50 == 0:
                print(f"[{i}/{n}] OpInfos", file=stream, flush=True)
            return
        line = f"[{i}/{n}] {name}" if i < n else f"[{n}/{n}] done"
        print("\r" + line[:78].ljust(78), end="" if i < n else "\n", file=stream, flush=True)

    return show


def main(argv=None) -> int:
    """``fxtools ops``: the coverage table and counts."""
    import argparse

    p = argparse.ArgumentParser(
        prog="fxtools ops",
        description="Capture the first samples of every differentiable OpInfo in PyTorch's op_db "
        "(float64 or complex128, CPU) and report, per ATen overload they call, how fxtools differentiates it: "
        "hand-written rule, declared non-differentiable, PyTorch decomposition, rule derived from "
        "PyTorch's autograd formula, or failing. Needs expecttest (pip install expecttest).",
    )
    p.add_argument("--samples", type=int, default=3, help="samples per OpInfo (default: 3)")
    p.add_argument(
        "--dtype",
        choices=("f64", "c128"),
        default="f64",
        help="sample dtype: float64 (default) or complex128 (OpInfos whose backward supports it)",
    )
    p.add_argument("--counts", action="store_true", help="print only the counts, not the table")
    p.add_argument("--quiet", action="store_true", help="no progress indication on stderr")
    a = p.parse_args(argv)
    dtype = torch.complex128 if a.dtype == "c128" else torch.float64
    cov = compute(a.samples, progress=None if a.quiet else _progress_printer(sys.stderr), dtype=dtype)
    if not a.counts:
        print(cov.table())
        if cov.uncaptured:
            print(f"\nOpInfos with samples fxtools cannot capture ({len(cov.uncaptured)}):")
            for name, why in sorted(cov.uncaptured.items()):
                print(f"  {name}: {why[:150]}")
        print()
    print(cov.summary())
    return 0
