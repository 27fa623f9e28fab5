#!/usr/bin/env bash
# The binaries on CPUs this machine is not: qemu's user-mode emulator (apt qemu-user) answers CPUID as the
# CPU model it is given, so a program sees an AVX2-only or a pre-AVX2 CPU whatever the host is.
#  1. CPUs below x86-64-v3 (Nehalem: SSE4.2; Sandy Bridge: AVX without AVX2): every program we ship exits
#     with status 1 and says what the CPU lacks (engine/cpu_guard.cc), instead of dying of SIGILL.
#  2. AVX2 CPUs without AVX-512 (Intel Haswell, AMD EPYC Rome): oneDNN and the engine's own dispatch both
#     choose avx2 by themselves (no cap), and greedy generation gives the bits that this host gives with both
#     capped to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2 QKV_MAX_ISA=avx2), in one prefill chunk and in chunks of 7
#     tokens, on bf16 weights with a bf16 KV cache and on Q4_K weights with an int8 KV cache. So the caps the
#     isa_* tests use stand for a real AVX2 CPU, and nothing the cap does not cover (an AVX-512 instruction
#     outside the dispatch) runs there: the emulator would stop it. Then the isa_AVX2 test's engine checks
#     run on the emulated Haswell (~2 minutes).
# Usage: emulated_cpu_test.sh BIN_DIR REPO_ROOT. Without qemu-x86_64 it exits 77 (ctest: skipped).
set -euo pipefail
bin=$1
root=$2
command -v qemu-x86_64 > /dev/null || {
  echo "emulated CPUs: skipped, qemu-x86_64 is not installed (apt-get install qemu-user)"
  exit 77
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# qemu warns on stderr about CPUID bits its emulator leaves out (TSX, PCID, ...): not ours.
emu() {
  local cpu=$1 rc=0
  shift
  qemu-x86_64 -cpu "$cpu" "$@" 2> "$work/qemu.err" || rc=$?
  grep -v "TCG doesn't support requested feature" "$work/qemu.err" >&2 || true
  return "$rc"
}
fail=0

for cpu in Nehalem SandyBridge; do
  for prog in qkvserve qkvctl qkv-run qkv-model qkv-bench qkv-bench-engine; do
    rc=0
    emu "$cpu" "$bin/$prog" --help > /dev/null 2> "$work/err" || rc=$?
    if [ "$rc" -ne 1 ] || ! grep -q "this CPU lacks .*AVX2.*needs an x86-64-v3 CPU" "$work/err"; then
      echo "FAIL $cpu $prog: exit $rc, stderr: $(head -c 300 "$work/err")"
      fail=1
    fi
  done
  echo "$cpu: every program refuses with: $(grep -o 'this CPU lacks [^.]*' "$work/err")"
done

"$bin/qkv-model" random --config "$root/models/configs/demo.json" --arch llama --dtype q4_k --seed 3 \
  --out "$work/q4k.gguf" > /dev/null
tokens=$(seq -s, 3 2 121)
# NAME MODEL KV_DTYPE: the host's reference, both levels capped to AVX2
cases=("bf16 $root/models/kjv-qwen3-4m.gguf bf16" "q4k $work/q4k.gguf int8")
for c in "${cases[@]}"; do
  read -r name model kv <<< "$c"
  ONEDNN_MAX_CPU_ISA=AVX2 QKV_MAX_ISA=avx2 "$bin/qkv-run" --model "$model" --kv-dtype "$kv" --tokens "$tokens" \
    -n 12 --temperature 0 --logits "$work/$name.ref.prompt" --gen-logits "$work/$name.ref.gen" > "$work/$name.ref.txt" 2> "$work/$name.ref.err"
done
for cpu in Haswell-v4 EPYC-Rome; do
  got=$(emu "$cpu" "$bin/qkv-model" cpu)
  [ "$got" = avx2 ] || { echo "FAIL $cpu: oneDNN runs at '$got', not avx2"; fail=1; }
  for c in "${cases[@]}"; do
    read -r name model kv <<< "$c"
    for chunk in 512 7; do
      out=$work/$name.$cpu.$chunk
      emu "$cpu" "$bin/qkv-run" --model "$model" --kv-dtype "$kv" --tokens "$tokens" -n 12 --temperature 0 \
        --max-batch-tokens "$chunk" --logits "$out.prompt" --gen-logits "$out.gen" --log-level info \
        > "$out.txt" 2> "$out.err"
      if ! grep -q "own kernels avx2" "$out.err"; then
        echo "FAIL $cpu $name: the engine's dispatch did not choose avx2: $(grep 'gemm:' "$out.err")"
        fail=1
      fi
      if cmp -s "$out.prompt" "$work/$name.ref.prompt" && cmp -s "$out.gen" "$work/$name.ref.gen" &&
        cmp -s "$out.txt" "$work/$name.ref.txt"; then
        echo "$cpu $name (kv $kv, prefill chunks of $chunk): the same bits as this host capped to AVX2"
      else
        echo "FAIL $cpu $name (kv $kv, prefill chunks of $chunk): logits or text differ from this host capped to AVX2"
        cat "$out.err"
        fail=1
      fi
    done
  done
done
# The isa_AVX2 test's engine checks on the emulated Haswell, uncapped (its linear_test is left out: 12 minutes
# under the emulator; the server's same-bits check too): row independence of the quantized GEMM, cache vs
# recompute, causality, chunking, batch invariance, session equivalence.
for t in "quant_test QuantLinear.*" "model_test *CacheMatchesRecompute*:*Causality*:*Chunking*" \
  "engine_test *BatchInvariance*:*SessionEquivalence*"; do
  read -r prog filter <<< "$t"
  if emu Haswell-v4 "$bin/$prog" --gtest_brief=1 --gtest_filter="$filter" > "$work/gtest.log" 2>&1; then
    echo "Haswell-v4 $prog $filter: $(grep -o 'PASSED.*' "$work/gtest.log")"
  else
    echo "FAIL Haswell-v4 $prog $filter:"
    grep -v '^\[[0-9-]* [0-9:.]*\] \[' "$work/gtest.log" | tail -30
    fail=1
  fi
done
[ "$fail" -eq 0 ] && echo "emulated CPUs: pre-AVX2 CPUs refused clearly; AVX2 CPUs give the capped host's bits"
exit "$fail"
