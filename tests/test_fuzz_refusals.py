"""Differential fuzzing of programs as users write them around the random ones (issue 32):
arguments named from fxtools' own vocabulary, a keyword argument, grad-mode blocks inside, an
outer grad-mode context around the build and the call, closed-over buffers updated in place
several times, and size 1 on a dynamic batch dimension (``fuzz_programs.variant``). Oracle:
torch.func in float64 at 1e-9 (on the program without its buffer updates, which torch.func
refuses), and eager PyTorch for the buffers.

``FXTOOLS_FUZZ_VARIANTS`` programs (default below), ``FXTOOLS_FUZZ_SEED`` as in test_fuzz.py.
"""

import contextlib
import os

import fuzz_programs
import pytest
import torch
from test_fuzz import close, float_leaves, randn_like_floats
from torch.export import Dim

import fxtools

N = int(os.environ.get("FXTOOLS_FUZZ_VARIANTS", "16"))
SEED = int(os.environ.get("FXTOOLS_FUZZ_SEED", "0"))
OUTER = {
    "none": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
    "inference_mode": torch.inference_mode,
}

pytestmark = pytest.mark.usefixtures("float64")


def _loss(fn, names):
    """A scalar of ``fn``'s float outputs, with ``fn``'s argument names (the user's) and keyword."""
    args = ", ".join(names)
    env = {"fn": fn, "float_leaves": float_leaves}
    exec(f"def loss({args}, *, scale=1.0):\n    return sum((t * t).sum() for t in float_leaves(fn({args}, scale=scale)))\n", env)
    return env["loss"]


def _named(fn, names, scale):
    """``fn`` with its keyword bound, keeping the user's argument names (jvp and vjp take no keywords)."""
    args = ", ".join(names)
    env = {"fn": fn}
    exec(f"def g({args}):\n    return fn({args}, scale={scale!r})\n", env)
    return env["g"]


def _floats_only(fn, p, **kw):
    def g(*floats):
        args = list(p.args)
        for k, x in zip(p.float_args, floats):
            args[k] = x
        return float_leaves(fn(*args, **kw))

    return g


def check_variant(i):
    v = fuzz_programs.variant(i, SEED)
    p, names = v.program, [x.name for x in v.program.inputs]
    args, nums = p.args, tuple(p.float_args)
    gen = torch.Generator().manual_seed(i)
    before = {k: b.clone() for k, b in v.buffers.items()}
    with OUTER[v.outer]():
        grad_gm = fxtools.grad(_loss(p.fn, names), *args, argnums=nums, scale=v.scale)
        out = p.fn(*args, scale=v.scale)
        jvp_gm = fxtools.jvp(_named(p.fn, names, v.scale), *args)
        vjp_gm = fxtools.vjp(_named(p.fn, names, v.scale), *args)
    for k, b in v.buffers.items():  # building changes no buffer
        b.copy_(before[k])
    with OUTER[v.outer]():
        got = grad_gm(*args, scale=v.scale)
    after = {k: b.clone() for k, b in v.buffers.items()}
    for k, b in v.buffers.items():
        b.copy_(before[k])
    p.fn(*args, scale=v.scale)  # eager, once: the buffers' oracle
    close(list(after.values()), list(v.buffers.values()), "buffers")
    ref_loss = _loss(v.reference, names)
    floats = tuple(args[k] for k in nums)
    of_floats = lambda *fl: ref_loss(*[fl[nums.index(k)] if k in nums else a for k, a in enumerate(args)], scale=v.scale)  # noqa: E731
    want = torch.func.grad(of_floats, argnums=tuple(range(len(nums))))(*floats)
    close(got if isinstance(got, tuple) else (got,), want, "grad")
    tangents = randn_like_floats(args, gen)
    with OUTER[v.outer]():
        got_out, got_t = jvp_gm(*args, *tangents)
    want_out, want_t = torch.func.jvp(_floats_only(v.reference, p, scale=v.scale), floats, tuple(tangents[k] for k in nums))
    close(float_leaves(got_out), want_out, "jvp out")
    close(float_leaves(got_t), want_t, "jvp tangent")
    ct = randn_like_floats(out, gen)
    with OUTER[v.outer]():
        _, grads = vjp_gm(*args, ct)
    _, pullback = torch.func.vjp(_floats_only(v.reference, p, scale=v.scale), *floats)
    close([grads[k] for k in nums], list(pullback(float_leaves(ct))), "vjp")


def check_size_one(i):
    """vmap with a dynamic batch size, called with batches of 1 and of 3."""
    v = fuzz_programs.variant(i, SEED)
    p = v.program
    batched, in_dims = p.batched_args(), p.in_dims()
    shapes = tuple({0: Dim("batch")} if d == 0 else None for d in in_dims)
    fn = lambda *a: v.reference(*a, scale=v.scale)  # noqa: E731
    try:
        with OUTER[v.outer]():
            gm = fxtools.vmap(fn, *batched, in_dims=in_dims, dynamic_shapes=shapes)
    except fxtools.FxtoolsError as exc:
        # documented refusals (docs/security.md#known-gaps): the program needs the batch size to be
        # a number (a reshape to constants): SymbolicSizeError, or vmap's batching rule does
        if isinstance(exc, fxtools.SymbolicSizeError) or "needs concrete sizes" in str(exc):
            return False
        raise
    for n in (1, 3):
        part = tuple(b[:n] if d == 0 else b for b, d in zip(batched, in_dims))
        close(gm(*part), torch.func.vmap(fn, in_dims=in_dims)(*part), f"vmap of {n}")
    return True


@pytest.mark.parametrize("check", [check_variant, check_size_one], ids=lambda c: c.__name__)
def test_fuzz_refusals(check):
    failures, served = [], 0
    for i in range(N):
        try:
            served += check(i) is not False
        except Exception as exc:  # noqa: BLE001 - every failing program is reported
            failures.append(f"- index {i}: {type(exc).__name__}: {str(exc).strip()[:400]}")
    assert served >= N // 4, f"only {served} of {N} programs were served (the others refused): the axis tests little"
    if failures:
        src = fuzz_programs.variant(int(failures[0].split()[2].rstrip(":")), SEED).program.source
        pytest.fail(f"{len(failures)} of {N} programs fail:\n" + "\n".join(failures) + f"\n\nfirst:\n{src}", pytrace=False)
