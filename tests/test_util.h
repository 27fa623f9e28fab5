// Helpers shared by the unit tests: temporary files and small random models.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/kernels/cpu.h"
#include "engine/model_config.h"
#include "engine/random_model.h"

namespace qkv::testing {

// A fresh directory of this process under $TMPDIR (or /tmp), removed at exit. Tests write their files here,
// never straight into /tmp: a shared path races with another test process, and tools/test.sh fails a run
// that leaves files behind.
std::string TempDir();
// A file's bytes (empty when it cannot be read), and writing them (false when it cannot be written whole).
std::vector<uint8_t> ReadAll(const std::string& path);
bool WriteAll(const std::string& path, const std::vector<uint8_t>& bytes);
// The VmFlags of the mapping that holds p in /proc/self/smaps (e.g. "rd wr mr mw me ac hg"; "hg": advised for
// transparent huge pages), or "" when no mapping holds it.
std::string VmFlagsOf(const void* p);
// A small model config (GQA 2:1 by default; deepseek2: MLA with a low-rank query path) for tests.
ModelConfig SmallConfig(Arch arch = Arch::kLlama);
// Writes a random model for cfg and returns its path.
std::string WriteModel(const ModelConfig& cfg, const std::string& name, uint64_t seed = 1,
                       GgmlType dtype = GgmlType::kF32);

// Restores the process's kernel level (kernels/cpu.h) when a test that switches levels ends, also early.
struct KernelLevelGuard {
  KernelIsa saved = ActiveKernelIsa();
  ~KernelLevelGuard() { SetKernelIsaForTesting(saved); }
};

}  // namespace qkv::testing
