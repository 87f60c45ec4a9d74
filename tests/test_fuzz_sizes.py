"""Random programs called at sizes other than their example's: the exact answer or a refusal.

Each program of ``tests/fuzz_programs.py`` goes through ``fxtools.vjp`` twice: with static sizes
and with every size marked ``Dim.AUTO`` (symbolic where the program allows it, silently static
where it specialises, as in torch.export). Both modules are then called at new arguments whose
sizes are the example's under one substitution (2 -> 5, 3 -> 7, 4 -> 6, ...; equal sizes stay
equal, so broadcasting and indexing relations between arguments hold) and whose values are the
example's tiled over the new sizes plus a little noise (so every value stays in the domain the
generator chose it for, away from kinks and ties). Required, against ``torch.func.vjp`` in
float64 at 1e-9:

- the static module refuses the new sizes with ``fxtools.InputMismatch``;
- the symbolic module equals ``torch.func`` at the example and at the new sizes, or refuses the
  new sizes with ``InputMismatch`` (a size that became static); where eager PyTorch itself
  fails at the new sizes (a reshape to the example's numbers), it must raise, never return.

Both modules are also called at the example's sizes and values with every argument in another
memory layout (``check_layouts``): exact, or refused where eager refuses.

Never a result that differs from ``torch.func``. By default a varied subset
(``fuzz_programs.varied``) of ``tests/test_fuzz.py``'s own: every feature of those exercised at
least ``TIMES`` times (their static modules are the vjp axis's); ``FXTOOLS_FUZZ_SIZES_N`` runs
programs ``0 .. N - 1`` instead, a long ``FXTOOLS_FUZZ_N`` run of test_fuzz.py runs its programs;
``FXTOOLS_FUZZ_SEED`` and ``FXTOOLS_FUZZ_ONLY`` as in ``tests/test_fuzz.py``.
"""

import os

import fuzz_programs
import pytest
import test_fuzz
import torch
from test_fuzz import ONLY, PARTS, SEED, close, float_leaves, program, randn_like_floats, static_vjp
from torch.export import Dim

import fxtools

N = int(os.environ.get("FXTOOLS_FUZZ_SIZES_N", "0"))  # 0: the varied subset below
TIMES = 4  # of test_fuzz's 193 programs at seed 0: 128 (643 statements; programs 0 .. 299 have 1,543)
GROUP = 50
SUBSTITUTION = {2: 5, 3: 7, 4: 6, 5: 9, 6: 8, 7: 11, 8: 10, 9: 13, 12: 14, 16: 17}

pytestmark = pytest.mark.usefixtures("float64")


def _resized(x, gen):
    """``x`` at the substituted sizes: its values tiled, floats moved by at most 1%."""
    shape = [SUBSTITUTION.get(s, s) for s in x.shape]
    index = [torch.arange(n) % s for n, s in zip(shape, x.shape)]
    y = x[torch.meshgrid(*index, indexing="ij")] if x.dim() else x.clone()
    if y.is_floating_point():
        y = y * (1 + 0.01 * (2 * torch.rand(y.shape, generator=gen, dtype=y.dtype) - 1))
    return y


def _all_sizes_auto(args):
    return tuple(dict.fromkeys(range(a.dim()), Dim.AUTO) if isinstance(a, torch.Tensor) and a.dim() else None for a in args)


def _reference(p, args, ct):
    floats = [args[k] for k in p.float_args]

    def f(*fl):
        full = list(args)
        for k, x in zip(p.float_args, fl):
            full[k] = x
        return float_leaves(p.fn(*full))

    out, pullback = torch.func.vjp(f, *floats)
    return out, pullback(float_leaves(ct))


def _call_and_compare(gm, p, args, gen):
    """Run ``gm`` at ``args``: "exact", "refused" (InputMismatch) or raise AssertionError."""
    try:
        out = p.fn(*args)
    except Exception as exc:  # noqa: BLE001 - eager PyTorch refuses these sizes: so must the module
        ct = randn_like_floats(p.fn(*p.args), gen)
        if "view size is not compatible" not in str(exc):
            with pytest.raises(Exception):  # noqa: B017,PT011 - any refusal; a returned value would be wrong
                gm(*args, ct)
            return "refused"
        # A `.view` the code no longer holds (its value unused, or not needed by the transform) is
        # not checked at other layouts (docs/security.md, known gaps): a returned value must then be
        # eager's on the same values where the view succeeds (contiguous copies).
        try:
            got_out, grads = gm(*args, ct)
        except Exception:  # noqa: BLE001 - refused as eager refuses
            return "refused"
        dense = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        want_out, want = _reference(p, dense, ct)
        close(float_leaves(got_out), want_out, "out")
        close([grads[k] for k in p.float_args], list(want), "grads")
        return "exact"
    ct = randn_like_floats(out, gen)
    try:
        got_out, grads = gm(*args, ct)
    except fxtools.InputMismatch:
        return "refused"
    want_out, want = _reference(p, args, ct)
    close(float_leaves(got_out), want_out, "out")
    close([grads[k] for k in p.float_args], list(want), "grads")
    return "exact"


