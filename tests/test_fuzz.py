"""Differential fuzzing: random programs (``tests/fuzz_programs.py``) through every transform,
against ``torch.func`` in float64 at 1e-9.

Each program goes through ``fxtools.vjp``, ``jvp``, ``hvp``, ``vmap``, per-sample gradients
(``vmap`` of ``grad``) and ``split`` (forward then backward). Programs are grouped, several per
test case; a failing case lists every failing program with the command that reproduces it.

By default the programs are a varied subset of the first ``CANDIDATES`` indices
(``fuzz_programs.varied``): every op, keyword, in-place method, input rank and output structure
those programs exercise is exercised at least ``TIMES`` times (or as often as they do), with
fewer statements than the first 300 indices have (a run of consecutive indices exercises its
rarest ops once or not at all).

Environment: ``FXTOOLS_FUZZ_N`` runs programs ``0 .. N - 1`` instead (long runs),
``FXTOOLS_FUZZ_SEED`` (default 0) selects another sequence, ``FXTOOLS_FUZZ_ONLY=12,40`` runs only
those indices. ``python tests/fuzz_programs.py INDEX [SEED]`` prints a program's source.
"""

import os
import traceback

import fuzz_programs
import pytest
import torch
from torch.utils import _pytree as pytree

import fxtools

