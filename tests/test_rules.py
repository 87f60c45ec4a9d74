"""Every hand-written VJP rule agrees with torch.autograd (float64) on PyTorch's OpInfo samples."""
import pytest
import torch

import fxtools  # noqa: F401  (registers the rules)
from fxtools import registry
from opinfo_harness import cases_for_rule, check_sample

HAND_WRITTEN = sorted(
    (op for op, rule in registry.registered_ops().items() if rule.source == "hand-written"), key=str)


@pytest.mark.parametrize("op", HAND_WRITTEN, ids=str)
def test_rule_matches_autograd_on_opinfo_samples(op):
    cases = cases_for_rule(op)
    assert cases, f"no OpInfo sample calls {op}: add a test for it to tests/test_rules_extra.py"
    for opinfo, sample in cases:
        check_sample(opinfo, sample)


def test_rules_are_used_not_decomposed():
    from fxtools.capture import capture
    from fxtools.decompose import expand

    cap = capture(lambda x: torch.sin(x).sum(), (torch.randn(3),))
    expand(cap.gm)
    targets = {n.target for n in cap.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.sin.default in targets
