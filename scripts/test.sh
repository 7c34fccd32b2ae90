#!/usr/bin/env bash
# Everything the tests need, from nothing, then the whole suite. This is the README's test command
# and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check edge_sd tests benchmarks
.venv/bin/python -m pytest -q "$@"