N = int(os.environ.get("FXTOOLS_FUZZ_N", "0"))  # 0: the varied subset below
SEED = int(os.environ.get("FXTOOLS_FUZZ_SEED", "0"))
ONLY = [int(i) for i in os.environ.get("FXTOOLS_FUZZ_ONLY", "").split(",") if i.strip()]
CANDIDATES, TIMES = 600, 6  # 193 programs, 978 statements (indices 0 .. 299: 1,543) at seed 0
# test cases per transform: 4 for the varied subset, else about 50 programs each
PARTS = max(1, -(-len(ONLY or range(N)) // 50)) if ONLY or N else 4
TOL = dict(rtol=1e-9, atol=1e-9)

pytestmark = pytest.mark.usefixtures("float64")

_programs = {}


def program(i):
    if i not in _programs:
        _programs[i] = fuzz_programs.program(i, SEED)
    return _programs[i]


_static_vjps = {}


_indices: list[int] = []


def indices():
    """The indices the fuzzers run: ``FXTOOLS_FUZZ_ONLY``, else ``0 .. FXTOOLS_FUZZ_N - 1``, else
    the varied subset (computed once per process, on first use: collecting costs nothing)."""
    if not _indices:
        _indices.extend(ONLY or (range(N) if N else fuzz_programs.varied(range(CANDIDATES), TIMES, SEED, make=program)))
    return _indices


def part(k, parts=PARTS):
    """The ``k``-th of ``parts`` consecutive runs of ``indices()``."""
    ix = indices()
    return ix[len(ix) * k // parts : len(ix) * (k + 1) // parts]


def static_vjp(p):
    """``fxtools.vjp`` of program ``p`` at its example, built once per process: the vjp axis calls
    it at the example, ``test_fuzz_sizes`` at other sizes (tests/conftest.py puts both on one worker)."""
    if p.index not in _static_vjps:
        _static_vjps[p.index] = fxtools.vjp(p.fn, *p.args)
    return _static_vjps[p.index]


def close(got, want, what):
    got_l, want_l = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(got_l) == len(want_l), f"{what}: {len(got_l)} leaves, expected {len(want_l)}"
    for k, (a, b) in enumerate(zip(got_l, want_l)):
        assert isinstance(a, torch.Tensor), f"{what}[{k}]: {type(a).__name__}, expected a tensor"
        if b.is_floating_point():
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}[{k}]: {m}")
        else:
            assert torch.equal(a, b), f"{what}[{k}] differs"


def float_leaves(tree):
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def of_floats(p, f=None):
    """``f`` (default: the program) as a function of the float inputs alone."""
    f = f or p.fn

    def g(*floats):
        args = list(p.args)
        for k, x in zip(p.float_args, floats):
            args[k] = x
        return f(*args)

    return g


def loss_of(p):
    """A scalar of the program's outputs whose Hessian is not zero for linear programs."""

    def loss(*args):
        return sum((x * x).sum() for x in float_leaves(p.fn(*args)))

    loss.__name__ = "loss"
    return loss


def randn_like_floats(tree, gen):
    return pytree.tree_map(
        lambda x: (
            torch.randn(x.shape, generator=gen, dtype=x.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else None
        ),
        tree,
    )


def check_vjp(p, gen):
    args = p.args
    out = p.fn(*args)
    ct = randn_like_floats(out, gen)
    got_out, grads = static_vjp(p)(*args, ct)
    close(got_out, out, "out")
    floats = [args[k] for k in p.float_args]
    _, pullback = torch.func.vjp(lambda *fl: float_leaves(of_floats(p)(*fl)), *floats)
    want = pullback(float_leaves(ct))
    close([grads[k] for k in p.float_args], list(want), "grads")
    assert all(grads[k] is None for k in range(len(args)) if k not in p.float_args)


def check_jvp(p, gen):
    args = p.args
    tangents = randn_like_floats(args, gen)
    got_out, got_t = fxtools.jvp(p.fn, *args)(*args, *tangents)
    floats = [args[k] for k in p.float_args]
    want_out, want_t = torch.func.jvp(
        lambda *fl: float_leaves(of_floats(p)(*fl)), tuple(floats), tuple(tangents[k] for k in p.float_args)
    )
    close(got_out, p.fn(*args), "out")
    close(float_leaves(got_t), want_t, "tangent")


def check_hvp(p, gen):
    args, nums = p.args, tuple(p.float_args)
    loss = loss_of(p)
    v = tuple(torch.randn(args[k].shape, generator=gen) for k in nums)
    got = fxtools.hvp(loss, *args, argnums=nums)(*args, v)
    floats = [args[k] for k in nums]
    grad = torch.func.grad(of_floats(p, loss), argnums=tuple(range(len(nums))))
    want = torch.func.jvp(grad, tuple(floats), v)[1]
    close(got, want, "hvp")


def check_vmap(p, gen):
    batched, in_dims = p.batched_args(), p.in_dims()
    got = fxtools.vmap(p.fn, *batched, in_dims=in_dims)(*batched)
    close(got, fuzz_programs.vmap_oracle(p.fn, in_dims, *batched), "vmap")


def check_per_sample_grads(p, gen):
    """vmap of grad; with two or more float inputs the first is the unbatched 'parameter'."""
    loss, nums = loss_of(p), tuple(p.float_args)
    params = nums[:1] if len(nums) > 1 else ()
    batched = p.batched_args()
    in_dims = tuple(None if (k in params or d is None) else d for k, d in enumerate(p.in_dims()))
    args = tuple(p.args[k] if in_dims[k] is None else batched[k] for k in range(len(batched)))
    g = fxtools.grad(loss, *p.args, argnums=nums)
    got = fxtools.vmap(g, *args, in_dims=in_dims)(*args)
    want = fuzz_programs.vmap_oracle(torch.func.grad(loss, argnums=nums), in_dims, *args)
    close(got, want, "per-sample grads")


def check_split(p, gen):
    args = p.args
    sp = fxtools.split(p.fn, *args)
    out, saved = sp.forward(*sp.flatten(*args))
    close(out, p.fn(*args), "out")
    cts = [torch.randn(c.shape, generator=gen, dtype=c.dtype) for c in sp.cotangents]
    grads = sp.backward(*saved, *cts)
    floats = [args[k] for k in p.float_args]
    _, pullback = torch.func.vjp(lambda *fl: float_leaves(of_floats(p)(*fl)), *floats)
    close([grads[k] for k in p.float_args], list(pullback(cts)), "grads")


CHECKS = {
    "vjp": check_vjp,
    "jvp": check_jvp,
    "hvp": check_hvp,
    "vmap": check_vmap,
    "per_sample_grads": check_per_sample_grads,
    "split": check_split,
}


@pytest.mark.parametrize("k", range(PARTS), ids=lambda k: f"part{k + 1}of{PARTS}")
@pytest.mark.parametrize("transform", list(CHECKS))
def test_fuzz(transform, k):
    failures, chunk = [], part(k)
    for i in chunk:
        p = program(i)
        gen = torch.Generator().manual_seed(i)
        try:
            CHECKS[transform](p, gen)
        except Exception as exc:  # noqa: BLE001 - every failing program is reported
            failures.append((i, p, exc))
    if failures:
        lines = [
            f"{len(failures)} of {len(chunk)} programs fail under {transform}; reproduce one with "
            f"FXTOOLS_FUZZ_SEED={SEED} FXTOOLS_FUZZ_ONLY=<index> pytest tests/test_fuzz.py -k {transform}"
            f" (source: python tests/fuzz_programs.py <index> {SEED})"
        ]
        for i, p, exc in failures:
            lines.append(
                f"- index {i}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            )
        i, p, exc = failures[0]
        lines.append(f"\nfirst failure, {p}")
        lines.append("".join(traceback.format_exception(exc))[-3000:])
        pytest.fail("\n".join(lines), pytrace=False)


def test_programs_are_reproducible_and_varied():
    """The same index gives the same program and inputs; the vocabulary is actually used."""
    a, b = fuzz_programs.program(3, SEED), fuzz_programs.program(3, SEED)
    assert a.source == b.source and all(torch.equal(x, y) for x, y in zip(a.args, b.args))
    # 400 programs: in 200, a word drawn about once in 80 programs is missing for some seeds (63: relu)
    text = "\n".join(fuzz_programs.program(i, SEED).source for i in range(400))
    for word in (
        "@",
        "F.softmax",
        "F.layer_norm",
        "torch.gather",
        "torch.cat",
        ".sum(",
        "torch.where",
        "F.cross_entropy",
        "F.conv",
        "torch.tanh",
        "torch.relu",
        ".reshape(",
        "'rest'",
    ):
        assert word in text, word
