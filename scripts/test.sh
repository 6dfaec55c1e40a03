#!/usr/bin/env bash
# The whole check: lint, format, tests. Arguments go to pytest (e.g. `-m slow`, `-k store`).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/pytest "$@"
