#include "engine/model_config.h"

#include <nlohmann/json.hpp>
#include <sstream>

namespace qkv {

const char* ArchName(Arch a) {
  switch (a) {
    case Arch::kLlama: return "llama";
    case Arch::kQwen2: return "qwen2";
    case Arch::kQwen3: return "qwen3";
  }
  return "?";
}

StatusOr<Arch> ParseArch(const std::string& s) {
  if (s == "llama") return Arch::kLlama;
  if (s == "qwen2") return Arch::kQwen2;
  if (s == "qwen3") return Arch::kQwen3;
  return InvalidArgument("unsupported architecture '" + s + "' (supported: llama, qwen2, qwen3)");
}

const char* ModelConfig::AttentionKind() const {
  if (n_kv_heads == n_heads) return "MHA";
  if (n_kv_heads == 1) return "MQA";
  return "GQA";
}

int64_t ModelConfig::ParameterCount() const {
  const int64_t h = hidden;
  const int64_t qrows = int64_t{q_dim()} * (attn_output_gate ? 2 : 1);
  int64_t layer = h * (qrows + 2 * kv_dim()) + int64_t{q_dim()} * h + 3 * h * ffn + 2 * h;
  if (attention_bias) layer += qrows + 2 * kv_dim();
  if (qk_norm) layer += 2 * head_dim;
  if (attention_sinks) layer += n_heads;
  return layer * n_layers + int64_t{vocab} * h * (tied_embeddings ? 1 : 2) + h;
}

Status ModelConfig::Validate() const {
  auto bad = [](const std::string& m) { return InvalidArgument("model config: " + m); };
  if (hidden <= 0 || hidden > 65536) return bad("hidden_size must be in 1..65536");
  if (n_layers <= 0 || n_layers > 1024) return bad("num_hidden_layers must be in 1..1024");
  if (n_heads <= 0 || n_heads > 1024) return bad("num_attention_heads must be in 1..1024");
  if (n_kv_heads <= 0 || n_kv_heads > n_heads) return bad("num_key_value_heads must be in 1..num_attention_heads");
  if (n_heads % n_kv_heads != 0) return bad("num_key_value_heads must divide num_attention_heads");
  if (head_dim <= 0 || head_dim > 1024 || head_dim % 2 != 0) return bad("head_dim must be even and in 2..1024");
  if (rotary_dim < 0 || rotary_dim > head_dim || rotary_dim % 2 != 0) {
    return bad("rotary dims must be even and at most head_dim");
  }
  if (ffn <= 0 || ffn > 1 << 20) return bad("intermediate_size must be in 1..1048576");
  if (vocab <= 0 || vocab > 1 << 22) return bad("vocab_size must be in 1..4194304");
  if (context_length <= 0 || context_length > 1 << 22) return bad("context length must be in 1..4194304");
  if (!(rope_theta > 0)) return bad("rope_theta must be positive");
  if (!(rms_eps > 0) || rms_eps > 1) return bad("rms_norm_eps must be in (0, 1]");
  return {};
}

StatusOr<ModelConfig> ModelConfig::FromGguf(const GgufFile& f) {
  ModelConfig c;
  QKV_ASSIGN_OR_RETURN(std::string arch, f.GetString("general.architecture"));
  QKV_ASSIGN_OR_RETURN(c.arch, ParseArch(arch));
  const std::string p = arch + ".";
  auto get_int = [&](const std::string& k, int* out) -> Status {
    QKV_ASSIGN_OR_RETURN(int64_t v, f.GetInt(p + k));
    if (v <= 0 || v > (1ll << 30)) return InvalidArgument("gguf: metadata '" + p + k + "' out of range");
    *out = static_cast<int>(v);
    return {};
  };
  QKV_RETURN_IF_ERROR(get_int("embedding_length", &c.hidden));
  QKV_RETURN_IF_ERROR(get_int("block_count", &c.n_layers));
  QKV_RETURN_IF_ERROR(get_int("feed_forward_length", &c.ffn));
  QKV_RETURN_IF_ERROR(get_int("attention.head_count", &c.n_heads));
  c.n_kv_heads = c.n_heads;
  if (f.Find(p + "attention.head_count_kv")) QKV_RETURN_IF_ERROR(get_int("attention.head_count_kv", &c.n_kv_heads));
  c.head_dim = c.n_heads > 0 ? c.hidden / c.n_heads : 0;
  if (f.Find(p + "attention.key_length")) QKV_RETURN_IF_ERROR(get_int("attention.key_length", &c.head_dim));
  if (f.Find(p + "attention.value_length")) {
    int vlen = 0;
    QKV_RETURN_IF_ERROR(get_int("attention.value_length", &vlen));
    if (vlen != c.head_dim) return Unimplemented("gguf: key_length != value_length is not supported");
  }
  c.rotary_dim = c.head_dim;
  if (f.Find(p + "rope.dimension_count")) QKV_RETURN_IF_ERROR(get_int("rope.dimension_count", &c.rotary_dim));
  if (f.Find(p + "context_length")) QKV_RETURN_IF_ERROR(get_int("context_length", &c.context_length));
  c.rope_theta = f.GetFloatOr(p + "rope.freq_base", 10000.0);
  c.rms_eps = f.GetFloatOr(p + "attention.layer_norm_rms_epsilon", 1e-6);
  c.attn_output_gate = f.GetBoolOr(kKeyOutputGate, false);
  c.attention_sinks = f.FindTensor("blk.0.attn_sinks.weight") != nullptr;
  c.qk_norm = f.FindTensor("blk.0.attn_q_norm.weight") != nullptr;
  c.attention_bias = f.FindTensor("blk.0.attn_q.bias") != nullptr;
  c.tied_embeddings = f.FindTensor("output.weight") == nullptr;
  const GgufTensor* emb = f.FindTensor("token_embd.weight");
  if (!emb) return DataLoss("gguf: missing tensor 'token_embd.weight'");
  if (emb->ne.size() != 2) return DataLoss("gguf: 'token_embd.weight' must be 2-D");
  if (emb->ne[1] > (1u << 22)) return DataLoss("gguf: 'token_embd.weight' has an absurd vocabulary");
  c.vocab = static_cast<int>(emb->ne[1]);
  QKV_RETURN_IF_ERROR(c.Validate());
  return c;
}

StatusOr<ModelConfig> ModelConfig::FromHfJson(const std::string& json_text, Arch arch) {
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgument("config: not a JSON object");
  ModelConfig c;
  c.arch = arch;
  auto geti = [&](const char* k, int* out, bool required) -> Status {
    if (!j.contains(k) || j[k].is_null()) {
      return required ? InvalidArgument(std::string("config: missing '") + k + "'") : Status{};
    }
    if (!j[k].is_number_integer()) return InvalidArgument(std::string("config: '") + k + "' must be an integer");
    const int64_t v = j[k].get<int64_t>();
    if (v <= 0 || v > (1ll << 30)) return InvalidArgument(std::string("config: '") + k + "' out of range");
    *out = static_cast<int>(v);
    return {};
  };
  auto getb = [&](const char* k, bool* out) -> Status {
    if (!j.contains(k)) return {};
    if (!j[k].is_boolean()) return InvalidArgument(std::string("config: '") + k + "' must be a boolean");
    *out = j[k].get<bool>();
    return {};
  };
  auto getf = [&](const char* k, double* out) -> Status {
    if (!j.contains(k)) return {};
    if (!j[k].is_number()) return InvalidArgument(std::string("config: '") + k + "' must be a number");
    *out = j[k].get<double>();
    return {};
  };
  QKV_RETURN_IF_ERROR(geti("hidden_size", &c.hidden, true));
  QKV_RETURN_IF_ERROR(geti("num_hidden_layers", &c.n_layers, true));
  QKV_RETURN_IF_ERROR(geti("num_attention_heads", &c.n_heads, true));
  c.n_kv_heads = c.n_heads;
  QKV_RETURN_IF_ERROR(geti("num_key_value_heads", &c.n_kv_heads, false));
  c.head_dim = c.hidden / c.n_heads;
  QKV_RETURN_IF_ERROR(geti("head_dim", &c.head_dim, false));
  QKV_RETURN_IF_ERROR(geti("intermediate_size", &c.ffn, true));
  QKV_RETURN_IF_ERROR(geti("vocab_size", &c.vocab, true));
  QKV_RETURN_IF_ERROR(geti("max_position_embeddings", &c.context_length, false));
  QKV_RETURN_IF_ERROR(getf("rope_theta", &c.rope_theta));
  QKV_RETURN_IF_ERROR(getf("rms_norm_eps", &c.rms_eps));
  double partial = 1.0;
  QKV_RETURN_IF_ERROR(getf("partial_rotary_factor", &partial));
  if (!(partial > 0 && partial <= 1)) return InvalidArgument("config: 'partial_rotary_factor' must be in (0, 1]");
  c.rotary_dim = static_cast<int>(c.head_dim * partial);
  c.rotary_dim -= c.rotary_dim % 2;
  // Architecture defaults as llama.cpp loads them: qwen2 has q/k/v biases, qwen3 has q/k norms.
  c.attention_bias = arch == Arch::kQwen2;
  c.qk_norm = arch == Arch::kQwen3;
  QKV_RETURN_IF_ERROR(getb("tie_word_embeddings", &c.tied_embeddings));
  QKV_RETURN_IF_ERROR(getb("attention_bias", &c.attention_bias));
  QKV_RETURN_IF_ERROR(getb("qk_norm", &c.qk_norm));
  QKV_RETURN_IF_ERROR(getb("attn_output_gate", &c.attn_output_gate));
  QKV_RETURN_IF_ERROR(getb("attention_sinks", &c.attention_sinks));
  QKV_RETURN_IF_ERROR(c.Validate());
  return c;
}

void ModelConfig::ToGguf(GgufWriter& w) const {
  const std::string a = ArchName(arch);
  const std::string p = a + ".";
  w.SetString("general.architecture", a);
  w.SetU32("general.alignment", 32);
  w.SetU32(p + "context_length", static_cast<uint32_t>(context_length));
  w.SetU32(p + "embedding_length", static_cast<uint32_t>(hidden));
  w.SetU32(p + "block_count", static_cast<uint32_t>(n_layers));
  w.SetU32(p + "feed_forward_length", static_cast<uint32_t>(ffn));
  w.SetU32(p + "attention.head_count", static_cast<uint32_t>(n_heads));
  w.SetU32(p + "attention.head_count_kv", static_cast<uint32_t>(n_kv_heads));
  w.SetU32(p + "attention.key_length", static_cast<uint32_t>(head_dim));
  w.SetU32(p + "attention.value_length", static_cast<uint32_t>(head_dim));
  w.SetU32(p + "rope.dimension_count", static_cast<uint32_t>(rotary_dim));
  w.SetU32(p + "vocab_size", static_cast<uint32_t>(vocab));
  w.SetF32(p + "rope.freq_base", static_cast<float>(rope_theta));
  w.SetF32(p + "attention.layer_norm_rms_epsilon", static_cast<float>(rms_eps));
  if (attn_output_gate) w.SetBool(kKeyOutputGate, true);
  if (attention_sinks) w.SetBool(kKeySinks, true);
}

std::string ModelConfig::Summary() const {
  std::ostringstream o;
  o << ArchName(arch) << " hidden=" << hidden << " layers=" << n_layers << " heads=" << n_heads
    << " kv_heads=" << n_kv_heads << " (" << AttentionKind() << ") head_dim=" << head_dim
    << " rotary_dim=" << rotary_dim << " ffn=" << ffn << " vocab=" << vocab << " ctx=" << context_length
    << (tied_embeddings ? " tied" : "") << (attention_bias ? " bias" : "") << (qk_norm ? " qk_norm" : "")
    << (attn_output_gate ? " output_gate" : "") << (attention_sinks ? " sinks" : "");
  return o.str();
}

}  // namespace qkv
