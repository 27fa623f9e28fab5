#include "engine/kernels/cpu.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

namespace qkv {
namespace {

// AMX-TILE and AMX-BF16 in CPUID, the tile state enabled by the OS (XCR0 bits 17 and 18), and Linux's
// permission for this process to use it (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, which is
// what oneDNN asks for too; without it the first tile instruction faults).
bool AmxUsable() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
  if (!tile || !bf16) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv is usable
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

int Detect() {
  __builtin_cpu_init();
  const bool v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (!v4) return static_cast<int>(KernelIsa::kAvx2);
  if (!__builtin_cpu_supports("avx512vnni")) return static_cast<int>(KernelIsa::kAvx512);
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool bf16 = __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);  // CPUID.(7,1):EAX.AVX512_BF16
  if (!bf16) return static_cast<int>(KernelIsa::kAvx512Vnni);
  return static_cast<int>(AmxUsable() ? KernelIsa::kAmx : KernelIsa::kAvx512Bf16);
}

StatusOr<KernelIsa> Parse(const char* v) {
  const std::string s = v ? v : "";
  if (s.empty()) return CpuKernelIsa();
  for (KernelIsa i :
       {KernelIsa::kAvx2, KernelIsa::kAvx512, KernelIsa::kAvx512Vnni, KernelIsa::kAvx512Bf16, KernelIsa::kAmx}) {
    if (s == KernelIsaName(i)) return std::min(i, CpuKernelIsa());
  }
  return InvalidArgument("QKV_MAX_ISA must be avx2, avx512, avx512_vnni, avx512_bf16 or amx, got '" + s + "'");
}

// -1: not decided yet.
std::atomic<int> g_active{-1};

}  // namespace

const char* KernelIsaName(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAvx2: return "avx2";
    case KernelIsa::kAvx512: return "avx512";
    case KernelIsa::kAvx512Vnni: return "avx512_vnni";
    case KernelIsa::kAvx512Bf16: return "avx512_bf16";
    case KernelIsa::kAmx: return "amx";
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

StatusOr<bool> KvPrefetchL2FromEnv() {
  const char* v = std::getenv("QKV_KV_PREFETCH");
  const std::string s = v ? v : "";
  if (s == "l1") return false;
  if (s == "l2") return true;
  if (!s.empty()) return InvalidArgument("QKV_KV_PREFETCH must be l1 or l2, got '" + s + "'");
  // Read once: every Linear validates the variable, and cpuid traps to the hypervisor on a VM.
  static const bool zen4 = [] {
    // AMD family 0x19 (Zen 3 and Zen 4) with AVX-512: Zen 4.
    __builtin_cpu_init();
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__builtin_cpu_is("amd") || !__get_cpuid(1, &a, &b, &c, &d)) return false;
    const unsigned family = ((a >> 8) & 0xF) + ((a >> 20) & 0xFF);
    return family == 0x19 && __builtin_cpu_supports("avx512f");
  }();
  return zen4;
}

bool KvPrefetchL2() {
  static const bool l2 = [] {
    auto parsed = KvPrefetchL2FromEnv();
    return parsed.ok() && *parsed;
  }();
  return l2;
}

}  // namespace qkv
