// qkv-model: make and inspect model files.
//   qkv-model random --config CONFIG.json --out MODEL.gguf [--arch llama|qwen2|qwen3|qwen3moe|qwen35|deepseek2]
//   [--dtype TYPE|PRESET]
//   [--seed N] qkv-model quantize IN.gguf OUT.gguf --type PRESET [--threads N] [--quiet] qkv-model info MODEL.gguf
//   qkv-model dequant MODEL.gguf --tensor NAME --out FILE
//   qkv-model tokenize (--model MODEL.gguf | --tokenizer tokenizer.json) [--decode] [--parse-special] [--add-special]
//     reads one JSON string per line and prints one JSON array of ids per line (--decode: the reverse)
//   qkv-model plan --config CONFIG.json [--memory SIZE] [--context N] [--dtype bf16|f16|f32|int8] [--json]
//   qkv-model cpu
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "engine/capacity_plan.h"
#include "engine/gguf.h"
#include "engine/kernels/cpu.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/quantize.h"
#include "engine/random_model.h"
#include "engine/tokenizer.h"
#include "engine/utf8.h"

namespace {

int Fail(const qkv::Status& s) {
  std::cerr << "qkv-model: " << s.ToString() << "\n";
  return 1;
}

qkv::StatusOr<qkv::GgmlType> ParseGgmlType(const std::string& s) {
  if (auto t = qkv::GgmlTypeFromName(s)) return *t;
  return qkv::InvalidArgument(
      "--dtype must be a ggml type (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, "
      "q4_k, q5_k, q6_k, iq4_nl, iq4_xs) or a llama-quantize preset (" +
      qkv::QuantPresetNames() + "), got '" + s + "'");
}

int Random(const std::string& config_path, const std::string& out, const std::string& arch_s,
           const std::string& dtype_s, uint64_t seed, const std::vector<std::string>& chat_stop) {
  std::ifstream in(config_path);
  if (!in) return Fail(qkv::NotFound("cannot read --config '" + config_path + "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto arch = qkv::ParseArch(arch_s);
  if (!arch.ok()) return Fail(arch.status());
  auto cfg = qkv::ModelConfig::FromHfJson(ss.str(), *arch);
  if (!cfg.ok()) return Fail(cfg.status());
  qkv::RandomModelOptions ro;
  ro.seed = seed;
  ro.chat_stop = chat_stop;
  ro.threads = qkv::AvailableCpus().threads;
  if (qkv::FindQuantPreset(dtype_s)) {
    ro.preset = dtype_s;
  } else {
    auto dt = ParseGgmlType(dtype_s);
    if (!dt.ok()) return Fail(dt.status());
    ro.dtype = *dt;
  }
  qkv::Status s = qkv::WriteRandomModel(*cfg, ro, out);
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
  std::cout << "file:              " << path << " (" << (*f)->file_size() << " bytes, GGUF v" << (*f)->version()
            << ")\n"
            << "name:              " << (*f)->GetStringOr("general.name", "") << "\n"
            << "architecture:      " << qkv::ArchName(cfg->arch) << "\n"
            << "config:            " << cfg->Summary() << "\n"
            << "attention:         " << cfg->AttentionKind() << " (" << cfg->n_heads << " query heads, ";
  if (cfg->is_mla()) {
    std::cout << "per token and layer a latent of " << cfg->mla.kv_lora_rank << " and one rope key of "
              << cfg->rotary_dim << "; q_lora_rank " << cfg->mla.q_lora_rank << ", qk_nope " << cfg->mla.qk_nope_dim
              << ", v_head " << cfg->mla.v_head_dim << (cfg->mla.legacy_kv_b ? ", attn_kv_b" : "") << ")\n";
  } else {
    std::cout << cfg->n_kv_heads << " kv heads)\n";
  }
  if (cfg->moe.n_experts > 0) {
    const qkv::MoeConfig& m = cfg->moe;
    std::cout << "experts:           " << m.n_experts << " routed, " << m.n_used << " per token ("
              << (m.gating == qkv::ExpertGating::kSoftmax ? "softmax" : "sigmoid") << " router"
              << (m.norm_weights ? ", weights normalized" : "") << "), expert ffn " << m.expert_ffn;
    if (m.n_shared) std::cout << ", " << m.n_shared << " shared";
    if (m.n_groups > 1) std::cout << ", " << m.n_group_used << " of " << m.n_groups << " groups";
    std::cout << "\n";
  }
  std::cout << "rope scaling:      " << qkv::RopeScalingName(cfg->rope_scaling);
  if (cfg->rope_scaling != qkv::RopeScaling::kNone) {
    std::cout << " x" << cfg->rope_factor << ", original context " << cfg->Rope().orig_ctx;
  }
  if (const auto& ff = cfg->rope_freq_factors; !ff.empty()) {
    std::cout << "; llama3 frequency divisors (rope_freqs.weight) " << *std::min_element(ff.begin(), ff.end()) << " to "
              << *std::max_element(ff.begin(), ff.end());
  }
  std::cout << "\n"
            << "rope:              "
            << (qkv::RopeStyleOf(cfg->arch) == qkv::RopeStyle::kInterleaved ? "interleaved pairs" : "halves")
            << ", rotary_dim " << cfg->rotary_dim << " of " << cfg->head_dim << ", theta " << cfg->rope_theta << "\n"
            << "parameters:        " << cfg->ParameterCount() << " (active per token " << cfg->ActiveParameterCount()
            << ")\n"
            << "weight bytes:      " << weight_bytes << " (";
  bool first = true;
  for (const auto& [name, n] : types) {
    std::cout << (first ? "" : ", ") << n << " " << name;
    first = false;
  }
  std::cout << " tensors)\n"
            << "kv bytes/token:    " << cfg->KvBytesPerToken(2) << " (bf16), " << cfg->KvBytesPerToken(4) << " (f32), "
            << cfg->KvBytesPerToken(1, 2) << " (int8)"
            << (cfg->is_hybrid() ? " in " + std::to_string(cfg->n_attention_layers()) + " attention layers" : "")
            << "\n"
            << "context length:    " << cfg->context_length << "\n";
  if (cfg->is_hybrid()) {
    std::cout << "state/sequence:    " << cfg->StateBytesPerSeq() << " bytes f32 in "
              << cfg->n_layers - cfg->n_attention_layers() << " Gated DeltaNet layers (conv window, "
              << cfg->linear.n_v_heads << " x " << cfg->linear.k_dim << " x " << cfg->linear.v_dim
              << " matrices, the open " << qkv::kDeltaNetChunk << "-token chunk), whatever the length\n";
  }
  auto tok = qkv::LoadTokenizerFromGguf(**f);
  if (tok.ok()) {
    std::cout << "tokenizer:         " << (*f)->GetStringOr("tokenizer.ggml.model", "?") << "/"
              << (*f)->GetStringOr("tokenizer.ggml.pre", "default") << ", " << (*tok)->vocab_size() << " tokens, bos "
              << (*tok)->bos_id() << ", eos " << (*tok)->eos_id();
    if ((*tok)->eog_ids() != std::vector<int>{(*tok)->eos_id()}) {
      std::cout << ", generation ends at";
      for (int id : (*tok)->eog_ids()) std::cout << " " << id;
    }
    std::cout << "\n";
  } else {
    std::cout << "tokenizer:         " << tok.status().ToString() << "\n";
  }
  return 0;
}

int Tokenize(const std::string& path, const std::string& json, bool decode, bool parse_special, bool add_special) {
  qkv::StatusOr<std::unique_ptr<qkv::Tokenizer>> tok = qkv::InvalidArgument("give --model or --tokenizer");
  if (!json.empty()) {
    tok = qkv::LoadTokenizerFromJson(json);
  } else if (!path.empty()) {
    auto f = qkv::GgufFile::Open(path);
    if (!f.ok()) return Fail(f.status());
    tok = qkv::LoadTokenizerFromGguf(**f);
  }
  if (!tok.ok()) return Fail(tok.status());
  std::string line;
  int line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (decode) {
      if (!j.is_array())
        return Fail(qkv::InvalidArgument("line " + std::to_string(line_no) + ": expected a JSON array of ids"));
      std::vector<int> ids;
      for (const auto& v : j) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= (*tok)->vocab_size()) {
          return Fail(qkv::InvalidArgument("line " + std::to_string(line_no) + ": id outside the vocabulary"));
        }
        ids.push_back(v.get<int>());
      }
      std::string text = (*tok)->Decode(ids);
      // JSON needs valid UTF-8: invalid bytes become U+FFFD, as in streaming.
      std::cout << nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    } else {
      if (!j.is_string())
        return Fail(qkv::InvalidArgument("line " + std::to_string(line_no) + ": expected a JSON string"));
      const auto enc = (*tok)->Encode(j.get<std::string>(), parse_special);
      nlohmann::json ids = nlohmann::json::array();
      if (add_special && (*tok)->add_bos() && (*tok)->bos_id() >= 0) ids.push_back((*tok)->bos_id());
      for (int t : enc) ids.push_back(t);
      std::cout << ids.dump() << "\n";
    }
  }
  return 0;
}

