// The refusal a CPU below x86-64-v3 gets instead of SIGILL.
//
// Everything else in the project is compiled for x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE; see the
// top-level CMakeLists.txt), so on an older CPU, or under an emulator that does not expose AVX2 (qemu's default
// CPU model, Docker's amd64 emulation on ARM hosts), the first vector instruction would kill the process with
// "Illegal instruction" and no word of why. This file alone is compiled for baseline x86-64 and runs before
// any other constructor of the program (priority 101, the first one a program may use): it checks the CPU and
// exits with status 1 and a message naming what is missing. Every executable links it (qkv_cpu_guard).
#include <cpuid.h>
#include <errno.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace {

// CPUID bits (Intel SDM vol. 2, CPUID): GCC and clang do not share __builtin_cpu_supports' feature names
// (clang 14 has no "x86-64-v3", "f16c", "lzcnt" or "movbe"), so the bits are read directly.
bool Bit(unsigned reg, int bit) { return (reg >> bit) & 1u; }

__attribute__((constructor(101))) void RequireX86_64V3() {
  unsigned a = 0, b = 0, c1 = 0, d = 0, b7 = 0, c7 = 0, cx = 0;
  __get_cpuid(1, &a, &b, &c1, &d);
  __get_cpuid_count(7, 0, &a, &b7, &c7, &d);
  __get_cpuid(0x80000001u, &a, &b, &cx, &d);
  // AVX is usable only when the OS saves the YMM state: OSXSAVE, then XCR0's SSE and AVX bits.
  bool ymm = false;
  if (Bit(c1, 27)) {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    ymm = (lo & 6u) == 6u;
  }
  struct Feature {
    const char* name;
    bool present;
  };
  const Feature features[] = {
      {"AVX", Bit(c1, 28) && ymm},  {"AVX2", Bit(b7, 5) && ymm}, {"FMA", Bit(c1, 12) && ymm},
      {"F16C", Bit(c1, 29) && ymm}, {"BMI1", Bit(b7, 3)},        {"BMI2", Bit(b7, 8)},
      {"LZCNT", Bit(cx, 5)},        {"MOVBE", Bit(c1, 22)},
  };
  bool all = true;
  for (const Feature& f : features) all = all && f.present;
  if (all) return;
  char missing[128] = "";
  int used = 0;
  for (const Feature& f : features) {
    if (f.present || used >= static_cast<int>(sizeof missing)) continue;
    used += std::snprintf(missing + used, sizeof missing - used, "%s%s", used ? ", " : "", f.name);
  }
  std::fprintf(stderr,
               "%s: this CPU lacks %s. qkvserve needs an x86-64-v3 CPU (AVX2 and FMA: Intel Haswell, AMD Zen or "
               "newer); under an emulator, give it such a CPU model (e.g. qemu -cpu Haswell).\n",
               program_invocation_short_name, missing);
  std::fflush(stderr);
  _exit(1);
}

}  // namespace
