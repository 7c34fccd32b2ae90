#!/usr/bin/env bash
# Everything the tests need, from nothing, then the whole suite. This is the README's test command
# and what CI runs (.ci/run). The exported real pair is kept in the cache (EDGE_SD_CACHE), so a second
# run on the same machine exports nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
CACHE=${EDGE_SD_CACHE:-$HOME/.cache/edge-sd}
export EDGE_SD_REAL_PAIR=${EDGE_SD_REAL_PAIR:-$CACHE/pairs/gemma3-270m_smollm2-135m}
bash scripts/prepare_real_pair.sh "$EDGE_SD_REAL_PAIR" --hf
.venv/bin/python -m ruff check edge_sd tests benchmarks
.venv/bin/python -m mypy
.venv/bin/python -m pytest -q "$@"
