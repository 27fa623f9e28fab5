#!/usr/bin/env bash
# Installs dependencies, builds everything, and starts qkvserve on the bundled model (models/*.gguf) on
# 127.0.0.1:50051 with /metrics on 127.0.0.1:9464. Extra arguments go to qkvserve.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh >/dev/null
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
exec build/bin/qkvserve "$@"
