#!/usr/bin/env bash
# Quick start, main job: install (if needed) and run `fxtools demo` on the built-in examples.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/fxtools demo "$@"
