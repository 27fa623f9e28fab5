#!/usr/bin/env bash
# Same bits at one instruction-set level: oneDNN is capped to LEVEL (ONEDNN_MAX_CPU_ISA, per process) and
# the row-independence, chunking, cache-identity, batch-invariance and server same-bits checks run under it.
# A level this CPU does not reach exits 77, which ctest reports as skipped (not passed).
# Usage: isa_level_test.sh LEVEL BIN_DIR   (LEVEL: AVX2, AVX512_CORE, AVX512_CORE_VNNI, AVX512_CORE_BF16,
# AVX512_CORE_AMX)
set -euo pipefail
level=$1
bin=$2
here=$(cd "$(dirname "$0")" && pwd)
rank() {
  case $1 in
    avx2 | avx2_vnni) echo 1 ;; avx512_core) echo 2 ;; avx512_core_vnni) echo 3 ;;
    avx512_core_bf16) echo 4 ;; avx512_core_amx) echo 5 ;; *) echo 0 ;;
  esac
}
want=$(rank "${level,,}")
[ "$want" -gt 0 ] || { echo "unknown level $level"; exit 2; }
got=$(ONEDNN_MAX_CPU_ISA=$level "$bin/qkv-model" cpu)
if [ "$(rank "$got")" -lt "$want" ]; then
  echo "isa $level: skipped, this CPU reaches only $got"
  exit 77
fi
# The engine's own kernels are capped to the same class of CPU (kernels/cpu.h): AVX2 machines have no
# AVX-512; AVX512_CORE ones (Skylake-SP) have no VNNI; AVX512_CORE_VNNI ones (Cascade/Ice Lake) no BF16;
# AVX512_CORE_BF16 ones run bf16 weights on the packed GEMM's bf16 form, AMX ones on the AMX GEMM.
case $level in
  AVX2) kernels=avx2 ;; AVX512_CORE) kernels=avx512 ;; AVX512_CORE_VNNI) kernels=avx512_vnni ;;
  AVX512_CORE_BF16) kernels=avx512_bf16 ;; AVX512_CORE_AMX) kernels=amx ;;
esac
export ONEDNN_MAX_CPU_ISA=$level QKV_MAX_ISA=$kernels OMP_WAIT_POLICY=PASSIVE QKV_BIN=$bin
echo "isa $level: oneDNN runs at $got; own kernels capped to $kernels"
"$bin/linear_test" --gtest_brief=1
"$bin/quant_test" --gtest_brief=1 --gtest_filter='QuantLinear.*'
"$bin/model_test" --gtest_brief=1 --gtest_filter='*CacheMatchesRecompute*:*Causality*:*Chunking*'
"$bin/engine_test" --gtest_brief=1 --gtest_filter='*BatchInvariance*:*SessionEquivalence*:*Pressure*'
/usr/bin/python3 "$here/integration/test_same_bits.py"
echo "isa $level: same bits at every M, chunking, batch composition and cache path"
