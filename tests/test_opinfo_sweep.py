"""Every differentiable PyTorch op: fxtools.vjp agrees with torch.autograd on PyTorch's OpInfos.

For every OpInfo of ``op_db`` that supports autograd and float64 on the CPU, the first three
samples are differentiated by fxtools and compared with torch.autograd in float64 (random ops
are checked for self-consistency, see ``opinfo_harness.check_sample``). One test per OpInfo.

OpInfos fxtools deliberately does not support are listed in ``KNOWN_FAILURES`` with the reason
and the exception they raise; they are strict xfails, so one that starts passing is noticed.
"""
import pytest
import torch

from fxtools.errors import DataDependentError
from opinfo_harness import autograd_opinfos, check_sample, samples

N_SAMPLES = 3
# The issue asks for 99%: the sweep measures 536/540 = 99.3% (KNOWN_FAILURES lists the rest, README).
REQUIRED_RATIO = 0.99


def opinfo_id(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


# id -> (exception type, reason)
KNOWN_FAILURES = {
    "nn.functional.ctc_loss": (
        DataDependentError, "aten._ctc_loss has no fake kernel and FakeTensorMode treats it as having "
        "data-dependent output shapes (its log_alpha is batch x T x (2 * max(target_lengths) + 1), "
        "which with tensor lengths depends on their values), so it cannot be captured"),
    "sparse.sampled_addmm": (RuntimeError, "sparse CSR tensors: fxtools traces strided tensors only"),
    "sparse.mm.reduce": (RuntimeError, "sparse CSR tensors: fxtools traces strided tensors only"),
    "as_strided.partial_views": (
        RuntimeError, "as_strided reaching storage outside the argument view: the argument is a "
        "partial view of a larger tensor, and a function of that view cannot see its storage"),
}


def _params():
    for opinfo in autograd_opinfos():
        name = opinfo_id(opinfo)
        marks = []
        if name in KNOWN_FAILURES:
            exc, reason = KNOWN_FAILURES[name]
            marks.append(pytest.mark.xfail(strict=True, raises=exc, reason=reason))
        yield pytest.param(opinfo, id=name, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("opinfo", list(_params()))
def test_opinfo_matches_autograd(opinfo):
    for sample in samples(opinfo, N_SAMPLES):
        check_sample(opinfo, sample)


def test_known_failures_are_opinfos():
    ids = [opinfo_id(o) for o in autograd_opinfos()]
    assert len(ids) == len(set(ids)), "OpInfo ids must be unique"
    stale = sorted(set(KNOWN_FAILURES) - set(ids))
    assert not stale, f"KNOWN_FAILURES names OpInfos that do not exist: {stale}"
    for name, (exc, reason) in KNOWN_FAILURES.items():
        assert issubclass(exc, BaseException) and reason, name


def test_pass_ratio():
    """Every OpInfo outside KNOWN_FAILURES must pass its sweep test, and every known failure must
    fail (strict xfail), so the sweep's pass ratio is exactly this one."""
    total = len(autograd_opinfos())
    passing = total - len(KNOWN_FAILURES)
    ratio = passing / total
    assert ratio >= REQUIRED_RATIO, (
        f"{passing}/{total} = {ratio:.2%} of the OpInfos match torch.autograd; the issue requires "
        f"at least {REQUIRED_RATIO:.0%}")
