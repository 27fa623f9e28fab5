// qkv-model: make and inspect model files.
//   qkv-model random --config CONFIG.json --out MODEL.gguf [--arch llama|qwen2|qwen3] [--dtype f32|f16|bf16|q8_0] [--seed N]
//   qkv-model info MODEL.gguf
#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <sstream>

#include "engine/gguf.h"
#include "engine/model_config.h"
#include "engine/random_model.h"
#include "engine/tokenizer.h"

namespace {

int Fail(const qkv::Status& s) {
  std::cerr << "qkv-model: " << s.ToString() << "\n";
  return 1;
}

qkv::StatusOr<qkv::GgmlType> ParseGgmlType(const std::string& s) {
  if (s == "f32") return qkv::GgmlType::kF32;
  if (s == "f16") return qkv::GgmlType::kF16;
  if (s == "bf16") return qkv::GgmlType::kBF16;
  if (s == "q8_0") return qkv::GgmlType::kQ8_0;
  return qkv::InvalidArgument("--dtype must be f32, f16, bf16 or q8_0");
}

int Random(const std::string& config_path, const std::string& out, const std::string& arch_s,
           const std::string& dtype_s, uint64_t seed) {
  std::ifstream in(config_path);
  if (!in) return Fail(qkv::NotFound("cannot read --config '" + config_path + "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto arch = qkv::ParseArch(arch_s);
  if (!arch.ok()) return Fail(arch.status());
  auto cfg = qkv::ModelConfig::FromHfJson(ss.str(), *arch);
  if (!cfg.ok()) return Fail(cfg.status());
  auto dt = ParseGgmlType(dtype_s);
  if (!dt.ok()) return Fail(dt.status());
  qkv::Status s = qkv::WriteRandomModel(*cfg, {*dt, seed}, out);
  if (!s.ok()) return Fail(s);
  std::cout << "wrote " << out << ": " << cfg->Summary() << ", " << cfg->ParameterCount() << " parameters\n";
  return 0;
}

int Info(const std::string& path) {
  auto f = qkv::GgufFile::Open(path);
  if (!f.ok()) return Fail(f.status());
  auto cfg = qkv::ModelConfig::FromGguf(**f);
  if (!cfg.ok()) return Fail(cfg.status());
  uint64_t weight_bytes = 0;
  std::map<std::string, int> types;
  for (const auto& t : (*f)->tensors()) {
    weight_bytes += t.nbytes;
    ++types[qkv::GgmlTypeName(t.type)];
  }
  std::cout << "file:              " << path << " (" << (*f)->file_size() << " bytes, GGUF v" << (*f)->version() << ")\n"
            << "name:              " << (*f)->GetStringOr("general.name", "") << "\n"
            << "architecture:      " << qkv::ArchName(cfg->arch) << "\n"
            << "config:            " << cfg->Summary() << "\n"
            << "attention:         " << cfg->AttentionKind() << " (" << cfg->n_heads << " query heads, "
            << cfg->n_kv_heads << " kv heads)\n"
            << "rope:              " << (qkv::RopeStyleOf(cfg->arch) == qkv::RopeStyle::kInterleaved ? "interleaved pairs" : "halves")
            << ", rotary_dim " << cfg->rotary_dim << " of " << cfg->head_dim << ", theta " << cfg->rope_theta << "\n"
            << "parameters:        " << cfg->ParameterCount() << "\n"
            << "weight bytes:      " << weight_bytes << " (";
  bool first = true;
  for (const auto& [name, n] : types) {
    std::cout << (first ? "" : ", ") << n << " " << name;
    first = false;
  }
  std::cout << " tensors)\n"
            << "kv bytes/token:    " << cfg->KvBytesPerToken(2) << " (bf16), " << cfg->KvBytesPerToken(4) << " (f32)\n"
            << "context length:    " << cfg->context_length << "\n";
  auto tok = qkv::LoadTokenizerFromGguf(**f);
  if (tok.ok()) {
    std::cout << "tokenizer:         " << (*f)->GetStringOr("tokenizer.ggml.model", "?") << "/"
              << (*f)->GetStringOr("tokenizer.ggml.pre", "default") << ", " << (*tok)->vocab_size()
              << " tokens, bos " << (*tok)->bos_id() << ", eos " << (*tok)->eos_id() << "\n";
  } else {
    std::cout << "tokenizer:         " << tok.status().ToString() << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkv-model: make and inspect qkvserve model files"};
  app.require_subcommand(1);
  auto* random = app.add_subcommand("random", "write a random-weight model from a Hugging Face config.json");
  std::string config, out, arch = "llama", dtype = "f32";
  uint64_t seed = 0;
  random->add_option("--config", config, "Hugging Face config.json (plus attention_bias, attn_output_gate, attention_sinks, qk_norm)")->required();
  random->add_option("--out", out, "output GGUF path")->required();
  random->add_option("--arch", arch, "architecture: llama, qwen2 or qwen3")->capture_default_str();
  random->add_option("--dtype", dtype, "weight type: f32, f16, bf16 or q8_0")->capture_default_str();
  random->add_option("--seed", seed, "random seed")->capture_default_str();
  auto* info = app.add_subcommand("info", "print a model's config, parameter count, weight bytes and KV bytes per token");
  std::string model;
  info->add_option("model", model, "GGUF file")->required();
  CLI11_PARSE(app, argc, argv);
  if (random->parsed()) return Random(config, out, arch, dtype, seed);
  return Info(model);
}
