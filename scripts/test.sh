#!/usr/bin/env bash
# The test suite: install fxtools with its test dependencies if needed (the active environment, else
# .venv: scripts/setup.sh), then run pytest on two workers (pytest-xdist). Arguments go to pytest.
# --dist loadgroup: the groups of tests/conftest.py (an expensive table, Inductor compiles) run on
# one worker, the largest group first; the other tests go one at a time to whichever worker is free.
# OMP_NUM_THREADS=1: one thread per worker. Two workers of two threads each on two cores spin in
# OpenMP's barriers while a partner waits for a core: the same tests took 4 to 23% less CPU with
# one thread (docs/tests.md); they compare with eager in the same process, so they hold at any count.
set -euo pipefail
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh test)
"$PY" -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -rs --durations=25 "$@"
