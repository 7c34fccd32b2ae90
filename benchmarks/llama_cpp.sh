#!/usr/bin/env bash
# Build llama.cpp's command-line tools (llama-bench, llama-completion, llama-speculative-simple,
# llama-perplexity, llama-tokenize, llama-quantize) from the sources vendored in the llama-cpp-python
# sdist on PyPI, for the side-by-side benchmarks (benchmarks/llama_cpp.py), the tokenizer check
# (benchmarks/gguf_tokenizer.py) and the GGUF comparison (benchmarks/gguf_architectures.py).
# Optional: never part of the set-up or the tests. About 10 minutes on 2 cores; a second run reuses
# the build.
#
#   bash benchmarks/llama_cpp.sh            # prints the folder holding the binaries
#
# Environment: EDGE_SD_CACHE (default ~/.cache/edge-sd), LLAMA_CPP_PYTHON (the sdist's version).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
CACHE=${EDGE_SD_CACHE:-$HOME/.cache/edge-sd}
ROOT="$CACHE/llama.cpp/$VERSION"
TOOLS="llama-bench llama-completion llama-speculative-simple llama-perplexity llama-tokenize llama-quantize"
# Native code, less AMX: virtual machines can list AMX among the CPU's features while its tile
# instructions trap (seen on a Sapphire Rapids VM: llama.cpp died with SIGILL at its first matmul).
FLAGS=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  FLAGS+=("-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
fi
if [ -x "$ROOT/build/bin/llama-speculative-simple" ] && [ -x "$ROOT/build/bin/llama-tokenize" ] \
    && [ -x "$ROOT/build/bin/llama-quantize" ] \
    && [ "$(cat "$ROOT/build/.flags" 2>/dev/null)" = "${FLAGS[*]}" ]; then
  echo "$ROOT/build/bin"
  exit 0
fi
command -v cmake >/dev/null || { echo "llama_cpp.sh needs cmake and a C++ compiler" >&2; exit 1; }
mkdir -p "$ROOT"
if [ ! -f "$ROOT/src/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$tmp" >&2
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  rm -rf "$ROOT/src"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$ROOT/src"
  rm -rf "$tmp"
fi
echo "==> building $TOOLS (llama.cpp from llama-cpp-python $VERSION; about 10 minutes on 2 cores)" >&2
cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "${FLAGS[@]}" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
# shellcheck disable=SC2086
cmake --build "$ROOT/build" --config Release -j "$(nproc)" --target $TOOLS >&2
echo "${FLAGS[*]}" > "$ROOT/build/.flags"
echo "$ROOT/build/bin"
