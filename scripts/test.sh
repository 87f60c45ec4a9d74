#!/usr/bin/env bash
# The test suite: install fxtools with its test dependencies if needed (the active environment, else
# .venv: scripts/setup.sh), then run pytest on two workers (pytest-xdist). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh test)
"$PY" -m pytest -q -p no:cacheprovider -n 2 -rs --durations=25 "$@"
