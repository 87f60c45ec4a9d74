"""``import fxtools`` loads only the package's face; the rest on first use (issue 33).

One subprocess (a fresh interpreter is the only place an import's cost shows) checks what the
import brings in; the built-in rules are registered before any table is read or written, so a
user's rule registered through ``fxtools.registry`` before any transform still wins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import fxtools

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    before = set(sys.modules)
    import fxtools
    new = set(sys.modules) - before
    assert not any(m.startswith(("fxtools.rules", "fxtools.transforms", "fxtools.training", "fxtools.capture")) for m in new), new
    assert "sympy" not in new, "sympy loaded by import fxtools"

    from fxtools import registry
    from fxtools.cli import examples  # imports submodules directly: fxtools.functional stays the function

    assert callable(fxtools.functional) and examples.gpt

    def sin_fwd(x):
        return torch.sin(x), x

    def sin_bwd(x, ct):
        return ct * 3.0  # not sin's derivative: shows whose rule ran

    registry.register_vjp(torch.ops.aten.sin, sin_fwd, sin_bwd)  # before the built-in rules are imported
    assert len(registry.registered_ops("fused")) > 10  # the built-in sets are there when read
    g = fxtools.grad(lambda x: torch.sin(x).sum(), torch.ones(3))(torch.ones(3))
    assert torch.equal(g, torch.full((3,), 3.0)), g
    assert "fxtools.rules" in sys.modules and callable(fxtools.compile) and fxtools.codegen.flat
    print("ok")
    """
)


def test_import_is_lazy_and_user_rules_still_win(tmp_path):
    """The interpreter starts in an empty directory (nothing there shadows a module, whatever the
    suite's other tests leave in theirs) and imports the fxtools this test imported; no
    environment variable of the test run changes what an import loads."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fxtools.__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TORCH", "PYTORCH"))}
    env["PYTHONPATH"] = package_root
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (
        f"stdout:\n{out.stdout[-1500:]}\nstderr:\n{out.stderr[-3000:]}"
    )
