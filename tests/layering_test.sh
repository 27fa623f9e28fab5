#!/usr/bin/env bash
# The engine's layers (engine/CMakeLists.txt): every file under engine/ may include engine headers of its
# own layer and of the layers listed below for it, nothing else; and nothing in engine/ includes gRPC.
# Usage: layering_test.sh [REPO_ROOT]
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
layer_of() {
  case $1 in
    engine/status.* | engine/cpu_guard.cc | engine/cgroup.* | engine/dtype.* | engine/bf16.* | engine/rng.* | engine/utf8.h | engine/quant.* | engine/linear_attn.h) echo base ;;
    engine/capacity_plan.*) echo plan ;;
    engine/gguf.* | engine/quantize.* | engine/model_config.* | engine/tokenizer* | engine/unicode_nfc* | engine/chat_template.* | \
      engine/random_model.*) echo formats ;;
    engine/kernels/* | engine/kv_cache.*) echo kernels ;;
    engine/model.* | engine/layers/*) echo model ;;
    engine/block_manager.* | engine/request.* | engine/sampler.* | engine/text_stream.* | engine/scheduler.* | \
      engine/output_processor.* | engine/request_limits.* | \
      engine/engine.* | engine/sequence.h) echo serving ;;
    *) echo unknown ;;
  esac
}
declare -A allowed=(
  [base]="base" [plan]="base plan" [formats]="base formats" [kernels]="base kernels"
  [model]="base formats kernels model" [serving]="base plan formats kernels model serving"
)
bad=0
checked=0
for f in $(git ls-files 'engine/*.h' 'engine/*.cc'); do
  l=$(layer_of "$f")
  if [ "$l" = unknown ]; then
    echo "layering: $f belongs to no layer (add it to tests/layering_test.sh and engine/CMakeLists.txt)"
    bad=$((bad + 1))
    continue
  fi
  while read -r inc; do
    il=$(layer_of "$inc")
    if ! grep -qw "$il" <<<"${allowed[$l]}"; then
      echo "layering: $f ($l) includes $inc ($il)"
      bad=$((bad + 1))
    fi
    checked=$((checked + 1))
  done < <(sed -n 's|^#include "\(engine/[^"]*\)".*|\1|p' "$f")
  if grep -q '#include <grpc' "$f"; then
    echo "layering: $f includes gRPC"
    bad=$((bad + 1))
  fi
done
echo "layering: $checked includes checked, $bad violations"
[ $bad -eq 0 ]
