// The shape of a decoder-only transformer, read from GGUF metadata (llama.cpp's keys) or from a Hugging
// Face config.json. Everything the forward pass, the KV cache and the capacity planner need to size
// themselves comes from here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/gguf.h"
#include "engine/linear_attn.h"
#include "engine/status.h"

namespace qkv {

enum class Arch { kLlama, kQwen2, kQwen3, kDeepseek2, kQwen3Moe, kQwen35 };

const char* ArchName(Arch a);
StatusOr<Arch> ParseArch(const std::string& s);

// Keys under the project's own prefix, for features llama.cpp's metadata does not describe.
inline constexpr const char* kKeyOutputGate = "qkvserve.attention.output_gate";
inline constexpr const char* kKeySinks = "qkvserve.attention.sinks";

// Rope scaling as llama.cpp reads it ({arch}.rope.scaling.*): none, linear (every frequency / factor) or
// YaRN (per-pair ramp between interpolated and original frequencies, plus a magnitude factor).
enum class RopeScaling { kNone, kLinear, kYarn };
const char* RopeScalingName(RopeScaling s);

// What RoPE and the softmax need from the scaling, computed the way llama.cpp does (llama-context.cpp,
// ggml's rope_yarn and deepseek2's kq_scale).
struct RopeParams {
  int rotary_dim = 0;
  double theta = 10000.0;
  double freq_scale = 1.0;  // 1 / factor (linear, YaRN); 1 for none
  bool yarn = false;        // ext_factor 1
  int orig_ctx = 0;         // YaRN's original context
  double beta_fast = 32.0, beta_slow = 1.0;
  double magnitude = 1.0;           // cos/sin are multiplied by it
  std::vector<float> freq_factors;  // [rotary_dim / 2] divisors of each pair's angle (llama's rope_freqs); empty: 1
};

// Multi-head latent attention (DeepSeek-V2/V3): per token and layer the cache holds the normalized latent
// (kv_lora_rank) and one rotated rope key (qk_rope_dim = rotary_dim) shared by all heads.
struct MlaConfig {
  int q_lora_rank = 0;       // 0: queries straight from the hidden state (attn_q)
  int kv_lora_rank = 0;      // the latent's width
  int qk_nope_dim = 0;       // per head, the part of q·k that goes through the latent
  int v_head_dim = 0;        // per head, values after W_UV
  bool legacy_kv_b = false;  // the file has one attn_kv_b instead of attn_k_b / attn_v_b
};

// Mixture-of-experts FFN blocks (qwen3moe; deepseek2's layers after leading_dense_block_count), as
// llama.cpp's build_moe_ffn computes them: router logits → softmax or sigmoid → (+ selection bias) →
// (group-limited) top-k → weights from the unbiased probabilities, normalized and scaled → Σ w_k expert_k.
enum class ExpertGating { kSoftmax, kSigmoid };
struct MoeConfig {
  int n_experts = 0;   // routed experts per MoE layer (0: no MoE layers)
  int n_used = 0;      // experts per token (top-k)
  int expert_ffn = 0;  // intermediate size of one expert
  int n_shared = 0;    // shared experts (deepseek2), one dense SwiGLU of n_shared × expert_ffn
  ExpertGating gating = ExpertGating::kSoftmax;
  bool norm_weights = false;           // divide the k weights by their sum (clamped at 6.1035e-5)
  double weights_scale = 0.0;          // multiply them by it (0 or 1: not applied)
  int n_groups = 0, n_group_used = 0;  // group-limited routing (deepseek2's n_group / topk_group)
  bool selection_bias = false;         // blk.N.exp_probs_b.bias is added for selection only
};

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
  // Rope scaling ({arch}.rope.scaling.*). beta_fast/slow are llama.cpp's defaults (it reads no keys for them
  // for these architectures); log_mul is yarn_log_multiplier as llama.cpp uses it (the file's value / 0.1
  // for deepseek2).
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_factor = 1.0;
  int rope_orig_ctx = 0;  // 0: the context length
  double rope_attn_factor = 1.0;
  double rope_yarn_log_mul = 0.0;
  // llama: Llama 3.1's rope scaling ("rope_type": "llama3"), which llama.cpp's converter writes as the tensor
  // rope_freqs.weight, one divisor per rotated pair (ggml's freq_factors): the angle of pair i is
  // p · theta^(-2i/rotary_dim) / rope_freq_factors[i]. Empty: none. The file's metadata says nothing of it.
  std::vector<float> rope_freq_factors;
  // deepseek2 (arch kDeepseek2): MLA attention; head_dim is then kv_lora_rank + rotary_dim (the absorbed
  // query/key width, as llama.cpp's key_length) and n_kv_heads 1.
  MlaConfig mla;
  MoeConfig moe;
  int n_dense_lead = 0;  // deepseek2: the first blocks have a dense FFN; MoE after them
  // qwen35: which blocks are Gated DeltaNet layers (the others are gated full attention), and their shape.
  LinearAttnConfig linear;
  std::vector<bool> recurrent;  // [n_layers]; empty: every layer is full attention

