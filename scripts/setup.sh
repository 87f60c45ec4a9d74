#!/usr/bin/env bash
# Install fxtools (editable) with the extras named in $1 (e.g. "test", "lint", "docs"; none for the
# demo) into the active Python environment: the virtualenv ($VIRTUAL_ENV) or conda env
# ($CONDA_PREFIX) you have activated, or, when none is active, .venv in this repository (created
# once). Prints that environment's python on stdout (everything else goes to stderr), so that
# the other scripts run `PY=$(bash scripts/setup.sh test)`. Nothing is installed system-wide.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  py="$VIRTUAL_ENV/bin/python"
elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
  py="$CONDA_PREFIX/bin/python"
else
  [ -x .venv/bin/python ] || python3 -m venv .venv >&2
  py="$PWD/.venv/bin/python"
fi
echo "setup.sh: installing into $("$py" -c 'import sys; print(sys.prefix)')" >&2
pip=("$py" -m pip install -q --disable-pip-version-check)
# PyTorch: a torch 2.13 already there (a CPU or a CUDA build) is kept. Otherwise torch==2.13.0 comes
# from your pip's index; on Linux, PyPI serves the CUDA build (several GB): for the CPU build, set
# FXTOOLS_TORCH_INDEX=https://download.pytorch.org/whl/cpu (or install torch first, see README.md).
if ! "$py" -c 'import torch, sys; sys.exit(not torch.__version__.startswith("2.13."))' >/dev/null 2>&1; then
  "${pip[@]}" ${FXTOOLS_TORCH_INDEX:+--index-url "$FXTOOLS_TORCH_INDEX"} torch==2.13.0 >&2
fi
# constraints.txt keeps torch at 2.13 while the extras (transformers) install, and pins what may break
"${pip[@]}" -c constraints.txt -e ".${extras:+[$extras]}" >&2
if ! command -v dot >/dev/null 2>&1; then
  echo "setup.sh: note: Graphviz's dot program is not installed; only fxtools.draw and --svg need it" \
    "(apt-get install graphviz, brew install graphviz or conda install graphviz)" >&2
fi
echo "$py"
