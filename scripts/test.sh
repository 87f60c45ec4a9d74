#!/usr/bin/env bash
# The test suite: install fxtools with its test dependencies if needed (the active environment, else
# .venv: scripts/setup.sh), then run pytest on two workers (pytest-xdist). Arguments go to pytest.
# --dist loadgroup: the groups of tests/conftest.py (an expensive table, Inductor compiles) run on
# one worker, the largest group first; the other tests go one at a time to whichever worker is free.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh test)
"$PY" -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -rs --durations=25 "$@"
