#include "engine/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

namespace qkv {

const char* ArchName(Arch a) {
  switch (a) {
    case Arch::kLlama: return "llama";
    case Arch::kQwen2: return "qwen2";
    case Arch::kQwen3: return "qwen3";
    case Arch::kDeepseek2: return "deepseek2";
    case Arch::kQwen3Moe: return "qwen3moe";
    case Arch::kQwen35: return "qwen35";
  }
  return "?";
}

const char* RopeScalingName(RopeScaling s) {
  switch (s) {
    case RopeScaling::kNone: return "none";
    case RopeScaling::kLinear: return "linear";
    case RopeScaling::kYarn: return "yarn";
  }
  return "?";
}

namespace {

StatusOr<RopeScaling> ParseRopeScaling(const std::string& s) {
  if (s == "none") return RopeScaling::kNone;
  if (s == "linear") return RopeScaling::kLinear;
  if (s == "yarn") return RopeScaling::kYarn;
  return Unimplemented("rope scaling '" + s + "' is not supported (supported: none, linear, yarn)");
}

// llama.cpp's "lite" rule for deepseek2: these models have no low-rank query path (and no q_lora_rank).
bool DeepseekLite(int n_layers, int vocab) {
  return n_layers == 26 || n_layers == 27 || (n_layers == 48 && vocab == 128256);
}

// Llama 3.1's per-pair frequency divisors (Meta's rope_type "llama3"): pairs whose wavelength is below
// orig / high keep their frequency, those above orig / low are divided by factor, and those between are
// divided by a smooth mix of the two.
std::vector<float> Llama3RopeFactors(int rotary_dim, double theta, double factor, double low, double high,
                                     double orig) {
  std::vector<float> ff(static_cast<size_t>(rotary_dim / 2));
  for (int i = 0; i < rotary_dim / 2; ++i) {
    const double wavelen = 2 * M_PI * std::pow(theta, 2.0 * i / rotary_dim);
    double d = 1.0;
    if (wavelen > orig / low) {
      d = factor;
    } else if (wavelen >= orig / high) {
      const double smooth = (orig / wavelen - low) / (high - low);
      d = 1.0 / ((1.0 - smooth) / factor + smooth);
    }
    ff[static_cast<size_t>(i)] = static_cast<float>(d);
  }
  return ff;
}

// YaRN's magnitude correction, as llama.cpp's get_mscale.
double GetMscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

}  // namespace

RopeParams ModelConfig::Rope() const {
  RopeParams r;
  r.rotary_dim = rotary_dim;
  r.theta = rope_theta;
  r.freq_scale = rope_scaling == RopeScaling::kNone ? 1.0 : 1.0 / rope_factor;
  r.yarn = rope_scaling == RopeScaling::kYarn;
  r.orig_ctx = rope_orig_ctx > 0 ? rope_orig_ctx : context_length;
  r.freq_factors = rope_freq_factors;
  // llama.cpp's yarn_attn_factor (llama-context.cpp), then the factor ggml's rope_yarn applies on top.
  double attn = 1.0;
  if (r.yarn) {
    const double factor = 1.0 / r.freq_scale;
    if (rope_yarn_log_mul != 0.0) {
      const double m = arch == Arch::kDeepseek2 && rope_yarn_log_mul != 1.0 ? rope_yarn_log_mul : 1.0;
      attn = GetMscale(factor, m) / GetMscale(factor, rope_yarn_log_mul);
    } else {
      attn = GetMscale(factor, 1.0);
    }
    attn *= 1.0 / (1.0 + 0.1 * std::log(factor));
  }
  attn *= rope_attn_factor;
  r.magnitude = attn * (r.yarn ? 1.0 + 0.1 * std::log(1.0 / r.freq_scale) : 1.0);
  return r;
}

float ModelConfig::AttentionScale() const {
  if (!is_mla()) return 1.0f / std::sqrt(static_cast<float>(head_dim));
  // deepseek2.cpp: mscale = attn_factor_org × (1 + 0.1 × yarn_log_mul × ln(1 / freq_scale)), where
  // attn_factor_org cancels YaRN's own adjustment; kq_scale = mscale² / sqrt(qk_nope + qk_rope).
  const RopeParams r = Rope();
  const double attn_org = r.yarn ? r.magnitude : r.magnitude * (1.0 + 0.1 * std::log(1.0 / r.freq_scale));
  const auto mscale = static_cast<float>(attn_org * (1.0 + 0.1 * rope_yarn_log_mul * std::log(1.0 / r.freq_scale)));
  return mscale * mscale / std::sqrt(static_cast<float>(mla_qk_dim()));
}

StatusOr<Arch> ParseArch(const std::string& s) {
  if (s == "llama") return Arch::kLlama;
  if (s == "qwen2") return Arch::kQwen2;
  if (s == "qwen3") return Arch::kQwen3;
  if (s == "deepseek2") return Arch::kDeepseek2;
  if (s == "qwen3moe") return Arch::kQwen3Moe;
  if (s == "qwen35") return Arch::kQwen35;
  return InvalidArgument("unsupported architecture '" + s +
                         "' (supported: llama, qwen2, qwen3, qwen3moe, qwen35, deepseek2)");
}

int ModelConfig::n_attention_layers() const {
  int n = 0;
  for (int l = 0; l < n_layers; ++l) n += !is_linear_layer(l);
  return n;
}

int64_t ModelConfig::StateBytesPerSeq() const {
  int64_t n = 0;
  for (int l = 0; l < n_layers; ++l) n += is_linear_layer(l) ? linear.state_bytes() : 0;
  return n;
}

std::string ModelConfig::FfnNormName(int block) const {
  return "blk." + std::to_string(block) + (is_hybrid() ? ".post_attention_norm.weight" : ".ffn_norm.weight");
}

const char* ModelConfig::AttentionKind() const {
  if (is_mla()) return "MLA";
  if (n_kv_heads == n_heads) return "MHA";
  if (n_kv_heads == 1) return "MQA";
  return "GQA";
}

int64_t ModelConfig::ParameterCount() const { return Parameters(false); }
int64_t ModelConfig::ActiveParameterCount() const { return Parameters(true); }

int64_t ModelConfig::Parameters(bool active_only) const {
  const int64_t h = hidden;
  // FFN parameters of one block: dense, or the router plus the (active or all) experts and shared experts.
  auto ffn_params = [&](int block) -> int64_t {
    if (!is_moe_block(block)) return 3 * h * ffn;
    const int64_t experts = active_only ? moe.n_used : moe.n_experts;
    return h * moe.n_experts + (experts + moe.n_shared) * 3 * h * moe.expert_ffn +
           (moe.selection_bias ? moe.n_experts : 0);
  };
  int64_t ffn_total = 0;
  for (int l = 0; l < n_layers; ++l) ffn_total += ffn_params(l);
  if (is_mla()) {
    const int64_t nh = n_heads, R = mla.kv_lora_rank, P = rotary_dim, dk = mla_qk_dim(), dv = mla.v_head_dim;
    const int64_t q =
        mla.q_lora_rank > 0 ? h * mla.q_lora_rank + mla.q_lora_rank + int64_t{mla.q_lora_rank} * nh * dk : h * nh * dk;
    const int64_t attn = q + h * (R + P) + R + nh * R * (mla.qk_nope_dim + dv) + nh * dv * h;
    const int64_t layer = attn + 2 * h;
    return layer * n_layers + ffn_total + int64_t{vocab} * h * (tied_embeddings ? 1 : 2) + h;
  }
  const int64_t qrows = int64_t{q_dim()} * (attn_output_gate ? 2 : 1);
  int64_t layer = h * (qrows + 2 * kv_dim()) + int64_t{q_dim()} * h + 2 * h;
  if (attention_bias) layer += qrows + 2 * kv_dim();
  if (qk_norm) layer += 2 * head_dim;
  if (attention_sinks) layer += n_heads;
  // A Gated DeltaNet layer: [qkv | z | b | a] projections, the conv kernel, dt bias and A, the gated norm, out.
  const LinearAttnConfig& la = linear;
  const int64_t vd = int64_t{la.n_v_heads} * la.v_dim;
  const int64_t linear_layer = h * (la.conv_channels() + vd + 2 * la.n_v_heads) +
                               int64_t{la.conv_channels()} * la.conv_kernel + 2 * la.n_v_heads + la.v_dim + vd * h +
                               2 * h;
  const int64_t n_lin = n_layers - n_attention_layers();
  return layer * (n_layers - n_lin) + linear_layer * n_lin + ffn_total +
         int64_t{vocab} * h * (tied_embeddings ? 1 : 2) + h;
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
  if (rope_scaling != RopeScaling::kNone && !(rope_factor >= 1.0 && rope_factor <= 1024.0)) {
    return bad("rope_scaling.factor must be in 1..1024");
  }
  if (rope_orig_ctx < 0 || rope_orig_ctx > 1 << 22)
    return bad("rope_scaling.original_max_position_embeddings out of range");
  if (!std::isfinite(rope_attn_factor) || !(rope_attn_factor > 0)) return bad("rope attention factor must be positive");
  if (!std::isfinite(rope_yarn_log_mul) || std::fabs(rope_yarn_log_mul) > 100)
    return bad("mscale_all_dim out of range");
  if (attention_sinks && (arch == Arch::kQwen35 || arch == Arch::kDeepseek2)) {
    return bad(std::string("attention sinks are not part of ") + ArchName(arch) + " (llama.cpp reads none for it)");
  }
  if (!rope_freq_factors.empty()) {
    if (arch != Arch::kLlama) return bad("rope frequency factors (rope_freqs.weight, llama3 rope) are for llama only");
    if (rope_freq_factors.size() != static_cast<size_t>(rotary_dim / 2)) {
      return bad("rope_freqs.weight must have rotary_dim / 2 = " + std::to_string(rotary_dim / 2) + " values");
    }
    for (float x : rope_freq_factors) {
      if (!std::isfinite(x) || !(x > 0)) return bad("rope_freqs.weight must hold positive finite values");
    }
  }
  if (moe.n_experts > 0 || arch == Arch::kQwen3Moe) {
    if (moe.n_experts <= 0 || moe.n_experts > 4096) return bad("num_experts must be in 1..4096");
    if (moe.n_used <= 0 || moe.n_used > moe.n_experts) return bad("num_experts_per_tok must be in 1..num_experts");
    if (moe.expert_ffn <= 0 || moe.expert_ffn > 1 << 20) return bad("moe_intermediate_size must be in 1..1048576");
    if (moe.n_shared < 0 || moe.n_shared > 64) return bad("n_shared_experts must be in 0..64");
    if (moe.n_groups > 256) return bad("n_group must be at most 256");
    // llama.cpp asserts these (llama-model.cpp): fewer groups than experts, groups dividing the experts,
    // and fewer groups used than there are.
    if (moe.n_groups > 1 && (moe.n_groups >= moe.n_experts || moe.n_experts % moe.n_groups != 0 ||
                             moe.n_group_used < 1 || moe.n_group_used >= moe.n_groups)) {
      return bad("n_group must divide num_experts (and be fewer), and topk_group be in 1..n_group-1");
    }
    if (!std::isfinite(moe.weights_scale)) return bad("routed_scaling_factor must be finite");
  }
  if (is_hybrid()) {
    const LinearAttnConfig& la = linear;
    if (la.conv_kernel < 1 || la.conv_kernel > 64) return bad("linear_conv_kernel_dim must be in 1..64");
    if (la.n_k_heads <= 0 || la.n_k_heads > 1024) return bad("linear_num_key_heads must be in 1..1024");
    if (la.n_v_heads <= 0 || la.n_v_heads > 1024 || la.n_v_heads % la.n_k_heads != 0) {
      return bad("linear_num_value_heads must be in 1..1024 and a multiple of linear_num_key_heads");
    }
    if (la.k_dim <= 0 || la.k_dim > 1024) return bad("linear_key_head_dim must be in 1..1024");
    if (la.v_dim <= 0 || la.v_dim > 1024) return bad("linear_value_head_dim must be in 1..1024");
    if (recurrent.size() != static_cast<size_t>(n_layers)) return bad("one layer type per layer is needed");
    if (n_attention_layers() == 0) return bad("a hybrid model needs at least one full_attention layer");
    if (!attn_output_gate || !qk_norm) return bad("qwen35's attention layers have an output gate and q/k norms");
  } else if (!recurrent.empty()) {
    return bad("linear-attention layers need architecture qwen35");
  }
  if (is_mla()) {
    if (mla.kv_lora_rank <= 0 || mla.kv_lora_rank > 16384) return bad("kv_lora_rank must be in 1..16384");
    if (mla.q_lora_rank < 0 || mla.q_lora_rank > 65536) return bad("q_lora_rank must be in 0..65536");
    if (mla.qk_nope_dim <= 0 || mla.qk_nope_dim > 1024) return bad("qk_nope_head_dim must be in 1..1024");
    if (mla.v_head_dim <= 0 || mla.v_head_dim > 1024) return bad("v_head_dim must be in 1..1024");
    if (n_kv_heads != 1) return bad("deepseek2 (MLA) caches one latent per token: head_count_kv must be 1");
    if (head_dim != mla.kv_lora_rank + rotary_dim)
      return bad("deepseek2: key_length must be kv_lora_rank + qk_rope_head_dim");
    if (n_dense_lead < n_layers && moe.n_experts <= 0) {
      return bad("deepseek2 blocks after leading_dense_block_count (" + std::to_string(n_dense_lead) +
                 ") are mixture-of-experts blocks and need expert_count > 0");
    }
  }
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
  int vlen = c.head_dim;
  if (f.Find(p + "attention.value_length")) QKV_RETURN_IF_ERROR(get_int("attention.value_length", &vlen));
  if (vlen != c.head_dim && c.arch != Arch::kDeepseek2) {
    return Unimplemented("gguf: key_length != value_length is not supported");
  }
  c.rotary_dim = c.head_dim;
  if (f.Find(p + "rope.dimension_count")) {
    c.rotary_dim = 0;
    QKV_ASSIGN_OR_RETURN(int64_t rd, f.GetInt(p + "rope.dimension_count"));
    if (rd < 0 || rd > 65536) return InvalidArgument("gguf: metadata '" + p + "rope.dimension_count' out of range");
    c.rotary_dim = static_cast<int>(rd);
  }
  if (f.Find(p + "context_length")) QKV_RETURN_IF_ERROR(get_int("context_length", &c.context_length));
  c.rope_theta = f.GetFloatOr(p + "rope.freq_base", 10000.0);
  // Rope scaling, with llama.cpp's defaults: type "linear" unless given, frequency scale 1 / factor when a
  // factor is given (1 without one, or for type none).
  if (f.Find(p + "rope.scaling.type")) {
    QKV_ASSIGN_OR_RETURN(std::string st, f.GetString(p + "rope.scaling.type"));
    QKV_ASSIGN_OR_RETURN(c.rope_scaling, ParseRopeScaling(st));
  } else {
    c.rope_scaling = RopeScaling::kLinear;
  }
  c.rope_factor = f.GetFloatOr(p + "rope.scaling.factor", 0.0);
  if (c.rope_factor == 0.0) c.rope_factor = f.GetFloatOr(p + "rope.scale_linear", 0.0);
  if (c.rope_factor == 0.0) {
    if (c.rope_scaling == RopeScaling::kLinear) c.rope_scaling = RopeScaling::kNone;  // no factor: no scaling
    c.rope_factor = 1.0;
  }
  if (f.Find(p + "rope.scaling.original_context_length")) {
    QKV_RETURN_IF_ERROR(get_int("rope.scaling.original_context_length", &c.rope_orig_ctx));
  }
  c.rope_attn_factor = f.GetFloatOr(p + "rope.scaling.attn_factor", 1.0);
  if (c.arch == Arch::kDeepseek2) {
    // deepseek2.cpp's loader: the converter wrote 0.1 × mscale_all_dim, llama.cpp divides it back.
    c.rope_yarn_log_mul = f.GetFloatOr(p + "rope.scaling.yarn_log_multiplier", 0.0) / 0.1;
    if (f.GetFloatOr(p + "attention.temperature_scale", 0.0) != 0.0) {
      return Unimplemented("gguf: deepseek2 attention temperature scaling is not supported");
    }
    // These are required by llama.cpp even when every layer is dense.
    for (const char* k : {"expert_feed_forward_length", "expert_shared_count", "attention.kv_lora_rank"}) {
      if (!f.Find(p + k)) return DataLoss("gguf: deepseek2 needs metadata '" + p + k + "' (llama.cpp requires it)");
    }
    QKV_RETURN_IF_ERROR(get_int("attention.kv_lora_rank", &c.mla.kv_lora_rank));
    int vocab_meta = 0;
    if (f.Find(p + "vocab_size")) QKV_RETURN_IF_ERROR(get_int("vocab_size", &vocab_meta));
    if (vocab_meta == 0) {
      if (const GgufTensor* e = f.FindTensor("token_embd.weight"); e && e->ne.size() == 2) {
        vocab_meta = static_cast<int>(std::min<uint64_t>(e->ne[1], 1u << 30));
      }
    }
    if (!DeepseekLite(c.n_layers, vocab_meta)) {
      if (!f.Find(p + "attention.q_lora_rank")) {
        return DataLoss("gguf: deepseek2 with " + std::to_string(c.n_layers) + " layers needs '" + p +
                        "attention.q_lora_rank' (llama.cpp reads it unless the model has 26 or 27 layers)");
      }
      QKV_RETURN_IF_ERROR(get_int("attention.q_lora_rank", &c.mla.q_lora_rank));
    }
    const bool split = f.Find(p + "attention.key_length_mla") && f.Find(p + "attention.value_length_mla");
    int dk = c.head_dim, dv = vlen;  // legacy files: key/value_length are the per-head widths
    if (split) {
      QKV_RETURN_IF_ERROR(get_int("attention.key_length_mla", &dk));
      QKV_RETURN_IF_ERROR(get_int("attention.value_length_mla", &dv));
    }
    c.mla.legacy_kv_b = !split;
    c.mla.qk_nope_dim = dk - c.rotary_dim;
    c.mla.v_head_dim = dv;
    if (c.mla.qk_nope_dim < 1) return DataLoss("gguf: deepseek2 key length must exceed rope.dimension_count");
    c.head_dim = c.mla.kv_lora_rank + c.rotary_dim;  // the absorbed width (what the cache holds per token)
    c.n_kv_heads = 1;
    c.n_dense_lead = 0;
    if (f.Find(p + "leading_dense_block_count")) {
      QKV_ASSIGN_OR_RETURN(int64_t nd, f.GetInt(p + "leading_dense_block_count"));
      c.n_dense_lead = static_cast<int>(std::clamp<int64_t>(nd, 0, 1 << 20));
    }
    // The experts of the blocks after the leading dense ones (deepseek2.cpp / build_moe_ffn).
    auto opt_int = [&](const char* k, int* out) -> Status {
      if (!f.Find(p + k)) return {};
      QKV_ASSIGN_OR_RETURN(int64_t v, f.GetInt(p + k));
      if (v < 0 || v > (1 << 20)) return InvalidArgument("gguf: metadata '" + p + k + "' out of range");
      *out = static_cast<int>(v);
      return {};
    };
    QKV_RETURN_IF_ERROR(opt_int("expert_count", &c.moe.n_experts));
    QKV_RETURN_IF_ERROR(opt_int("expert_used_count", &c.moe.n_used));
    QKV_RETURN_IF_ERROR(opt_int("expert_feed_forward_length", &c.moe.expert_ffn));
    QKV_RETURN_IF_ERROR(opt_int("expert_shared_count", &c.moe.n_shared));
    QKV_RETURN_IF_ERROR(opt_int("expert_group_count", &c.moe.n_groups));
    QKV_RETURN_IF_ERROR(opt_int("expert_group_used_count", &c.moe.n_group_used));
    c.moe.weights_scale = f.GetFloatOr(p + "expert_weights_scale", 0.0);
    c.moe.norm_weights = f.GetBoolOr(p + "expert_weights_norm", false);
    int gating = 0;
    QKV_RETURN_IF_ERROR(opt_int("expert_gating_func", &gating));
    if (gating == 0) {  // llama.cpp's default for older DeepSeek V2/V2.5 files (and GLM 4.7 Lite's sigmoid)
      gating = (c.n_layers == 47 || c.n_layers == 48) && vocab_meta == 154880 ? 2 : 1;
    }
    if (gating != 1 && gating != 2) {
      return Unimplemented("gguf: expert gating function " + std::to_string(gating) +
                           " is not supported (1 softmax, 2 sigmoid)");
    }
    c.moe.gating = gating == 2 ? ExpertGating::kSigmoid : ExpertGating::kSoftmax;
    c.moe.selection_bias = f.FindTensor("blk." + std::to_string(std::min(c.n_dense_lead, c.n_layers - 1)) +
                                        ".exp_probs_b.bias") != nullptr;
    if (c.n_dense_lead >= c.n_layers) c.moe = MoeConfig{};  // every block dense: the expert keys are unused
  }
  c.rms_eps = f.GetFloatOr(p + "attention.layer_norm_rms_epsilon", 1e-6);
  // llama.cpp's llama loader also takes stacked experts (Mixtral and other llama-architecture MoE files):
  // not built here, so say so rather than miss a dense FFN tensor.
  if ((c.arch == Arch::kLlama || c.arch == Arch::kQwen2 || c.arch == Arch::kQwen3) &&
      f.GetIntOr(p + "expert_count", 0) > 0) {
    return Unimplemented("gguf: " + arch + " with experts ('" + p +
                         "expert_count' = " + std::to_string(f.GetIntOr(p + "expert_count", 0)) +
                         ", e.g. Mixtral) is not supported; mixtures of experts run as qwen3moe and deepseek2");
  }
  if (c.arch == Arch::kQwen3Moe) {
    // qwen3moe.cpp: expert_count and expert_used_count are required, expert_feed_forward_length defaults to
    // feed_forward_length / expert_used_count; softmax gating with the top-k weights always normalized.
    for (const char* k : {"expert_count", "expert_used_count"}) {
      if (!f.Find(p + k)) return DataLoss("gguf: qwen3moe needs metadata '" + p + k + "' (llama.cpp requires it)");
    }
    QKV_RETURN_IF_ERROR(get_int("expert_count", &c.moe.n_experts));
    QKV_RETURN_IF_ERROR(get_int("expert_used_count", &c.moe.n_used));
    c.moe.expert_ffn = c.ffn / c.moe.n_used;
    if (f.Find(p + "expert_feed_forward_length")) {
      QKV_RETURN_IF_ERROR(get_int("expert_feed_forward_length", &c.moe.expert_ffn));
    }
    c.moe.gating = ExpertGating::kSoftmax;
    c.moe.norm_weights = true;
    c.moe.weights_scale = f.GetFloatOr(p + "expert_weights_scale", 0.0);
  }
  c.attn_output_gate = f.GetBoolOr(kKeyOutputGate, false);
  c.attention_sinks = f.FindTensor("blk.0.attn_sinks.weight") != nullptr;
  c.qk_norm = f.FindTensor("blk.0.attn_q_norm.weight") != nullptr;
  c.attention_bias = f.FindTensor("blk.0.attn_q.bias") != nullptr;
  if (c.arch == Arch::kQwen35) {
    // qwen35.cpp: gated attention with q/k norms in the full-attention layers, Gated DeltaNet in the others.
    c.attn_output_gate = c.qk_norm = true;
    c.attention_bias = c.attention_sinks = false;
    LinearAttnConfig& la = c.linear;
    int inner = 0;
    for (const char* k :
         {"ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count"}) {
      if (!f.Find(p + k)) return DataLoss("gguf: qwen35 needs metadata '" + p + k + "' (llama.cpp requires it)");
    }
    QKV_RETURN_IF_ERROR(get_int("ssm.conv_kernel", &la.conv_kernel));
    QKV_RETURN_IF_ERROR(get_int("ssm.inner_size", &inner));
    QKV_RETURN_IF_ERROR(get_int("ssm.state_size", &la.k_dim));
    QKV_RETURN_IF_ERROR(get_int("ssm.time_step_rank", &la.n_v_heads));
    QKV_RETURN_IF_ERROR(get_int("ssm.group_count", &la.n_k_heads));
    if (inner % la.n_v_heads != 0) {
      return DataLoss("gguf: '" + p + "ssm.inner_size' must be a multiple of '" + p + "ssm.time_step_rank'");
    }
    la.v_dim = inner / la.n_v_heads;
    // Multi-token-prediction blocks follow the trunk's (llama.cpp runs them only for drafting): not loaded.
    const int64_t nextn = f.GetIntOr(p + "nextn_predict_layers", 0);
    if (nextn < 0 || nextn >= c.n_layers) return InvalidArgument("gguf: '" + p + "nextn_predict_layers' out of range");
    const int n_all = c.n_layers;
    c.n_layers -= static_cast<int>(nextn);
    c.recurrent.assign(static_cast<size_t>(c.n_layers), false);
    if (const GgufValue* v = f.Find(p + "attention.recurrent_layers")) {
      // llama.cpp's get_key_or_arr: one value for every layer, or one per layer (of n_layer_all).
      if (v->type == GgufType::kArray) {
        if (v->array.size() != static_cast<size_t>(n_all)) {
          return DataLoss("gguf: '" + p + "attention.recurrent_layers' must have one entry per block");
        }
        for (int l = 0; l < c.n_layers; ++l)
          c.recurrent[static_cast<size_t>(l)] = v->array[static_cast<size_t>(l)].u != 0;
      } else {
        for (int l = 0; l < c.n_layers; ++l) c.recurrent[static_cast<size_t>(l)] = v->u != 0;
      }
    } else {
      int interval = 4;
      if (f.Find(p + "full_attention_interval")) QKV_RETURN_IF_ERROR(get_int("full_attention_interval", &interval));
      for (int l = 0; l < c.n_layers; ++l) c.recurrent[static_cast<size_t>(l)] = (l + 1) % interval != 0;
    }
  }
  c.tied_embeddings = f.FindTensor("output.weight") == nullptr;
  const GgufTensor* emb = f.FindTensor("token_embd.weight");
  if (!emb) return DataLoss("gguf: missing tensor 'token_embd.weight'");
  if (emb->ne.size() != 2) return DataLoss("gguf: 'token_embd.weight' must be 2-D");
  if (emb->ne[1] > (1u << 22)) return DataLoss("gguf: 'token_embd.weight' has an absurd vocabulary");
  c.vocab = static_cast<int>(emb->ne[1]);
  // llama.cpp reads rope_freqs.weight for llama (Llama 3.1's rope scaling); for the other architectures here a
  // file holding it is left with an unused tensor, which the model refuses.
  if (const GgufTensor* t = f.FindTensor("rope_freqs.weight"); t && c.arch == Arch::kLlama) {
    f.UseTensor(t->name);
    if (t->type != GgmlType::kF32 || t->ne.size() != 1 || t->ne[0] != static_cast<uint64_t>(c.rotary_dim / 2)) {
      return DataLoss("gguf: 'rope_freqs.weight' must be f32 with rotary_dim / 2 = " +
                      std::to_string(c.rotary_dim / 2) + " values");
    }
    c.rope_freq_factors.resize(t->ne[0]);
    std::memcpy(c.rope_freq_factors.data(), t->data, t->ne[0] * sizeof(float));
  }
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
  // Qwen3.5 rotates a quarter of each head unless told (the converter's default partial_rotary_factor).
  double partial = arch == Arch::kQwen35 ? 0.25 : 1.0;
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {  // newer transformers nest them
    const nlohmann::json& rp = j["rope_parameters"];
    if (rp.contains("rope_theta") && rp["rope_theta"].is_number()) c.rope_theta = rp["rope_theta"].get<double>();
    if (rp.contains("partial_rotary_factor") && rp["partial_rotary_factor"].is_number()) {
      partial = rp["partial_rotary_factor"].get<double>();
    }
  }
  QKV_RETURN_IF_ERROR(getf("partial_rotary_factor", &partial));
  if (!(partial > 0 && partial <= 1)) return InvalidArgument("config: 'partial_rotary_factor' must be in (0, 1]");
  c.rotary_dim = static_cast<int>(c.head_dim * partial);
  c.rotary_dim -= c.rotary_dim % 2;
  // Architecture defaults as llama.cpp loads them: qwen2 has q/k/v biases, qwen3 (and qwen3moe) q/k norms.
  c.attention_bias = arch == Arch::kQwen2;
  c.qk_norm = arch == Arch::kQwen3 || arch == Arch::kQwen3Moe;
  QKV_RETURN_IF_ERROR(getb("tie_word_embeddings", &c.tied_embeddings));
  QKV_RETURN_IF_ERROR(getb("attention_bias", &c.attention_bias));
  QKV_RETURN_IF_ERROR(getb("qk_norm", &c.qk_norm));
  QKV_RETURN_IF_ERROR(getb("attn_output_gate", &c.attn_output_gate));
  QKV_RETURN_IF_ERROR(getb("attention_sinks", &c.attention_sinks));
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const nlohmann::json& rs = j["rope_scaling"];
    if (!rs.is_object()) return InvalidArgument("config: 'rope_scaling' must be an object or null");
    const nlohmann::json& ty = rs.contains("type") ? rs["type"] : rs.contains("rope_type") ? rs["rope_type"] : nullptr;
    if (!ty.is_string()) return InvalidArgument("config: 'rope_scaling.type' must be a string");
    const std::string type = ty.get<std::string>();
    auto num = [&](const char* k, double dflt) -> StatusOr<double> {
      if (!rs.contains(k) || rs[k].is_null()) return dflt;
      if (!rs[k].is_number()) return InvalidArgument(std::string("config: 'rope_scaling.") + k + "' must be a number");
      return rs[k].get<double>();
    };
    if (type == "llama3") {
      if (arch != Arch::kLlama) return Unimplemented("config: rope_scaling type 'llama3' is supported for llama only");
      QKV_ASSIGN_OR_RETURN(const double factor, num("factor", 8.0));
      QKV_ASSIGN_OR_RETURN(const double low, num("low_freq_factor", 1.0));
      QKV_ASSIGN_OR_RETURN(const double high, num("high_freq_factor", 4.0));
      QKV_ASSIGN_OR_RETURN(const double orig, num("original_max_position_embeddings", 8192.0));
      if (!(factor >= 1 && factor <= 1024) || !(low > 0) || !(high > low) || !(orig >= 1 && orig <= (1 << 22))) {
        return InvalidArgument(
            "config: 'rope_scaling' (llama3) needs factor in 1..1024, 0 < low_freq_factor < high_freq_factor and "
            "original_max_position_embeddings in 1..4194304");
      }
      c.rope_freq_factors = Llama3RopeFactors(c.rotary_dim, c.rope_theta, factor, low, high, orig);
    } else if (type != "default") {
      QKV_ASSIGN_OR_RETURN(c.rope_scaling, ParseRopeScaling(type));
    }
    QKV_ASSIGN_OR_RETURN(c.rope_factor, num("factor", 1.0));
    QKV_ASSIGN_OR_RETURN(double orig, num("original_max_position_embeddings", 0.0));
    if (!(orig >= 0 && orig <= (1 << 22))) {
      return InvalidArgument("config: 'rope_scaling.original_max_position_embeddings' out of range");
    }
    c.rope_orig_ctx = static_cast<int>(orig);
    // llama.cpp reads no beta keys for these architectures (its defaults 32 and 1 always apply), so a file
    // cannot carry other values faithfully.
    QKV_ASSIGN_OR_RETURN(double bf, num("beta_fast", 32.0));
    QKV_ASSIGN_OR_RETURN(double bs, num("beta_slow", 1.0));
    if (bf != 32.0 || bs != 1.0) {
      return InvalidArgument(
          "config: 'rope_scaling.beta_fast'/'beta_slow' other than 32/1 are not supported "
          "(llama.cpp uses 32 and 1 for this architecture)");
    }
    if (arch == Arch::kDeepseek2) {
      QKV_ASSIGN_OR_RETURN(c.rope_yarn_log_mul, num("mscale_all_dim", 0.0));
    }
    if (!c.rope_freq_factors.empty()) {  // llama3: all of it is in the factors, as in the converted file
      c.rope_factor = 1.0;
      c.rope_orig_ctx = 0;
    }
  }
  if (arch == Arch::kQwen35) {
    c.qk_norm = true;
    c.attn_output_gate = true;
    QKV_RETURN_IF_ERROR(getb("attn_output_gate", &c.attn_output_gate));
    LinearAttnConfig& la = c.linear;
    QKV_RETURN_IF_ERROR(geti("linear_conv_kernel_dim", &la.conv_kernel, true));
    QKV_RETURN_IF_ERROR(geti("linear_key_head_dim", &la.k_dim, true));
    QKV_RETURN_IF_ERROR(geti("linear_value_head_dim", &la.v_dim, true));
    QKV_RETURN_IF_ERROR(geti("linear_num_key_heads", &la.n_k_heads, true));
    QKV_RETURN_IF_ERROR(geti("linear_num_value_heads", &la.n_v_heads, true));
    c.recurrent.assign(static_cast<size_t>(c.n_layers), false);
    if (j.contains("layer_types") && !j["layer_types"].is_null()) {
      const nlohmann::json& lt = j["layer_types"];
      if (!lt.is_array() || lt.size() != static_cast<size_t>(c.n_layers)) {
        return InvalidArgument("config: 'layer_types' must list one type per layer");
      }
      for (size_t l = 0; l < lt.size(); ++l) {
        const std::string t = lt[l].is_string() ? lt[l].get<std::string>() : "";
        if (t != "linear_attention" && t != "full_attention") {
          return InvalidArgument("config: 'layer_types[" + std::to_string(l) +
                                 "]' must be \"linear_attention\" or \"full_attention\"");
        }
        c.recurrent[l] = t == "linear_attention";
      }
    } else {
      int interval = 4;
      QKV_RETURN_IF_ERROR(geti("full_attention_interval", &interval, false));
      for (int l = 0; l < c.n_layers; ++l) c.recurrent[static_cast<size_t>(l)] = (l + 1) % interval != 0;
    }
  }
  if (arch == Arch::kQwen3Moe) {
    c.qk_norm = true;
    QKV_RETURN_IF_ERROR(geti("num_experts", &c.moe.n_experts, true));
    QKV_RETURN_IF_ERROR(geti("num_experts_per_tok", &c.moe.n_used, true));
    QKV_RETURN_IF_ERROR(geti("moe_intermediate_size", &c.moe.expert_ffn, true));
    c.moe.gating = ExpertGating::kSoftmax;
    c.moe.norm_weights = true;
    bool norm = true;
    QKV_RETURN_IF_ERROR(getb("norm_topk_prob", &norm));
    if (!norm) {
      return InvalidArgument(
          "config: 'norm_topk_prob' false is not supported (llama.cpp always normalizes "
          "qwen3moe's top-k weights)");
    }
    int sparse_step = 1;
    QKV_RETURN_IF_ERROR(geti("decoder_sparse_step", &sparse_step, false));
    const bool mlp_only =
        j.contains("mlp_only_layers") && j["mlp_only_layers"].is_array() && !j["mlp_only_layers"].empty();
    if (sparse_step != 1 || mlp_only) {
      return InvalidArgument(
          "config: 'decoder_sparse_step'/'mlp_only_layers' (dense layers in qwen3moe) are not "
          "supported (llama.cpp reads every qwen3moe layer as MoE)");
    }
  }
  if (arch == Arch::kDeepseek2) {
    QKV_RETURN_IF_ERROR(geti("kv_lora_rank", &c.mla.kv_lora_rank, true));
    QKV_RETURN_IF_ERROR(geti("q_lora_rank", &c.mla.q_lora_rank, false));
    QKV_RETURN_IF_ERROR(geti("qk_nope_head_dim", &c.mla.qk_nope_dim, true));
    QKV_RETURN_IF_ERROR(geti("qk_rope_head_dim", &c.rotary_dim, true));
    QKV_RETURN_IF_ERROR(geti("v_head_dim", &c.mla.v_head_dim, true));
    QKV_RETURN_IF_ERROR(getb("legacy_kv_b", &c.mla.legacy_kv_b));
    QKV_RETURN_IF_ERROR(geti("n_routed_experts", &c.moe.n_experts, false));
    c.n_dense_lead = c.moe.n_experts > 0 ? 0 : c.n_layers;
    if (c.moe.n_experts > 0) {
      MoeConfig& m = c.moe;
      QKV_RETURN_IF_ERROR(geti("num_experts_per_tok", &m.n_used, true));
      QKV_RETURN_IF_ERROR(geti("moe_intermediate_size", &m.expert_ffn, true));
      if (j.contains("n_shared_experts") && j["n_shared_experts"].is_number_integer()) {
        m.n_shared = static_cast<int>(std::clamp<int64_t>(j["n_shared_experts"].get<int64_t>(), 0, 1 << 20));
      }
      QKV_RETURN_IF_ERROR(getb("norm_topk_prob", &m.norm_weights));
      QKV_RETURN_IF_ERROR(getf("routed_scaling_factor", &m.weights_scale));
      QKV_RETURN_IF_ERROR(geti("n_group", &m.n_groups, false));
      QKV_RETURN_IF_ERROR(geti("topk_group", &m.n_group_used, false));
      if (m.n_groups == 1) m.n_groups = m.n_group_used = 0;
      const std::string scoring = j.contains("scoring_func") && j["scoring_func"].is_string()
                                      ? j["scoring_func"].get<std::string>()
                                      : "softmax";
      if (scoring != "softmax" && scoring != "sigmoid") {
        return InvalidArgument("config: 'scoring_func' must be softmax or sigmoid, got '" + scoring + "'");
      }
      m.gating = scoring == "sigmoid" ? ExpertGating::kSigmoid : ExpertGating::kSoftmax;
      // DeepSeek-V3's "noaux_tc" routing adds e_score_correction_bias (exp_probs_b) for selection only.
      m.selection_bias = j.contains("topk_method") && j["topk_method"] == "noaux_tc";
    } else {
      c.moe.expert_ffn = c.ffn;  // written as expert_feed_forward_length, which llama.cpp requires
    }
    if (j.contains("first_k_dense_replace") && j["first_k_dense_replace"].is_number_integer()) {
      c.n_dense_lead = static_cast<int>(std::clamp<int64_t>(j["first_k_dense_replace"].get<int64_t>(), 0, c.n_layers));
    }
    if (c.n_dense_lead >= c.n_layers) c.n_dense_lead = c.n_layers;
    const bool lite = DeepseekLite(c.n_layers, c.vocab);
    if (lite && c.mla.q_lora_rank > 0) {
      return InvalidArgument(
          "config: with 26 or 27 layers llama.cpp reads no q_lora_rank (queries come from "
          "attn_q): set 'q_lora_rank' to null");
    }
    if (!lite && c.mla.q_lora_rank == 0) {
      return InvalidArgument(
          "config: 'q_lora_rank' null needs 26 or 27 layers (llama.cpp decides from the layer "
          "count whether queries have a low-rank path)");
    }
    c.head_dim = c.mla.kv_lora_rank + c.rotary_dim;
    c.n_kv_heads = 1;
    c.attention_bias = c.qk_norm = c.attn_output_gate = c.attention_sinks = false;
  }
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
  // deepseek2 files from before llama.cpp split attn_kv_b describe MHA (one kv head per query head).
  w.SetU32(p + "attention.head_count_kv", static_cast<uint32_t>(is_mla() && mla.legacy_kv_b ? n_heads : n_kv_heads));
  if (is_mla()) {  // as llama.cpp's converter writes DeepSeek-V2 (MLA as MQA with latent-wide heads)
    w.SetU32(p + "leading_dense_block_count", static_cast<uint32_t>(n_dense_lead));
    if (mla.q_lora_rank > 0) w.SetU32(p + "attention.q_lora_rank", static_cast<uint32_t>(mla.q_lora_rank));
    w.SetU32(p + "attention.kv_lora_rank", static_cast<uint32_t>(mla.kv_lora_rank));
    if (mla.legacy_kv_b) {
      w.SetU32(p + "attention.key_length", static_cast<uint32_t>(mla_qk_dim()));
      w.SetU32(p + "attention.value_length", static_cast<uint32_t>(mla.v_head_dim));
    } else {
      w.SetU32(p + "attention.key_length", static_cast<uint32_t>(head_dim));
      w.SetU32(p + "attention.value_length", static_cast<uint32_t>(mla.kv_lora_rank));
      w.SetU32(p + "attention.key_length_mla", static_cast<uint32_t>(mla_qk_dim()));
      w.SetU32(p + "attention.value_length_mla", static_cast<uint32_t>(mla.v_head_dim));
    }
    const bool experts = moe.n_experts > 0 && n_dense_lead < n_layers;
    w.SetU32(p + "expert_feed_forward_length", static_cast<uint32_t>(experts ? moe.expert_ffn : ffn));
    w.SetU32(p + "expert_shared_count", static_cast<uint32_t>(experts ? moe.n_shared : 0));
    if (experts) {  // as the converter writes them (only what the config has)
      w.SetU32(p + "expert_count", static_cast<uint32_t>(moe.n_experts));
      w.SetU32(p + "expert_used_count", static_cast<uint32_t>(moe.n_used));
      if (moe.n_groups > 1) {
        w.SetU32(p + "expert_group_count", static_cast<uint32_t>(moe.n_groups));
        w.SetU32(p + "expert_group_used_count", static_cast<uint32_t>(moe.n_group_used));
      }
      if (moe.weights_scale != 0.0) w.SetF32(p + "expert_weights_scale", static_cast<float>(moe.weights_scale));
      if (moe.norm_weights) w.SetBool(p + "expert_weights_norm", true);
      w.SetU32(p + "expert_gating_func", moe.gating == ExpertGating::kSigmoid ? 2 : 1);
    }
  } else {
    w.SetU32(p + "attention.key_length", static_cast<uint32_t>(head_dim));
    w.SetU32(p + "attention.value_length", static_cast<uint32_t>(head_dim));
  }
  w.SetU32(p + "rope.dimension_count", static_cast<uint32_t>(rotary_dim));
  if (is_hybrid()) {  // as llama.cpp's converter writes Qwen3.5 (Qwen3_5TextModel)
    w.SetU32(p + "ssm.conv_kernel", static_cast<uint32_t>(linear.conv_kernel));
    w.SetU32(p + "ssm.state_size", static_cast<uint32_t>(linear.k_dim));
    w.SetU32(p + "ssm.group_count", static_cast<uint32_t>(linear.n_k_heads));
    w.SetU32(p + "ssm.time_step_rank", static_cast<uint32_t>(linear.n_v_heads));
    w.SetU32(p + "ssm.inner_size", static_cast<uint32_t>(linear.v_dim * linear.n_v_heads));
    // The layer pattern: an interval when it is one (what the converter writes), else the per-layer flags.
    int interval = 0;
    for (int iv = 1; iv <= n_layers && interval == 0; ++iv) {
      bool match = true;
      for (int l = 0; l < n_layers && match; ++l) match = is_linear_layer(l) == ((l + 1) % iv != 0);
      if (match) interval = iv;
    }
    if (interval > 0) {
      w.SetU32(p + "full_attention_interval", static_cast<uint32_t>(interval));
    } else {
      GgufValue flags;
      flags.type = GgufType::kArray;
      flags.array_type = GgufType::kBool;
      for (int l = 0; l < n_layers; ++l) {
        GgufValue b;
        b.type = GgufType::kBool;
        b.u = is_linear_layer(l) ? 1 : 0;
        flags.array.push_back(b);
      }
      w.SetValue(p + "attention.recurrent_layers", flags);
    }
    // Text positions are the same in every M-RoPE section; llama.cpp requires the key (Qwen3.5's default).
    w.SetI32Array(p + "rope.dimension_sections", {11, 11, 10, 0});
  }
  if (arch == Arch::kQwen3Moe) {
    w.SetU32(p + "expert_count", static_cast<uint32_t>(moe.n_experts));
    w.SetU32(p + "expert_used_count", static_cast<uint32_t>(moe.n_used));
    w.SetU32(p + "expert_feed_forward_length", static_cast<uint32_t>(moe.expert_ffn));
  }
  if (rope_scaling != RopeScaling::kNone) {
    w.SetString(p + "rope.scaling.type", RopeScalingName(rope_scaling));
    w.SetF32(p + "rope.scaling.factor", static_cast<float>(rope_factor));
    if (rope_orig_ctx > 0) w.SetU32(p + "rope.scaling.original_context_length", static_cast<uint32_t>(rope_orig_ctx));
    if (is_mla() && rope_yarn_log_mul != 0.0) {
      w.SetF32(p + "rope.scaling.yarn_log_multiplier", static_cast<float>(0.1 * rope_yarn_log_mul));
    }
  }
  w.SetU32(p + "vocab_size", static_cast<uint32_t>(vocab));
  w.SetF32(p + "rope.freq_base", static_cast<float>(rope_theta));
  w.SetF32(p + "attention.layer_norm_rms_epsilon", static_cast<float>(rms_eps));
  if (attn_output_gate && !is_hybrid()) w.SetBool(kKeyOutputGate, true);
  if (attention_sinks) w.SetBool(kKeySinks, true);
}

