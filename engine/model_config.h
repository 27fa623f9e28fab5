// The shape of a decoder-only transformer, read from GGUF metadata (llama.cpp's keys) or from a Hugging
// Face config.json. Everything the forward pass, the KV cache and the capacity planner need to size
// themselves comes from here.
#pragma once

#include <cstdint>
#include <string>

#include "engine/gguf.h"
#include "engine/status.h"

namespace qkv {

enum class Arch { kLlama, kQwen2, kQwen3 };

const char* ArchName(Arch a);
StatusOr<Arch> ParseArch(const std::string& s);

// Keys under the project's own prefix, for features llama.cpp's metadata does not describe.
inline constexpr const char* kKeyOutputGate = "qkvserve.attention.output_gate";
inline constexpr const char* kKeySinks = "qkvserve.attention.sinks";

struct ModelConfig {
  Arch arch = Arch::kLlama;
  int hidden = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;  // first rotary_dim dims of each head rotate; the rest pass through
  double rope_theta = 10000.0;
  double rms_eps = 1e-6;
  int ffn = 0;
  int vocab = 0;
  int context_length = 2048;
  bool tied_embeddings = false;
  bool attention_bias = false;    // q/k/v biases (qwen2)
  bool qk_norm = false;           // per-head RMSNorm of q and k before RoPE (qwen3)
  bool attn_output_gate = false;  // q_proj emits [query, gate] per head (Qwen3-Next layout)
  bool attention_sinks = false;   // one learnable logit per head in the softmax denominator (gpt-oss)

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
  // Every layer here is a full-attention layer: layers × 2 (K and V) × n_kv_heads × head_dim × bytes.
  int64_t KvBytesPerToken(int bytes_per_element) const {
    return int64_t{n_layers} * 2 * n_kv_heads * head_dim * bytes_per_element;
  }
  const char* AttentionKind() const;  // "MHA", "GQA" or "MQA"
  int64_t ParameterCount() const;

  // Checks internal consistency (divisibility, ranges); the message names the offending field.
  Status Validate() const;
  static StatusOr<ModelConfig> FromGguf(const GgufFile& f);
  // Reads Hugging Face config.json names (see tools/qkv_model.cc --help for the list).
  static StatusOr<ModelConfig> FromHfJson(const std::string& json_text, Arch arch);
  void ToGguf(GgufWriter& w) const;
  std::string Summary() const;
};

}  // namespace qkv