int Quantize(const std::string& in, const std::string& out, const std::string& type, int threads, bool quiet) {
  const std::optional<qkv::QuantPreset> p = qkv::FindQuantPreset(type);
  if (!p)
    return Fail(qkv::InvalidArgument("--type must be one of " + qkv::QuantPresetNames() + ", got '" + type + "'"));
  std::error_code ec;
  if (std::filesystem::exists(out) && std::filesystem::equivalent(in, out, ec)) {
    return Fail(qkv::InvalidArgument("quantize: the output is the same file as the input ('" + in + "')"));
  }
  std::vector<qkv::QuantizedTensorReport> report;
  const bool bar = !quiet && isatty(2);
  auto progress = [&](uint64_t done, uint64_t total) {
    if (!bar) return;
    const int w = 40, fill = static_cast<int>(w * done / std::max<uint64_t>(1, total));
    std::fprintf(stderr, "\r[%s%s] %3d%%", std::string(fill, '#').c_str(), std::string(w - fill, ' ').c_str(),
                 static_cast<int>(100 * done / std::max<uint64_t>(1, total)));
    if (done == total) std::fprintf(stderr, "\n");
  };
  qkv::Status s = qkv::QuantizeModelFile(in, out, *p, threads, progress, &report);
  if (!s.ok()) return Fail(s);
  for (const auto& r : report) {
    std::printf("%-28s %-6s -> %-6s rmse %.6g\n", r.name.c_str(), qkv::GgmlTypeName(r.from), qkv::GgmlTypeName(r.to),
                r.rmse);
  }
  std::printf("wrote %s (%s)\n", out.c_str(), p->name.c_str());
  return 0;
}

