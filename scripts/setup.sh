#!/usr/bin/env bash
# Create .venv (once) and install fxtools with its test and lint dependencies.
# torch is pinned to the CPU build first: an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
# Graphviz's `dot` draws the graphs (fxtools.draw, --svg); installed quietly where apt-get is available.
if ! command -v dot >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  { apt-get install -y -q graphviz >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q graphviz >/dev/null 2>&1; }; } \
    || echo "setup.sh: could not install graphviz (fxtools.draw needs its dot program)" >&2
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
# constraints.txt keeps torch at that build while the test extras (transformers) install.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test,lint]'
