#!/usr/bin/env bash
# Quick start, main job: install fxtools and its runtime dependency (torch) if needed, then run
# `fxtools demo` on the built-in examples. Uses the active environment, else .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
"$PY" -m fxtools demo "$@"
