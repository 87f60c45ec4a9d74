#!/usr/bin/env bash
# Quick start, tests: install (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# two workers (pytest-xdist): the suite takes about 5 minutes on 2 cores instead of about 10
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 "$@"
