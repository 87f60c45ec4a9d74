#!/usr/bin/env bash
# Create .venv (once) and install fxtools with its test dependencies.
# torch is pinned to the CPU build first: an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
# constraints.txt keeps torch at that build while the test extras (transformers) install.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
