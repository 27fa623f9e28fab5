// The instruction-set level the engine's own kernels (packed, quantized and AMX GEMMs, attention) dispatch to
// at run time. The binary is compiled for x86-64-v3 (AVX2 + FMA); functions for higher levels carry a target
// attribute and are called only when the CPU (and the OS, for the 512-bit state) supports them.
//
// Levels, lowest first:
//   avx2         AVX2 + FMA (the build's baseline)
//   avx512       AVX-512 F, BW, DQ, VL (x86-64-v4: Skylake-SP and later, Zen 4 and later)
//   avx512_vnni  avx512 + VNNI integer dot products (Cascade Lake and later, Zen 4 and later)
//   avx512_bf16  avx512_vnni + AVX512_BF16 dot products (Cooper Lake, Sapphire Rapids and later, Zen 4 and
//                later): bf16 weights run on the packed GEMM's bf16 form (kernels/packed_gemm.h)
//   amx          avx512_bf16 + AMX-BF16 tiles, with the kernel's permission to use them (Sapphire Rapids and
//                later): bf16 weights run on the AMX GEMM (kernels/amx_gemm.h)
// QKV_MAX_ISA=avx2|avx512|avx512_vnni|avx512_bf16|amx caps the level the way ONEDNN_MAX_CPU_ISA caps oneDNN
// (per process, read once); a level above what the CPU has is the CPU's level. The f32 form of the packed
// GEMM, the quantized GEMM and the GQA attention give the same bits at every level (the wider kernels run
// the same operations per output in the same order), which tests/linear_test.cc, tests/quant_test.cc and
// tests/attention_test.cc check on whatever CPU runs them; MLA attention's scores are 16-lane dot products at
// the AVX-512 levels, and bf16 weights run on other GEMMs at avx512_bf16 and amx (other bits than below, the
// same at every M and chunking within a level; kernels/mla_attention.h, kernels/packed_gemm.h).
#pragma once

#include <string>

#include "engine/status.h"

// The target attributes of the levels' functions (the x86-64-v4 subset, with VNNI, with VNNI and BF16).
#define QKV_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define QKV_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define QKV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16")))

namespace qkv {

enum class KernelIsa { kAvx2 = 0, kAvx512 = 1, kAvx512Vnni = 2, kAvx512Bf16 = 3, kAmx = 4 };

const char* KernelIsaName(KernelIsa isa);
// What this CPU supports, ignoring the cap.
KernelIsa CpuKernelIsa();
// The level in use: the CPU's, capped by QKV_MAX_ISA. Fails when QKV_MAX_ISA is not a level's name.
StatusOr<KernelIsa> KernelIsaFromEnv();
// The level in use (QKV_MAX_ISA must have been validated by KernelIsaFromEnv; an invalid value counts as
// no cap here).
KernelIsa ActiveKernelIsa();
// Test hook: sets the level for this process, at most the CPU's (tests/test_util.h restores it).
void SetKernelIsaForTesting(KernelIsa isa);

// The CPUs this process may use, which is what the compute team's size should be (a decoded token's
// barriers spin for their team: two threads on one core decode the 0.4B benchmark model 2.6× slower than one;
// docs/engine.md, "Threads"). std::thread::hardware_concurrency() counts the online CPUs and sees neither
// limit below; the quota comes from engine/cgroup.h.
struct CpuBudget {
  int online_cpus = 1;    // CPUs online in the machine (or the VM)
  int affinity_cpus = 1;  // CPUs in the affinity mask (taskset, docker --cpuset-cpus, Kubernetes' static CPU manager)
  double quota_cpus = 0;  // the tightest cgroup CPU quota (docker --cpus, Kubernetes CPU limits), in CPUs; 0: none
  int threads = 1;        // ThreadsFor(affinity_cpus, quota_cpus)
  // "affinity mask: 1 of 2 online CPUs; cgroup CPU quota: none"
  std::string Describe() const;
};
CpuBudget AvailableCpus();
// The compute team's size for a --threads flag: `requested` when > 0, else AvailableCpus().threads (at most
// 256, the engine's limit). Logs the choice (info), and warns when `requested` is more than the CPUs this
// process may use.
int ComputeThreads(int requested);
// The affinity mask's CPUs, capped by the quota rounded to the nearest CPU, halves up; at least 1. Measured
// on the 0.4B benchmark model (docs/engine.md): under a quota of 1 CPU two threads decode ~35% slower than
// one; under 1.5 CPUs two threads prefill ~30% faster than one and decode within ~5% of it.
int ThreadsFor(int affinity_cpus, double quota_cpus);

// Whether decode attention asks for its K/V lines into L2 (prefetcht1) rather than L1 (prefetcht0). Which is
// faster depends on the core (docs/performance.md, "Decode prefetch into L2 on a Zen 4"): L2 on AMD Zen 4
// (family 0x19 with AVX-512), where L1 asks filled the miss buffers the loads wait on; L1 elsewhere (measured on
// Zen 5). QKV_KV_PREFETCH=l1|l2 overrides; KvPrefetchL2FromEnv fails on any other value. The bits never depend
// on it (a prefetch computes nothing).
StatusOr<bool> KvPrefetchL2FromEnv();
// The choice in use (an invalid QKV_KV_PREFETCH counts as unset here).
bool KvPrefetchL2();

}  // namespace qkv
