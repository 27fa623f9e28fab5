#include "engine/kernels/cpu.h"

#include <cpuid.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "engine/cgroup.h"

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

int ThreadsFor(int affinity_cpus, double quota_cpus) {
  int t = std::max(1, affinity_cpus);
  if (quota_cpus > 0) t = std::min(t, std::max(1, static_cast<int>(std::floor(quota_cpus + 0.5))));
  return t;
}

CpuBudget AvailableCpus() {
  CpuBudget b;
  b.online_cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  b.affinity_cpus = b.online_cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) b.affinity_cpus = std::max(1, CPU_COUNT(&set));
  b.quota_cpus = CgroupCpuQuota(ProcSelfCgroup(), CgroupRoot());
  b.threads = ThreadsFor(b.affinity_cpus, b.quota_cpus);
  return b;
}

int ComputeThreads(int requested) {
  const CpuBudget cpus = AvailableCpus();
  if (requested <= 0) {
    const int threads = std::min(cpus.threads, 256);  // the engine's limit (Model::Load)
    spdlog::info("compute threads: {}, the CPUs this process may use ({})", threads, cpus.Describe());
    return threads;
  }
  if (requested > cpus.threads) {
    spdlog::warn(
        "--threads {} is more than the {} CPU(s) this process may use ({}): the threads take turns on the "
        "cores and each barrier of a step waits for one that is not running (two threads on one core decode "
        "~2.6x slower than one)",
        requested, cpus.threads, cpus.Describe());
  } else {
    spdlog::info("compute threads: {} (--threads; this process may use {}: {})", requested, cpus.threads,
                 cpus.Describe());
  }
  return requested;
}

std::string CpuBudget::Describe() const {
  char quota[64] = "none";
  if (quota_cpus > 0) std::snprintf(quota, sizeof quota, "%.2f CPUs", quota_cpus);
  return "affinity mask: " + std::to_string(affinity_cpus) + " of " + std::to_string(online_cpus) +
         " online CPUs; cgroup CPU quota: " + quota;
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