// Writes a tensor's values as little-endian f32 (the engine's dequantization).
int Dequant(const std::string& path, const std::string& name, const std::string& out) {
  auto f = qkv::GgufFile::Open(path);
  if (!f.ok()) return Fail(f.status());
  const qkv::GgufTensor* t = (*f)->FindTensor(name);
  if (!t) return Fail(qkv::NotFound("no tensor '" + name + "' in " + path));
  std::vector<float> v(t->n_elements());
  qkv::Status s = qkv::DequantizeToF32(*t, v.data());
  if (!s.ok()) return Fail(s);
  std::ofstream o(out, std::ios::binary);
  o.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
  if (!o) return Fail(qkv::Internal("cannot write '" + out + "'"));
  std::cout << name << ": " << qkv::GgmlTypeName(t->type) << ", " << v.size() << " values\n";
  return 0;
}

}  // namespace

// Shared with qkvctl plan: reads the config and prints the plan.
int PlanMain(const std::string& config, const std::string& memory, int64_t context, const std::string& dtype,
             bool json) {
  std::ifstream in(config);
  if (!in) return Fail(qkv::NotFound("cannot read --config '" + config + "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto mem = qkv::ParseByteSize(memory);
  if (!mem.ok()) return Fail(qkv::InvalidArgument("--memory: " + mem.status().message()));
  auto el = qkv::ParseKvElement(dtype);
  if (!el.ok()) return Fail(el.status());
  auto plan = qkv::PlanCapacity(ss.str(), *mem, context, *el);
  if (!plan.ok()) return Fail(plan.status());
  std::cout << (json ? plan->ToJson() + "\n" : plan->ToText());
  return 0;
}

int main(int argc, char** argv) {
  // stdout carries what the tool makes (text, JSON, model info): the engine's log lines go to stderr.
  spdlog::set_default_logger(spdlog::stderr_color_mt("qkv"));
  CLI::App app{"qkv-model: make and inspect qkvserve model files"};
  app.require_subcommand(1);
  auto* random = app.add_subcommand("random", "write a random-weight model from a Hugging Face config.json");
  std::string config, out, arch = "llama", dtype = "f32";
  uint64_t seed = 0;
  random
      ->add_option("--config", config,
                   "Hugging Face config.json (plus attention_bias, attn_output_gate, attention_sinks, qk_norm)")
      ->required();
  random->add_option("--out", out, "output GGUF path")->required();
  random
      ->add_option(
          "--arch", arch,
          "architecture: llama, qwen2, qwen3, qwen3moe, qwen35 (Gated DeltaNet hybrid; Qwen3.5 config names) or "
          "deepseek2 (MLA and experts; DeepSeek-V2/V3 config names)")
      ->capture_default_str();
  random
      ->add_option("--dtype", dtype,
                   "weight type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, "
                   "iq4_xs (rows that are not whole blocks take llama-quantize's fallback type)")
      ->capture_default_str();
  random->add_option("--seed", seed, "random seed")->capture_default_str();
  std::vector<std::string> chat_stop;
  random->add_option("--chat-stop", chat_stop, "a chat stop string to declare (qkvserve.chat.stop; repeatable)");
  auto* info =
      app.add_subcommand("info", "print a model's config, parameter count, weight bytes and KV bytes per token");
  std::string model;
  info->add_option("model", model, "GGUF file")->required();
  auto* tokenize = app.add_subcommand("tokenize", "encode JSON strings (one per line on stdin) to JSON id arrays");
  std::string tok_model, tok_json;
  bool decode = false, parse_special = false, add_special = false;
  auto* tm = tokenize->add_option("--model", tok_model, "GGUF file whose tokenizer to use");
  auto* tj = tokenize->add_option("--tokenizer", tok_json, "Hugging Face tokenizer.json");
  tm->excludes(tj);
  tokenize->add_flag("--decode", decode, "read id arrays, print strings");
  tokenize->add_flag("--parse-special", parse_special,
                     "treat special-token text (e.g. <|endoftext|>) as the special token");
  tokenize->add_flag("--add-special", add_special, "add BOS when the model asks for it");
  auto* plan = app.add_subcommand(
      "plan", "KV bytes per token and how many tokens and sessions fit (from a Hugging Face config.json)");
  std::string plan_config, plan_memory = "16GiB", plan_dtype = "bf16";
  int64_t plan_context = 4096;
  bool plan_json = false;
  plan->add_option("--config", plan_config, "Hugging Face config.json")->required();
  plan->add_option("--memory", plan_memory, "memory for the KV cache")->capture_default_str();
  plan->add_option("--context", plan_context, "tokens per session")->capture_default_str();
  plan->add_option("--dtype", plan_dtype, "KV element type: bf16, f16, f32 or int8 (with its per-vector scales)")
      ->capture_default_str();
  plan->add_flag("--json", plan_json, "print a JSON object");
  auto* dequant = app.add_subcommand("dequant", "write one tensor's values as raw little-endian f32");
  std::string dq_model, dq_tensor, dq_out;
  dequant->add_option("model", dq_model, "GGUF file")->required();
  dequant->add_option("--tensor", dq_tensor, "tensor name")->required();
  dequant->add_option("--out", dq_out, "output file")->required();
  auto* quantize = app.add_subcommand(
      "quantize", "re-encode a model's weights with a llama-quantize preset (its per-tensor types and fallbacks)");
  std::string q_in, q_out, q_type;
  int q_threads = qkv::AvailableCpus().threads;
  bool q_quiet = false;
  quantize->add_option("in", q_in, "input GGUF")->required();
  quantize->add_option("out", q_out, "output GGUF")->required();
  quantize->add_option("--type", q_type, "preset: " + qkv::QuantPresetNames())->required();
  quantize->add_option("--threads", q_threads, "encoder threads")->capture_default_str();
  quantize->add_flag("--quiet", q_quiet, "no progress bar");
  auto* cpu = app.add_subcommand("cpu", "print the instruction set oneDNN runs at here (ONEDNN_MAX_CPU_ISA caps it)");
  CLI11_PARSE(app, argc, argv);
  if (cpu->parsed()) {
    std::cout << qkv::GemmRuntime::CpuIsa() << "\n";
    return 0;
  }
  if (plan->parsed()) return PlanMain(plan_config, plan_memory, plan_context, plan_dtype, plan_json);
  if (random->parsed()) return Random(config, out, arch, dtype, seed, chat_stop);
  if (quantize->parsed()) return Quantize(q_in, q_out, q_type, q_threads, q_quiet);
  if (dequant->parsed()) return Dequant(dq_model, dq_tensor, dq_out);
  if (tokenize->parsed()) return Tokenize(tok_model, tok_json, decode, parse_special, add_special);
  return Info(model);
}
