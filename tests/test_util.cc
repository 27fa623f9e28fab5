#include "tests/test_util.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

namespace qkv::testing {

std::string TempDir() {
  static std::string dir = [] {
    const char* env = std::getenv("TMPDIR");  // tools/test.sh gives each run its own
    const std::string base = env && *env ? env : "/tmp";
    std::string tmpl = base + "/qkvtest.XXXXXX";
    const char* d = mkdtemp(tmpl.data());
    EXPECT_NE(d, nullptr);
    if (d == nullptr) return base;  // never removed: not ours
    static struct Cleanup {
      std::string path;
      ~Cleanup() { std::filesystem::remove_all(path); }
    } cleanup{d};
    return std::string(d);
  }();
  return dir;
}

std::vector<uint8_t> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool WriteAll(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  return static_cast<bool>(out);
}

ModelConfig SmallConfig(Arch arch) {
  ModelConfig c;
  c.arch = arch;
  c.hidden = 96;
  c.n_layers = 2;
  c.n_heads = 6;
  c.n_kv_heads = 3;
  c.head_dim = 16;
  c.rotary_dim = 16;
  c.ffn = 160;
  c.vocab = 400;
  c.context_length = 256;
  c.qk_norm = arch == Arch::kQwen3 || arch == Arch::kQwen3Moe;
  c.attention_bias = arch == Arch::kQwen2;
  if (arch == Arch::kQwen3Moe) {  // 8 experts of 48, 2 per token
    c.moe.n_experts = 8;
    c.moe.n_used = 2;
    c.moe.expert_ffn = 48;
    c.moe.norm_weights = true;
  }
  if (arch == Arch::kQwen35) {  // a Gated DeltaNet layer, then gated attention with q/k norms and partial rotary
    c.recurrent = {true, false};
    c.linear = {/*conv_kernel=*/4, /*n_k_heads=*/2, /*n_v_heads=*/4, /*k_dim=*/16, /*v_dim=*/12};
    c.attn_output_gate = c.qk_norm = true;
    c.rotary_dim = 8;
  }
  if (arch == Arch::kDeepseek2) {  // MLA: a latent of 32 and a rope key of 16 per token and layer
    c.mla = {/*q_lora_rank=*/24, /*kv_lora_rank=*/32, /*qk_nope_dim=*/16, /*v_head_dim=*/12, false};
    c.n_kv_heads = 1;
    c.head_dim = c.mla.kv_lora_rank + c.rotary_dim;
    c.n_dense_lead = c.n_layers;
  }
  return c;
}

std::string WriteModel(const ModelConfig& cfg, const std::string& name, uint64_t seed, GgmlType dtype) {
  const std::string path = TempDir() + "/" + name + ".gguf";
  const Status s = WriteRandomModel(cfg, {dtype, seed, "", {}}, path);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return path;
}

std::string VmFlagsOf(const void* p) {
  std::ifstream in("/proc/self/smaps");
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    unsigned long long lo = 0, hi = 0;
    char dash = 0;
    if (std::istringstream(line) >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = a >= lo && a < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.substr(8);
    }
  }
  return "";
}

}  // namespace qkv::testing
