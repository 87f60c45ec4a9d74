"""Every hand-written VJP rule agrees with torch.autograd (float64) on PyTorch's OpInfo samples.

Rules that no OpInfo sample reaches are checked on the cases in ``rule_cases.py``, each of which
must really call the op. Random samples (dropout in training) are checked for self-consistency:
the generated gradients equal autograd's gradients of the generated forward under the same seed.
"""

import pytest
import torch
from opinfo_harness import cases_for_rule, check_sample_once, check_self_consistent, is_random
from rule_cases import EXTRA_CASES

import fxtools
from fxtools import registry
from fxtools.capture.decompose import expand
from fxtools.capture.trace import capture
from fxtools.errors import DataDependentError

# The collectives' rules (rules/collectives.py) need a process group of several ranks: they are
# checked against eager DTensor training on 2 and 4 gloo processes in tests/test_tensor_parallel.py.
ACROSS_PROCESSES = "_c10d_functional"
HAND_WRITTEN = sorted(
    (
        op
        for op, rule in registry.registered_ops().items()
        if rule.source == "hand-written" and not str(op).startswith(ACROSS_PROCESSES + ".")
    ),
    key=str,
)


def _calls(f, args, key):
    cap = capture(f, args, record_stack_traces=False)
    expand(cap.gm)
    return any(
        isinstance(n.target, torch._ops.OpOverload) and (n.target == key or n.target.overloadpacket == key)
        for n in cap.gm.graph.nodes
    )


@pytest.mark.parametrize("op", HAND_WRITTEN, ids=str)
def test_rule_matches_autograd(op):
    checked = 0
    for opinfo, index, sample in cases_for_rule(op):
        try:
            check_sample_once(opinfo, index, sample)
        except DataDependentError:
            continue  # the sample needs data-dependent shapes elsewhere: the op sweep tracks those
        except Exception as exc:
            raise AssertionError(
                f"OpInfo {opinfo.name!r} {opinfo.variant_test_name!r} sample "
                f"{sample.summary() if hasattr(sample, 'summary') else sample}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        checked += 1
    for f, args in EXTRA_CASES.get(op, []):
        assert _calls(f, args, op), f"the case for {op} in rule_cases.py does not call it"
        if is_random(f, args):
            check_self_consistent(f, args)
        else:
            fxtools.check_vjp(f, *args, rtol=1e-6, atol=1e-8)
        checked += 1
    assert checked, f"nothing checks the rule of {op}: add a case to tests/rule_cases.py"
