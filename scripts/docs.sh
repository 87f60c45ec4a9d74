#!/usr/bin/env bash
# Build the documentation site (docs/, mkdocs.yml) into site/, strictly: a warning (a broken link,
# a docstring mkdocstrings cannot read) fails the build. Installs the docs extra if needed.
# To preview while editing: mkdocs serve
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh docs)
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict "$@"  # (the variable quiets a banner about a future MkDocs)
