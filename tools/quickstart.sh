#!/usr/bin/env bash
# Builds qkvserve and generates text from a demo model. Until the bundled model lands (issue 7), the demo
# model is a random-weight llama-shaped model written by qkv-model, so the text is noise by design.
# Usage: bash tools/quickstart.sh [--prompt TEXT] [qkv-run options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh >/dev/null
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
model=build/models/demo-random-llama.gguf
if [ ! -f "$model" ]; then
  mkdir -p build/models
  build/bin/qkv-model random --config models/configs/demo.json --out "$model" --arch llama --dtype bf16 --seed 1
fi
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--prompt "Once upon a time" -n 48 --seed 1)
exec build/bin/qkv-run --model "$model" "${args[@]}"
