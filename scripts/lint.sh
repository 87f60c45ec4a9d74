#!/usr/bin/env bash
# Lint, formatting and type checks (CI runs them before the tests); configured in pyproject.toml.
# To fix what ruff can fix by itself: .venv/bin/ruff check --fix . && .venv/bin/ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # the files and the exceptions are in [tool.mypy]; a cold run takes about 15 s of CPU
