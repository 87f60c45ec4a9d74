"""Double backward of random programs through ``fxtools.compile``, against eager autograd in float64.

Each program of ``tests/fuzz_programs.py`` is compiled (even indices without a compiler, odd ones
with a compiler function, so the ATen graphs run and the double backward must not differentiate
them) and called on inputs that require grad. With random weights ``w`` on its float outputs and
``v`` on its float inputs, the first-order gradients ``g = grad(sum(w * out), inputs,
create_graph=True)`` and then ``grad(sum(v * g) + sum(g ** 2), inputs)`` (second derivatives,
through the compiled module's backward) must equal eager autograd's at 1e-9; where eager
autograd raises, fxtools must raise too, never return a number.

``FXTOOLS_FUZZ_DOUBLE_N`` programs (default below); ``FXTOOLS_FUZZ_SEED`` and
``FXTOOLS_FUZZ_ONLY`` as in ``tests/test_fuzz.py``.
"""

import os
import traceback

import pytest
import torch
from test_fuzz import ONLY, SEED, close, float_leaves, program

import fxtools

N = int(os.environ.get("FXTOOLS_FUZZ_DOUBLE_N", "40"))
GROUP = 20

pytestmark = pytest.mark.usefixtures("float64")


def identity_compiler(gm, example_inputs):
    return gm


def second_order(fn, p, gen_seed):
    """``(first-order gradients, second-order gradients)`` of ``fn`` (the program or its
    compiled form) at the program's inputs, with weights drawn from ``gen_seed``."""
    gen = torch.Generator().manual_seed(gen_seed)
    args = [x.detach().clone().requires_grad_(k in p.float_args) for k, x in enumerate(p.args)]
    floats = [args[k] for k in p.float_args]
    outs = float_leaves(fn(*args))
    first = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    g = torch.autograd.grad(first, floats, create_graph=True, allow_unused=True, materialize_grads=True)
    v = [torch.randn(x.shape, generator=gen) for x in floats]
    second = sum((a * b).sum() + (a * a).sum() for a, b in zip(g, v))
    if not second.requires_grad:  # g is constant (a linear program): its derivative is zero
        return [t.detach() for t in g], [torch.zeros_like(x) for x in floats]
    h = torch.autograd.grad(second, floats, allow_unused=True, materialize_grads=True)
    return [t.detach() for t in g], list(h)


def compiled(p, i, **options):
    """``fxtools.compile(p.fn)``: with the identity compiler at odd ``i`` unless the ATen form
    refuses the program (a first-order matter, not this test's), then without."""
    c = fxtools.compile(p.fn, compiler=identity_compiler if i % 2 else None, **options)
    try:
        c(*p.args)
    except fxtools.FxtoolsError:
        c = fxtools.compile(p.fn, **options)
    return c


def check_double_backward(i, p) -> str | None:
    """None if exact; what happened if eager autograd refuses (then fxtools must refuse too)."""
    try:
        want = second_order(p.fn, p, i)
    except RuntimeError as exc:  # eager cannot: fxtools must refuse as well
        with pytest.raises((RuntimeError, fxtools.FxtoolsError)):
            second_order(compiled(p, i), p, i)
        return f"eager raises {str(exc).splitlines()[0][:80]}"
    got = second_order(compiled(p, i), p, i)
    close(got[0], want[0], "first-order gradients")
    close(got[1], want[1], "second-order gradients")
    return None


def groups():
    indices = ONLY or list(range(N))
    return [indices[k : k + GROUP] for k in range(0, len(indices), GROUP)]


@pytest.mark.parametrize("chunk", groups(), ids=lambda c: f"{c[0]}-{c[-1]}")
def test_fuzz_double_backward(chunk):
    failures, notes = [], []
    for i in chunk:
        p = program(i)
        if not p.float_args:
            continue
        try:
            note = check_double_backward(i, p)
            if note is not None:
                notes.append(note)
        except Exception as exc:  # noqa: BLE001 - every failing program is reported
            failures.append((i, p, exc))
    if failures:
        lines = [
            f"{len(failures)} of {len(chunk)} programs fail double backward; reproduce one with "
            f"FXTOOLS_FUZZ_SEED={SEED} FXTOOLS_FUZZ_ONLY=<index> pytest tests/test_fuzz_double_backward.py"
            f" (source: python tests/fuzz_programs.py <index> {SEED})"
        ]
        lines += [
            f"- index {i}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            for i, _, e in failures
        ]
        i, p, exc = failures[0]
        lines.append(f"\nfirst failure, {p}")
        lines.append("".join(traceback.format_exception(exc))[-3000:])
        pytest.fail("\n".join(lines), pytrace=False)
    assert len(notes) <= len(chunk) // 5, f"too many programs eager autograd refuses: {notes}"
