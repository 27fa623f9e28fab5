#include "engine/kernels/cpu.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>

namespace qkv {
namespace {

int Detect() {
  __builtin_cpu_init();
  const bool v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (!v4) return static_cast<int>(KernelIsa::kAvx2);
  return static_cast<int>(__builtin_cpu_supports("avx512vnni") ? KernelIsa::kAvx512Vnni : KernelIsa::kAvx512);
}

StatusOr<KernelIsa> Parse(const char* v) {
  const std::string s = v ? v : "";
  if (s.empty()) return CpuKernelIsa();
  for (KernelIsa i : {KernelIsa::kAvx2, KernelIsa::kAvx512, KernelIsa::kAvx512Vnni}) {
    if (s == KernelIsaName(i)) return std::min(i, CpuKernelIsa());
  }
  return InvalidArgument("QKV_MAX_ISA must be avx2, avx512 or avx512_vnni, got '" + s + "'");
}

// -1: not decided yet.
std::atomic<int> g_active{-1};

}  // namespace

const char* KernelIsaName(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAvx2: return "avx2";
    case KernelIsa::kAvx512: return "avx512";
    case KernelIsa::kAvx512Vnni: return "avx512_vnni";
  }
  return "?";
}

KernelIsa CpuKernelIsa() {
  static const int cpu = Detect();
  return static_cast<KernelIsa>(cpu);
}

StatusOr<KernelIsa> KernelIsaFromEnv() { return Parse(std::getenv("QKV_MAX_ISA")); }

KernelIsa ActiveKernelIsa() {
  int v = g_active.load(std::memory_order_relaxed);
  if (v < 0) {
    auto parsed = KernelIsaFromEnv();
    v = static_cast<int>(parsed.ok() ? *parsed : CpuKernelIsa());
    g_active.store(v, std::memory_order_relaxed);
  }
  return static_cast<KernelIsa>(v);
}

void SetKernelIsaForTesting(KernelIsa isa) {
  g_active.store(static_cast<int>(std::min(isa, CpuKernelIsa())), std::memory_order_relaxed);
}

}  // namespace qkv