def _relaid(x, k):
    """``x``'s values in another memory layout: for the ``k``-th tensor argument, alternately every
    other element of a larger buffer (strides doubled, storage offset 1) and, for a matrix or more,
    the last two dimensions' order swapped in memory (a transposed buffer); a scalar as is."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    if k % 2 and x.dim() >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    buffer = torch.zeros(x.numel() * 2 + 1, dtype=x.dtype)
    y = buffer[1::2].view(x.shape) if x.numel() else x.clone()
    y.copy_(x)
    return y


def check_layouts(gm, p, gen):
    """``gm`` called with each argument in another memory layout (same sizes and values): exact,
    or refused where eager refuses (a ``view`` of a strided input)."""
    relaid = tuple(_relaid(a, k) for k, a in enumerate(p.args))
    if all(a is b for a, b in zip(relaid, p.args)):
        return
    assert _call_and_compare(gm, p, relaid, gen) in ("exact", "refused")


def check_sizes(p, gen, tally):
    args = p.args
    new = tuple(_resized(a, gen) for a in args)
    static = static_vjp(p)  # the vjp axis of test_fuzz builds the same module
    ct = randn_like_floats(p.fn(*args), gen)
    with pytest.raises(fxtools.InputMismatch):
        static(*new, ct)
    check_layouts(static, p, gen)
    try:
        symbolic = fxtools.vjp(p.fn, *args, dynamic_shapes=_all_sizes_auto(args))
    except fxtools.FxtoolsError as exc:  # a clear refusal at generation time is allowed, and counted
        tally["not generated"] = tally.get("not generated", 0) + 1
        tally.setdefault("reasons", []).append(f"{p.index}: {str(exc).splitlines()[0][:120]}")
        return
    assert _call_and_compare(symbolic, p, args, gen) == "exact", "the symbolic module refused its own example"
    outcome = _call_and_compare(symbolic, p, new, gen)
    tally[outcome] = tally.get(outcome, 0) + 1
    check_layouts(symbolic, p, gen)


_indices: list[int] = []


def part(k):
    """The ``k``-th of ``PARTS`` consecutive runs of the default programs (chosen once per process,
    on first use): ``FXTOOLS_FUZZ_ONLY``'s, a long test_fuzz run's, else the varied subset."""
    if not _indices:
        chosen = ONLY or test_fuzz.N
        _indices.extend(test_fuzz.indices() if chosen else fuzz_programs.varied(test_fuzz.indices(), TIMES, SEED, make=program))
    return _indices[len(_indices) * k // PARTS : len(_indices) * (k + 1) // PARTS]


def groups():
    """``FXTOOLS_FUZZ_SIZES_N``'s runs of ``GROUP`` indices, else ``PARTS`` parts (by number)."""
    if N and not ONLY:
        return [list(range(k, min(k + GROUP, N))) for k in range(0, N, GROUP)]
    return list(range(PARTS))


def _ids(c):
    return f"{c[0]}-{c[-1]}" if isinstance(c, list) else f"part{c + 1}of{PARTS}"


@pytest.mark.parametrize("chunk", groups(), ids=_ids)
def test_other_sizes_exact_or_refused(chunk):
    failures, tally = [], {}
    chunk = chunk if isinstance(chunk, list) else part(chunk)
    for i in chunk:
        p = program(i)
        try:
            check_sizes(p, torch.Generator().manual_seed(i), tally)
        except Exception as exc:  # noqa: BLE001 - every failing program is reported
            failures.append(f"- index {i}: {type(exc).__name__}: {str(exc).strip()[:400]}\n{p}")
    assert not failures, f"{len(failures)} of {len(chunk)} programs (FXTOOLS_FUZZ_SEED={SEED}):\n" + "\n".join(failures[:3])
    # the symbolic path must be exercised: a third or more of the programs (those without sizes
    # written into their source) give exact answers at new sizes
    assert tally.get("exact", 0) >= len(chunk) // 3, tally
