import os
import shutil
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# the examples' programs and models are imported by the tests that check them (one definition each)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Inductor compiles in the test process itself: a pool of compile workers (each importing torch)
# costs CPU on a 2-core machine already busy with two pytest-xdist workers (read when
# torch._inductor.config is first imported, which ``import torch`` does not do)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def _extract_test_fn_without_source():
    """``torch.testing._internal.common_utils.extract_test_fn``, walking the frames without
    ``inspect.stack()``: the same frames and the same answer (the test method of a
    ``unittest.TestCase`` found on the stack, else None: always None under pytest's functions),
    but no source line read for each frame, which under pytest (deep stacks, thousands of
    modules for ``inspect.getmodule`` to scan) made every ``OpInfo.sample_inputs`` call cost
    30-70 ms, twice (measured: 15 s of the first ``test_taylor_points`` test on each worker)."""
    import unittest

    frame = sys._getframe(1)
    try:
        while frame is not None:
            self_val = frame.f_locals.get("self")
            if isinstance(self_val, unittest.TestCase):
                *_, cls_name, test_name = self_val.id().rsplit(".", 2)
                if cls_name == type(self_val).__name__ and test_name.startswith("test"):
                    return getattr(self_val, test_name).__func__
            frame = frame.f_back
    except Exception:  # noqa: BLE001 - as the original: no test function found
        pass
    return None


def pytest_configure(config):
    """In a process that runs tests (not pytest-xdist's controller, which would import the
    OpInfo machinery, 2 s, for nothing): ``extract_test_fn`` without reading sources."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        from torch.testing._internal import common_utils
        from torch.testing._internal.opinfo import core

        common_utils.extract_test_fn = core.extract_test_fn = _extract_test_fn_without_source


# Graphviz is optional for users (the scripts never install it system-wide); CI installs it, so
# there a missing dot program fails the drawing tests instead of skipping them.
needs_graphviz = pytest.mark.skipif(
    shutil.which("dot") is None and os.environ.get("CI") != "true",
    reason="Graphviz's dot program is not installed (optional: apt-get install graphviz)",
)


# Tests that share expensive state run on one pytest-xdist worker (``scripts/test.sh`` passes
# ``--dist loadgroup``). Keyed by node id because the controller that schedules never sees marks,
# and pytest-xdist 3.8's own ``xdist_group`` marks do not group under pytest 9.2.
XDIST_GROUPS = {
    # cases_for_rule's table of which OpInfo sample calls which op: ~40 s of CPU per worker; and
    # the float64 sweep checks the very samples test_rules.py checks (opinfo_harness.check_sample_once
    # checks each once per process)
    "tests/test_rules.py::": "opinfo_cases",
    "tests/test_opinfo_sweep.py::test_opinfo_matches_autograd": "opinfo_cases",
    "tests/test_rules_fused.py::test_fused_rule_matches_autograd": "opinfo_cases",
    # multi-process launches: each file launches its process group once (a cached result its tests
    # read), so a file's tests must share a worker; one worker also keeps the launches from overlapping
    "tests/test_distributed.py::": "processes",
    "tests/test_tensor_parallel.py::": "processes",
    "tests/test_heldout_s.py::test_tensor_parallel": "processes",
    # the fuzzers' static vjp modules, built once (test_fuzz.static_vjp)
    "tests/test_fuzz.py::test_fuzz[vjp-": "fuzz_vjp",
    "tests/test_fuzz_sizes.py::": "fuzz_vjp",
    # Inductor compiles: kernels shared through Inductor's cache, and long units scheduled first
    "tests/test_zoo.py::": "zoo",
    "tests/test_compilers.py::test_inductor_trains_gpt_like_eager": "inductor",
    "tests/test_taylor.py::test_compile_pinn_loss[inductor]": "inductor",
    "tests/test_nonfinite.py::test_check_finite_raises_at_the_right_step_and_matches_unchecked[inductor]": "inductor",
    "tests/test_jvp_in_loss.py::test_inductor_meanflow_step": "inductor",
    "tests/test_taylor_operators.py::test_inductor_compiles_a_loss_on_the_divergence_and_bilaplacian": "inductor",
}

# Seconds a test takes on one of CI's two workers, where far from the typical half second
# (measured: pytest --durations of a fresh-clone run). Only the order of the work depends on
# them: the longest units go first so that neither worker is left with a long test at the end.
SECONDS = {
    "tests/test_distributed.py::": 45,
    "tests/test_tensor_parallel.py::": 30,
    "tests/test_heldout_s.py::test_tensor_parallel": 15,
    "tests/test_budget.py::test_byte_budget_peak_falls_with_the_budget[gpt]": 55,
    "tests/test_budget.py::test_sweep_is_monotone": 25,
    "tests/test_fuzz_sizes.py::": 15,  # a part: about 32 programs (test_fuzz_sizes.TIMES)
    "tests/test_fuzz.py::test_fuzz[hvp": 16,
    "tests/test_fuzz.py::": 5,
    "tests/test_fuzz_refusals.py::": 8,
    "tests/test_zoo.py::test_trains_like_eager_with_inductor": 20,
    "tests/test_hf_zoo.py::": 5,
    # the first test of test_rules.py (ops sort by name) builds cases_for_rule's table: ~28 s of CPU
    "tests/test_rules.py::test_rule_matches_autograd[aten._adaptive_avg_pool2d]": 34,
    "tests/test_jvp_in_loss.py::test_inductor_meanflow_step": 40,
    "tests/test_taylor_operators.py::test_inductor": 18,
    "tests/test_compilers.py::test_inductor_trains_gpt_like_eager": 15,
}


def _seconds(nodeid: str) -> float:
    return next((t for prefix, t in SECONDS.items() if nodeid.startswith(prefix)), 0.5)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups above: each group is one unit of work; every other
    test is its own unit; a free worker takes the longest unit left (``SECONDS``, else half a
    second a test)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Groups(LoadGroupScheduling):
        def _split_scope(self, nodeid):
            group = next((g for prefix, g in XDIST_GROUPS.items() if nodeid.startswith(prefix)), None)
            return group or super()._split_scope(nodeid)

        def _assign_work_unit(self, node):
            if not getattr(self, "_longest_first", False):  # once, before the first unit is handed out
                self._longest_first = True
                units = sorted(self.workqueue.items(), key=lambda unit: -sum(map(_seconds, unit[1])))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return Groups(config, log)


def _cpu_seconds() -> float:
    """User + system CPU of this process and its waited-for children (compilers, launches)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``FXTOOLS_TEST_CPU=FILE``: append ``seconds<TAB>node id`` per test (setup, call and
    teardown) to ``FILE`` (one file per xdist worker: ``FILE.gw0``...). CPU seconds, not wall
    time: on a shared host a test's wall time measures the neighbours; the suite is CPU-bound,
    so its CPU seconds are what the two workers share out."""
    path = os.environ.get("FXTOOLS_TEST_CPU")
    start = _cpu_seconds() if path else 0.0
    yield
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        with open(f"{path}.{worker}" if worker else path, "a") as out:
            out.write(f"{_cpu_seconds() - start:.2f}\t{item.nodeid}\n")


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype (the oracle's precision)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# A model file fxtools has never seen (the CLI and --svg tests load it by path).
MODEL = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.norm = nn.LayerNorm(16)
            self.fc2 = nn.Linear(16, 3)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

        def forward(self, x):
            h = F.gelu(self.norm(self.fc1(x))) * self.scale
            return self.fc2(h).logsumexp(-1).mean()


    def embed(table, idx, n):
        return (table[idx].tanh() * n).sum()
""")


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    return tmp_path
