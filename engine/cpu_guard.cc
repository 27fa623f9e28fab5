// The refusal a CPU below x86-64-v3 gets instead of SIGILL.
//
// Everything else in the project is compiled for x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE; see the
// top-level CMakeLists.txt), so on an older CPU, or under an emulator that does not expose AVX2 (qemu's default
// CPU model, Docker's amd64 emulation on ARM hosts), the first vector instruction would kill the process with
// "Illegal instruction" and no word of why. This file alone is compiled for baseline x86-64 and runs before
// any other constructor of the program (priority 101, the first one a program may use): it checks the CPU and
// exits with status 1 and a message naming what is missing. Every executable links it (qkv_cpu_guard).
#include <errno.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace {

__attribute__((constructor(101))) void RequireX86_64V3() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v3")) return;
  struct Feature {
    const char* name;
    bool present;
  };
  const Feature features[] = {
      {"AVX", static_cast<bool>(__builtin_cpu_supports("avx"))},
      {"AVX2", static_cast<bool>(__builtin_cpu_supports("avx2"))},
      {"FMA", static_cast<bool>(__builtin_cpu_supports("fma"))},
      {"F16C", static_cast<bool>(__builtin_cpu_supports("f16c"))},
      {"BMI1", static_cast<bool>(__builtin_cpu_supports("bmi"))},
      {"BMI2", static_cast<bool>(__builtin_cpu_supports("bmi2"))},
      {"LZCNT", static_cast<bool>(__builtin_cpu_supports("lzcnt"))},
      {"MOVBE", static_cast<bool>(__builtin_cpu_supports("movbe"))},
  };
  char missing[128] = "";
  int used = 0;
  for (const Feature& f : features) {
    if (f.present || used >= static_cast<int>(sizeof missing)) continue;
    used += std::snprintf(missing + used, sizeof missing - used, "%s%s", used ? ", " : "", f.name);
  }
  std::fprintf(stderr,
               "%s: this CPU lacks %s. qkvserve needs an x86-64-v3 CPU (AVX2 and FMA: Intel Haswell, AMD Zen or "
               "newer); under an emulator, give it such a CPU model (e.g. qemu -cpu Haswell).\n",
               program_invocation_short_name, used ? missing : "an x86-64-v3 feature");
  std::fflush(stderr);
  _exit(1);
}

}  // namespace