  bool is_mla() const { return arch == Arch::kDeepseek2; }
  bool is_hybrid() const { return arch == Arch::kQwen35; }
  bool is_linear_layer(int block) const {
    return block >= 0 && static_cast<size_t>(block) < recurrent.size() && recurrent[static_cast<size_t>(block)];
  }
  int n_attention_layers() const;
  // Bytes of per-sequence state (every Gated DeltaNet layer's share of a state slot); 0 without such layers.
  int64_t StateBytesPerSeq() const;
  // The FFN norm's tensor name in block `block` (qwen35: post_attention_norm).
  std::string FfnNormName(int block) const;
  // Whether block `block`'s FFN is a mixture of experts.
  bool is_moe_block(int block) const { return moe.n_experts > 0 && block >= n_dense_lead; }
  // Per head, the query/key width before absorption (qk_nope + qk_rope; llama.cpp's key_length_mla).
  int mla_qk_dim() const { return mla.qk_nope_dim + rotary_dim; }
  RopeParams Rope() const;
  // The softmax scale: 1/sqrt(head_dim); deepseek2: mscale² / sqrt(qk_nope + qk_rope) (llama.cpp's kq_scale).
  float AttentionScale() const;

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
  // Full-attention layers × 2 (K and V) × n_kv_heads × (head_dim × bytes + scale bytes); MLA: layers ×
  // ((kv_lora_rank + qk_rope_dim) × bytes + 2 × scale bytes), one scale for the latent and one for the rope key
  // (int8's are 2 bytes each; kv_cache.h KvVectorBytes). Gated DeltaNet layers cache nothing per token.
  int64_t KvBytesPerToken(int bytes_per_element, int scale_bytes = 0) const {
    if (is_mla()) return int64_t{n_layers} * ((mla.kv_lora_rank + rotary_dim) * bytes_per_element + 2 * scale_bytes);
    return int64_t{n_attention_layers()} * 2 * n_kv_heads * (head_dim * bytes_per_element + scale_bytes);
  }
  const char* AttentionKind() const;  // "MHA", "GQA", "MQA" or "MLA"
  int64_t ParameterCount() const;
  // Parameters a token uses: the FFN of an MoE block counts only its num_experts_per_tok experts (plus the
  // router and shared experts); equal to ParameterCount for dense models.
  int64_t ActiveParameterCount() const;

  // Checks internal consistency (divisibility, ranges); the message names the offending field.
  Status Validate() const;
  static StatusOr<ModelConfig> FromGguf(const GgufFile& f);
  int64_t Parameters(bool active_only) const;
  // Reads Hugging Face config.json names (see tools/qkv_model.cc --help for the list).
  static StatusOr<ModelConfig> FromHfJson(const std::string& json_text, Arch arch);
  void ToGguf(GgufWriter& w) const;
  std::string Summary() const;
};

}  // namespace qkv
