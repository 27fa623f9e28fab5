#include "engine/random_model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <span>
#include <vector>

#include "engine/chat_template.h"
#include "engine/quantize.h"
#include "engine/rng.h"
#include "engine/tokenizer.h"

namespace qkv {

Status WriteRandomModel(const ModelConfig& cfg, const RandomModelOptions& opt, const std::string& path) {
  QKV_RETURN_IF_ERROR(cfg.Validate());
  GgufWriter w;
  cfg.ToGguf(w);
  w.SetString("general.name", std::string("qkvserve random ") + ArchName(cfg.arch));
  if (!opt.chat_stop.empty()) w.SetStringArray(kKeyChatStop, opt.chat_stop);
  std::optional<QuantTypePlan> plan;
  if (!opt.preset.empty()) {
    const std::optional<QuantPreset> p = FindQuantPreset(opt.preset);
    if (!p) return InvalidArgument("unknown quantization preset '" + opt.preset + "' (" + QuantPresetNames() + ")");
    plan.emplace(*p, cfg.n_layers, cfg.n_heads / cfg.n_kv_heads, cfg.tied_embeddings);
    w.SetU32("general.file_type", p->file_type);
  } else {
    w.SetU32("general.file_type", GgmlFileType(opt.dtype));
  }
  QKV_ASSIGN_OR_RETURN(BpeVocab vocab, MakeSyntheticByteBpe(cfg.vocab, opt.seed));
  vocab.ToGguf(w);

  Rng rng(opt.seed * 0x9E3779B97F4A7C15ull + 1);
  auto uniform = [&](size_t n, double stddev, double mean) {
    std::vector<float> v(n);
    const double a = std::sqrt(3.0) * stddev;
    for (auto& x : v) x = static_cast<float>(mean + (2.0 * rng.Uniform() - 1.0) * a);
    return v;
  };
  // Every tensor's values are drawn when the writer streams it, in the order the tensors are added (the same
  // draws as drawing them here), so only one tensor is in memory at a time; rows are encoded on opt.threads.
  const int threads = std::max(1, opt.threads);
  auto add = [&](const std::string& name, GgmlType t, std::vector<uint64_t> ne, double stddev, double mean,
                 std::function<void(std::vector<float>&)> post = nullptr) {
    const uint64_t cols = ne[0];
    uint64_t rows = 1;
    for (size_t i = 1; i < ne.size(); ++i) rows *= ne[i];
    w.AddTensor(name, t, std::move(ne), [&uniform, t, rows, cols, stddev, mean, threads, post](std::span<uint8_t> dst) {
      std::vector<float> v = uniform(static_cast<size_t>(rows * cols), stddev, mean);
      if (post) post(v);
      EncodeRowsFromF32(v.data(), rows, cols, t, dst.data(), threads);
      return Status{};
    });
  };
  auto matrix = [&](const std::string& name, int rows, int cols, double stddev) {
    // Rows that are not whole blocks of the type take llama-quantize's fallback type.
    const std::vector<uint64_t> ne{static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
    const GgmlType t = plan ? plan->TypeFor(name, ne, GgmlType::kF32) : GgmlFallbackType(opt.dtype, ne[0]);
    add(name, t, ne, stddev, 0.0);
  };
  // One [rows, cols] matrix per plane, stored as a 3-D tensor ne = {cols, rows, planes} (llama.cpp's per-head
  // attn_k_b / attn_v_b).
  auto planes = [&](const std::string& name, int n_planes, int rows, int cols, double stddev) {
    const std::vector<uint64_t> ne{static_cast<uint64_t>(cols), static_cast<uint64_t>(rows),
                                   static_cast<uint64_t>(n_planes)};
    const GgmlType t = plan ? plan->TypeFor(name, ne, GgmlType::kF32) : GgmlFallbackType(opt.dtype, ne[0]);
    add(name, t, ne, stddev, 0.0);
  };
  auto vec = [&](const std::string& name, int n, double stddev, double mean) {
    add(name, GgmlType::kF32, {static_cast<uint64_t>(n)}, stddev, mean);
  };
  const int H = cfg.hidden;
  const int q_rows = cfg.q_dim() * (cfg.attn_output_gate ? 2 : 1);
  matrix("token_embd.weight", cfg.vocab, H, 1.0);
  if (!cfg.rope_freq_factors.empty()) {  // llama3 rope scaling, as llama.cpp's converter writes it
    const auto& ff = cfg.rope_freq_factors;
    w.AddTensor("rope_freqs.weight", GgmlType::kF32, {ff.size()}, EncodeFromF32(ff.data(), ff.size(), GgmlType::kF32));
  }
  for (int l = 0; l < cfg.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    vec(p + "attn_norm.weight", H, 0.1, 1.0);
    if (cfg.is_mla()) {  // deepseek2's tensors as llama.cpp's converter writes them
      const MlaConfig& m = cfg.mla;
      const int nh = cfg.n_heads, R = m.kv_lora_rank, P = cfg.rotary_dim, dk = cfg.mla_qk_dim();
      if (m.q_lora_rank > 0) {
        matrix(p + "attn_q_a.weight", m.q_lora_rank, H, 1.0 / std::sqrt(H));
        vec(p + "attn_q_a_norm.weight", m.q_lora_rank, 0.1, 1.0);
        matrix(p + "attn_q_b.weight", nh * dk, m.q_lora_rank, 1.0 / std::sqrt(m.q_lora_rank));
      } else {
        matrix(p + "attn_q.weight", nh * dk, H, 1.0 / std::sqrt(H));
      }
      matrix(p + "attn_kv_a_mqa.weight", R + P, H, 1.0 / std::sqrt(H));
      vec(p + "attn_kv_a_norm.weight", R, 0.1, 1.0);
      if (m.legacy_kv_b) {
        matrix(p + "attn_kv_b.weight", nh * (m.qk_nope_dim + m.v_head_dim), R, 1.0 / std::sqrt(R));
      } else {
        planes(p + "attn_k_b.weight", nh, R, m.qk_nope_dim, 1.0 / std::sqrt(R));
        planes(p + "attn_v_b.weight", nh, m.v_head_dim, R, 1.0 / std::sqrt(R));
      }
      matrix(p + "attn_output.weight", H, nh * m.v_head_dim, 1.0 / std::sqrt(nh * m.v_head_dim));
      vec(p + "ffn_norm.weight", H, 0.1, 1.0);
      if (!cfg.is_moe_block(l)) {
        matrix(p + "ffn_gate.weight", cfg.ffn, H, 1.0 / std::sqrt(H));
        matrix(p + "ffn_up.weight", cfg.ffn, H, 1.0 / std::sqrt(H));
        matrix(p + "ffn_down.weight", H, cfg.ffn, 1.0 / std::sqrt(cfg.ffn));
        continue;
      }
    } else if (cfg.is_linear_layer(l)) {  // a Gated DeltaNet layer, as llama.cpp's converter writes Qwen3.5
      const LinearAttnConfig& la = cfg.linear;
      const int ch = la.conv_channels(), vd = la.n_v_heads * la.v_dim, nv = la.n_v_heads;
      matrix(p + "attn_qkv.weight", ch, H, 1.0 / std::sqrt(H));
      matrix(p + "attn_gate.weight", vd, H, 1.0 / std::sqrt(H));
      // The conv kernel stays f32 (llama.cpp's ssm_conv takes f32; llama-quantize leaves it).
      add(p + "ssm_conv1d.weight", GgmlType::kF32, {static_cast<uint64_t>(la.conv_kernel), static_cast<uint64_t>(ch)},
          1.0 / std::sqrt(la.conv_kernel), 0.0);
      vec(p + "ssm_dt.bias", nv, 0.5, -1.0);
      // ssm_a = −exp(A_log), A_log in [−3, 0]: per-token decays e^g between about 0.75 and 0.99.
      add(p + "ssm_a", GgmlType::kF32, {static_cast<uint64_t>(nv)}, 0.866, -1.5, [](std::vector<float>& a) {
        for (float& e : a) e = -std::exp(e);
      });
      matrix(p + "ssm_beta.weight", nv, H, 1.0 / std::sqrt(H));
      matrix(p + "ssm_alpha.weight", nv, H, 1.0 / std::sqrt(H));
      vec(p + "ssm_norm.weight", la.v_dim, 0.1, 1.0);
      matrix(p + "ssm_out.weight", H, vd, 1.0 / std::sqrt(vd));
      vec(cfg.FfnNormName(l), H, 0.1, 1.0);
    } else {
      matrix(p + "attn_q.weight", q_rows, H, 1.0 / std::sqrt(H));
      matrix(p + "attn_k.weight", cfg.kv_dim(), H, 1.0 / std::sqrt(H));
      matrix(p + "attn_v.weight", cfg.kv_dim(), H, 1.0 / std::sqrt(H));
      if (cfg.attention_bias) {
        vec(p + "attn_q.bias", q_rows, 0.1, 0.0);
        vec(p + "attn_k.bias", cfg.kv_dim(), 0.1, 0.0);
        vec(p + "attn_v.bias", cfg.kv_dim(), 0.1, 0.0);
      }
      if (cfg.qk_norm) {
        vec(p + "attn_q_norm.weight", cfg.head_dim, 0.1, 1.0);
        vec(p + "attn_k_norm.weight", cfg.head_dim, 0.1, 1.0);
      }
      if (cfg.attention_sinks) vec(p + "attn_sinks.weight", cfg.n_heads, 1.0, 0.0);
      matrix(p + "attn_output.weight", H, cfg.q_dim(), 1.0 / std::sqrt(cfg.q_dim()));
      vec(cfg.FfnNormName(l), H, 0.1, 1.0);
    }
    if (cfg.is_moe_block(l)) {  // stacked experts, as llama.cpp's converters write them
      const MoeConfig& m = cfg.moe;
      matrix(p + "ffn_gate_inp.weight", m.n_experts, H, 1.0 / std::sqrt(H));
      planes(p + "ffn_gate_exps.weight", m.n_experts, m.expert_ffn, H, 1.0 / std::sqrt(H));
      planes(p + "ffn_up_exps.weight", m.n_experts, m.expert_ffn, H, 1.0 / std::sqrt(H));
      planes(p + "ffn_down_exps.weight", m.n_experts, H, m.expert_ffn, 1.0 / std::sqrt(m.expert_ffn));
      if (m.selection_bias) vec(p + "exp_probs_b.bias", m.n_experts, 0.05, 0.0);
      if (m.n_shared > 0) {
        const int SF = m.n_shared * m.expert_ffn;
        matrix(p + "ffn_gate_shexp.weight", SF, H, 1.0 / std::sqrt(H));
        matrix(p + "ffn_up_shexp.weight", SF, H, 1.0 / std::sqrt(H));
        matrix(p + "ffn_down_shexp.weight", H, SF, 1.0 / std::sqrt(SF));
      }
      continue;
    }
    matrix(p + "ffn_gate.weight", cfg.ffn, H, 1.0 / std::sqrt(H));
    matrix(p + "ffn_up.weight", cfg.ffn, H, 1.0 / std::sqrt(H));
    matrix(p + "ffn_down.weight", H, cfg.ffn, 1.0 / std::sqrt(cfg.ffn));
  }
  vec("output_norm.weight", H, 0.1, 1.0);
  if (!cfg.tied_embeddings) matrix("output.weight", cfg.vocab, H, 1.0 / std::sqrt(H));
  return w.WriteFile(path);
}

}  // namespace qkv
