#!/usr/bin/env bash
# Lint, formatting and type checks (CI runs them before the tests); configured in pyproject.toml.
# To fix what ruff can fix by itself: ruff check --fix . && ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh lint)
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy  # the files and the exceptions are in [tool.mypy]; a cold run takes about 15 s of CPU