std::string ModelConfig::Summary() const {
  std::ostringstream o;
  o << ArchName(arch) << " hidden=" << hidden << " layers=" << n_layers << " heads=" << n_heads
    << " kv_heads=" << n_kv_heads << " (" << AttentionKind() << ") head_dim=" << head_dim
    << " rotary_dim=" << rotary_dim << " ffn=" << ffn << " vocab=" << vocab << " ctx=" << context_length
    << (tied_embeddings ? " tied" : "") << (attention_bias ? " bias" : "") << (qk_norm ? " qk_norm" : "")
    << (attn_output_gate ? " output_gate" : "") << (attention_sinks ? " sinks" : "");
  if (moe.n_experts > 0) {
    o << " experts=" << moe.n_experts << " used=" << moe.n_used << " expert_ffn=" << moe.expert_ffn;
    if (moe.n_shared) o << " shared=" << moe.n_shared;
    if (n_dense_lead) o << " dense_lead=" << n_dense_lead;
  }
  if (is_hybrid()) {
    o << " linear_layers=" << n_layers - n_attention_layers() << " (k_heads=" << linear.n_k_heads
      << " v_heads=" << linear.n_v_heads << " k_dim=" << linear.k_dim << " v_dim=" << linear.v_dim
      << " conv=" << linear.conv_kernel << ")";
  }
  if (is_mla()) {
    o << " kv_lora_rank=" << mla.kv_lora_rank << " q_lora_rank=" << mla.q_lora_rank << " qk_nope=" << mla.qk_nope_dim
      << " v_head=" << mla.v_head_dim << (mla.legacy_kv_b ? " kv_b" : "");
  }
  if (rope_scaling != RopeScaling::kNone) {
    o << " rope_scaling=" << RopeScalingName(rope_scaling) << "x" << rope_factor;
    if (rope_orig_ctx > 0) o << " orig_ctx=" << rope_orig_ctx;
  }
  if (!rope_freq_factors.empty()) {
    o << " rope_freqs=" << *std::min_element(rope_freq_factors.begin(), rope_freq_factors.end()) << ".."
      << *std::max_element(rope_freq_factors.begin(), rope_freq_factors.end());
  }
  return o.str();
}

}  // namespace qkv
