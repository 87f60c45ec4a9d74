"""Run Python code in a fresh interpreter that can import torch but not fxtools.

``python -I -S`` ignores PYTHONPATH, the user's site directory and every ``.pth`` file (which is
how the editable install of fxtools puts it on the path); the directory holding torch is then
added by hand, and an import hook refuses ``fxtools`` should it be found some other way.
"""

import os
import subprocess
import sys

import torch

SITE = os.path.dirname(os.path.dirname(torch.__file__))

PRELUDE = f"""
import os, sys
sys.path.insert(0, os.getcwd())  # -I leaves the working directory off the path
sys.path.append({SITE!r})
class _NoFxtools:
    def find_spec(self, name, path=None, target=None):
        if name == "fxtools" or name.startswith("fxtools."):
            raise ImportError("fxtools is not importable in this interpreter")
        return None
sys.meta_path.insert(0, _NoFxtools())
"""


def run_isolated(code: str, cwd) -> str:
    """Run ``code`` with the prelude in a subprocess in ``cwd``; returns stdout, raises on failure."""
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", PRELUDE + code], cwd=str(cwd), capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise AssertionError(f"isolated interpreter failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout
