// Grouped-query attention (MHA, GQA, MQA): h = RMSNorm(x) → [q | gate | k | v] = h·W_QKVᵀ (+b) → q/k RMSNorm
// (optional) → RoPE(q, k) → store k, v in the paged KV arena → causal attention over the cache (sinks
// optional) → × sigmoid(gate) (optional) → x += attn·W_Oᵀ.
#include <omp.h>

#include "engine/kernels/attention.h"
#include "engine/kernels/parallel.h"
#include "engine/layers/layer.h"

namespace qkv {
namespace {

class GqaAttention final : public Layer {
 public:
  std::string_view kind() const override { return "gqa_attention"; }
  size_t weight_bytes() const override {
    return qkv_->weight_bytes() + o_->weight_bytes() +
           4 * (norm_.size() + q_norm_.size() + k_norm_.size() + sinks_.size() + bias_floats_);
  }
  size_t weight_bytes_per_token() const override { return qkv_->weight_bytes() + o_->weight_bytes(); }
  void ForEachLinear(const std::function<void(const Linear&)>& f) const override {
    f(*qkv_);
    f(*o_);
  }
  CacheSpec cache() const override {  // K and V of every kv head
    return {int64_t{2} * c_.n_kv_heads * KvVectorBytes(kv_dtype_, c_.head_dim), 0};
  }
  size_t scratch_floats_per_thread(int n_ctx, int block_size) const override {
    return AttentionScratchFloats(c_.n_heads / c_.n_kv_heads, n_ctx, c_.head_dim, block_size);
  }

  static StatusOr<std::unique_ptr<Layer>> Make(const LayerInit& in);
  void Forward(float* x, const StepRows& rows, const LayerScratch& s) override;
  bool team_ready() const override { return qkv_->team_ready() && o_->team_ready(); }
  size_t team_floats() const override { return static_cast<size_t>(PaddedRows(1)) * c_.hidden; }
  void ForwardTeam(float* x, const StepRows& rows, const LayerScratch& s) override;

 private:
  ModelConfig c_;
  DType kv_dtype_ = DType::kBF16;
  int kv_layer_ = 0;
  const RopeTable* rope_ = nullptr;
  std::vector<float> norm_, q_norm_, k_norm_, sinks_;
  size_t bias_floats_ = 0;
  std::unique_ptr<Linear> qkv_, o_;
};

StatusOr<std::unique_ptr<Layer>> GqaAttention::Make(const LayerInit& in) {
  const ModelConfig& c = in.config;
  auto L = std::make_unique<GqaAttention>();
  L->c_ = c;
  L->kv_dtype_ = in.kv_dtype;
  L->kv_layer_ = in.kv_layer;
  L->rope_ = in.rope;
  const auto H = static_cast<uint64_t>(c.hidden);
  const int hd = c.head_dim;
  const int q_rows = c.q_dim() * (c.attn_output_gate ? 2 : 1);
  const std::string p = "blk." + std::to_string(in.block) + ".";
  QKV_ASSIGN_OR_RETURN(L->norm_, ReadTensor(in.file, p + "attn_norm.weight", {H}));
  std::vector<float> bq, bk, bv;
  if (c.attention_bias) {
    QKV_ASSIGN_OR_RETURN(bq, ReadTensor(in.file, p + "attn_q.bias", {static_cast<uint64_t>(q_rows)}));
    QKV_ASSIGN_OR_RETURN(bk, ReadTensor(in.file, p + "attn_k.bias", {static_cast<uint64_t>(c.kv_dim())}));
    QKV_ASSIGN_OR_RETURN(bv, ReadTensor(in.file, p + "attn_v.bias", {static_cast<uint64_t>(c.kv_dim())}));
  }
  if (c.qk_norm) {
    QKV_ASSIGN_OR_RETURN(L->q_norm_, ReadTensor(in.file, p + "attn_q_norm.weight", {static_cast<uint64_t>(hd)}));
    QKV_ASSIGN_OR_RETURN(L->k_norm_, ReadTensor(in.file, p + "attn_k_norm.weight", {static_cast<uint64_t>(hd)}));
  }
  if (c.attention_sinks) {
    QKV_ASSIGN_OR_RETURN(L->sinks_, ReadTensor(in.file, p + "attn_sinks.weight", {static_cast<uint64_t>(c.n_heads)}));
  }
  // Fused QKV rows: [queries of all heads | gates of all heads | k | v]. With the output gate, the
  // file's q_proj interleaves [query, gate] per head (Qwen3-Next); de-interleave it here.
  const auto QR = static_cast<uint64_t>(q_rows), KVR = static_cast<uint64_t>(c.kv_dim());
  const std::string tq = p + "attn_q.weight", tk = p + "attn_k.weight", tv = p + "attn_v.weight";
  std::vector<WeightRows> rows;
  std::vector<float> b;
  auto append_rows = [&](const std::string& t, uint64_t total, const std::vector<float>& sb, int r0, int n) {
    rows.push_back({t, total, r0, n});
    if (c.attention_bias) b.insert(b.end(), sb.begin() + r0, sb.begin() + r0 + n);
  };
  if (c.attn_output_gate) {
    for (int h = 0; h < c.n_heads; ++h) append_rows(tq, QR, bq, 2 * h * hd, hd);
    for (int h = 0; h < c.n_heads; ++h) append_rows(tq, QR, bq, 2 * h * hd + hd, hd);
  } else {
    append_rows(tq, QR, bq, 0, q_rows);
  }
  append_rows(tk, KVR, bk, 0, c.kv_dim());
  append_rows(tv, KVR, bv, 0, c.kv_dim());
  L->bias_floats_ = b.size();
  QKV_ASSIGN_OR_RETURN(L->qkv_, MakeLinear(in.file, in.gemm, in.weights_dtype, in.keep_quantized, rows, c.hidden,
                                           c.attention_bias ? b.data() : nullptr));
  QKV_ASSIGN_OR_RETURN(L->o_, MakeLinear(in.file, in.gemm, in.weights_dtype, in.keep_quantized,
                                         {{p + "attn_output.weight", H, 0, c.hidden}}, c.q_dim(), nullptr));
  return std::unique_ptr<Layer>(std::move(L));
}

void GqaAttention::Forward(float* x, const StepRows& rows, const LayerScratch& s) {
  const ModelConfig& c = c_;
  const int T = rows.T, H = c.hidden, hd = c.head_dim, nthr = s.n_threads;
  const int q_dim = c.q_dim(), kv_dim = c.kv_dim();
  const int gate_off = q_dim;
  const int k_off = q_dim * (c.attn_output_gate ? 2 : 1);
  const int v_off = k_off + kv_dim;
  const int qkv_n = v_off + kv_dim;
  const float eps = static_cast<float>(c.rms_eps);
  const RopeStyle style = RopeStyleOf(c.arch);
  ForwardProfile& pf = *s.profile;
  float* h = s.h;
  float* qkv = s.qkv;
  float* attn = s.attn;

  ParallelRows(T, nthr, [&](int t) {
    RmsNorm(&x[static_cast<size_t>(t) * H], norm_.data(), &h[static_cast<size_t>(t) * H], H, eps);
  });
  s.timer->Mark(pf.norms);
  s.Gemm(*qkv_, h, T, qkv);
  s.timer->Mark(pf.qkv);

  // q/k norm, RoPE (Q and K only; V is stored as projected), then K/V into the cache.
  ParallelRows(T, nthr, [&](int t) {
    float* row = &qkv[static_cast<size_t>(t) * qkv_n];
    const int pos = rows.pos[t];
    for (int hh = 0; hh < c.n_heads; ++hh) {
      float* q = row + hh * hd;
      if (c.qk_norm) RmsNorm(q, q_norm_.data(), q, hd, eps);
      if (c.rotary_dim > 0) rope_->Apply(q, pos, style);
    }
    for (int hh = 0; hh < c.n_kv_heads; ++hh) {
      float* k = row + k_off + hh * hd;
      if (c.qk_norm) RmsNorm(k, k_norm_.data(), k, hd, eps);
      if (c.rotary_dim > 0) rope_->Apply(k, pos, style);
    }
    const BatchChunk& ch = rows.batch[rows.chunk_of[t]];
    StoreKv(*s.kv, kv_layer_, ch.seq->blocks.data(), pos, row + k_off, row + v_off);
  });
  s.timer->Mark(pf.rope_store);

  AttentionShape as{c.n_heads, c.n_kv_heads, hd, c.attention_sinks ? sinks_.data() : nullptr};
  const int items = T * c.n_kv_heads;
  ParallelItems(items, nthr, [&](int it) {
    const int t = it / c.n_kv_heads, g = it % c.n_kv_heads;
    const BatchChunk& ch = rows.batch[rows.chunk_of[t]];
    float* scratch = &s.attn_per_thread[s.attn_stride * omp_get_thread_num()];
    AttendGroup(*s.kv, kv_layer_, ch.seq->blocks.data(), rows.pos[t] + 1, &qkv[static_cast<size_t>(t) * qkv_n],
                &attn[static_cast<size_t>(t) * q_dim], as, g, scratch);
  });
  if (c.attn_output_gate) {
    for (int t = 0; t < T; ++t) {
      float* a = &attn[static_cast<size_t>(t) * q_dim];
      const float* gt = &qkv[static_cast<size_t>(t) * qkv_n + gate_off];
      for (int i = 0; i < q_dim; ++i) a[i] *= 1.0f / (1.0f + FastExp(-gt[i]));
    }
  }
  s.timer->Mark(pf.attention);
  s.Gemm(*o_, attn, T, s.tmp);
  AddInPlace(x, s.tmp, T * H);
  s.timer->Mark(pf.o);
}

// One token, every thread of the team: each thread normalizes the row for itself and computes its share
// of the QKV columns; after a barrier, one work item per kv head (each thread a fixed run of them) does that
// group's q/k norm and RoPE, stores the head's K/V and attends (no other item reads them); after the loop's barrier,
// each thread adds its share of the o projection to x. The same operations on the same values as Forward.
void GqaAttention::ForwardTeam(float* x, const StepRows& rows, const LayerScratch& s) {
  const ModelConfig& c = c_;
  const int hd = c.head_dim, q_dim = c.q_dim(), kv_dim = c.kv_dim();
  const int k_off = q_dim * (c.attn_output_gate ? 2 : 1), v_off = k_off + kv_dim;
  const int group = c.n_heads / c.n_kv_heads, me = omp_get_thread_num();
  const float eps = static_cast<float>(c.rms_eps);
  const RopeStyle style = RopeStyleOf(c.arch);
  ForwardProfile& pf = *s.profile;
  PhaseTimer* timer = me == 0 ? s.timer : nullptr;
  float* qkv = s.qkv;
  float* attn = s.attn;
  s.TeamNormShare(x, norm_, eps, *qkv_, qkv);
  s.Barrier();
  if (timer) timer->Mark(pf.qkv);
  const int pos = rows.pos[0];
  const int* blocks = rows.batch[rows.chunk_of[0]].seq->blocks.data();
  const AttentionShape as{c.n_heads, c.n_kv_heads, hd, c.attention_sinks ? sinks_.data() : nullptr};
  // Each thread a fixed run of consecutive kv heads (static), the same for every layer and token: with
  // dynamic, one item at a time, decode attention took ~20% more time at 512-1536 positions of context
  // (docs/performance.md, "Decode attention: a fixed share of kv heads per thread").
#pragma omp for schedule(static) nowait
  for (int g = 0; g < c.n_kv_heads; ++g) {
    for (int hh = g * group; hh < (g + 1) * group; ++hh) {
      float* q = qkv + hh * hd;
      if (c.qk_norm) RmsNorm(q, q_norm_.data(), q, hd, eps);
      if (c.rotary_dim > 0) rope_->Apply(q, pos, style);
    }
    float* k = qkv + k_off + g * hd;
    if (c.qk_norm) RmsNorm(k, k_norm_.data(), k, hd, eps);
    if (c.rotary_dim > 0) rope_->Apply(k, pos, style);
    StoreKvHead(*s.kv, kv_layer_, blocks, pos, g, k, qkv + v_off + g * hd);
    float* scratch = &s.attn_per_thread[s.attn_stride * me];
    AttendGroup(*s.kv, kv_layer_, blocks, pos + 1, qkv, attn, as, g, scratch);
    if (c.attn_output_gate) {
      const float* gt = qkv + q_dim;
      for (int i = g * group * hd; i < (g + 1) * group * hd; ++i) attn[i] *= 1.0f / (1.0f + FastExp(-gt[i]));
    }
  }
  s.Barrier();
  if (timer) timer->Mark(pf.attention);
  o_->ForwardShare(attn, 1, s.tmp, [&](int c0, int c1) { AddInPlace(x + c0, s.tmp + c0, c1 - c0); });
  s.Barrier();
  if (timer) timer->Mark(pf.o);
}

}  // namespace

StatusOr<std::unique_ptr<Layer>> MakeGqaAttention(const LayerInit& in) { return GqaAttention::Make(in); }

}  // namespace qkv
