// Multi-head latent attention (DeepSeek-V2/V3, GGUF architecture deepseek2 as llama.cpp reads it), in the
// absorbed form for prefill and decode alike:
//   h = RMSNorm(x) → [q_a | kv] = h·[W_QA; W_KVA]ᵀ (no low-rank path: [q | kv] = h·[W_Q; W_KVA]ᵀ)
//   → q = RMSNorm(q_a)·W_QBᵀ, per head [q_nope (qk_nope) | q_pe (qk_rope)]
//   → kv = [c (kv_lora_rank) | k_pe (qk_rope)]: c = RMSNorm(c), k_pe = RoPE(k_pe), q_pe = RoPE(q_pe)
//   → store c and k_pe (the whole cache of this layer: nothing per head)
//   → per head q_lat = W_UKᵀ q_nope (into latent space), attention over [c | k_pe] with [q_lat | q_pe]
//     (kernels/mla_attention.h), o_lat = Σ w c → o = W_UV o_lat per head → x += [o_heads]·W_Oᵀ.
// Absorption (q_lat · c = q_nope · W_UK c) is exact in real arithmetic; it is what lets the cache hold the
// latent instead of K and V per head. llama.cpp's files carry W_UK per head already transposed for it
// (attn_k_b {qk_nope, kv_lora_rank, n_head}) and W_UV as attn_v_b {kv_lora_rank, v_head, n_head}; older
// files carry one attn_kv_b, split (and W_UK transposed) here at load.
#include "engine/kernels/mla_attention.h"

#include <omp.h>

#include <algorithm>

#include "engine/kernels/parallel.h"
#include "engine/layers/layer.h"

namespace qkv {
namespace {

// An MLA layer's scratch for max_rows rows (what one step needs, nothing kept between steps): the first
// GEMM's rows, the low-rank query path, the absorbed queries, the latent outputs, the heads' outputs. Shared
// by the model's layers of the same sizes (SharedScratch).
struct MlaBuffers {
  std::vector<float> a, qa, q, qm, ol, ao;
  size_t bytes() const { return sizeof(float) * (a.size() + qa.size() + q.size() + qm.size() + ol.size() + ao.size()); }
};

class MlaAttention final : public Layer {
 public:
  std::string_view kind() const override { return "mla_attention"; }
  size_t weight_bytes() const override {
    return weight_bytes_per_token() + 4 * (norm_.size() + q_a_norm_.size() + kv_a_norm_.size());
  }
  size_t weight_bytes_per_token() const override {
    size_t n = a_->weight_bytes() + o_->weight_bytes() + (q_b_ ? q_b_->weight_bytes() : 0);
    for (const auto& w : k_b_) n += w.bytes();
    for (const auto& w : v_b_) n += w.bytes();
    return n;
  }
  void ForEachLinear(const std::function<void(const Linear&)>& f) const override {
    f(*a_);
    if (q_b_) f(*q_b_);
    f(*o_);
  }
  CacheSpec cache() const override {  // one latent and one rope key per token: nothing per head
    return {KvVectorBytes(kv_dtype_, R_) + KvVectorBytes(kv_dtype_, P_), 0};
  }
  size_t scratch_floats_per_thread(int n_ctx, int block_size) const override {
    return LatentAttentionScratchFloats(nh_, n_ctx, block_size);
  }
  // (its scratch is shared with the model's other MLA layers: SharedScratch counts it)
  size_t scratch_bytes() const override { return 0; }

  static StatusOr<std::unique_ptr<Layer>> Make(const LayerInit& in);
  void Forward(float* x, const StepRows& rows, const LayerScratch& s) override;
  bool team_ready() const override { return a_->team_ready() && (!q_b_ || q_b_->team_ready()) && o_->team_ready(); }
  size_t team_floats() const override { return static_cast<size_t>(PaddedRows(1)) * std::max(c_.hidden, ql_); }
  void ForwardTeam(float* x, const StepRows& rows, const LayerScratch& s) override;

 private:
  ModelConfig c_;
  DType kv_dtype_ = DType::kBF16;
  int kv_layer_ = 0;
  const RopeTable* rope_ = nullptr;
  int nh_ = 0, R_ = 0, P_ = 0, dn_ = 0, dv_ = 0, dk_ = 0, ql_ = 0;
  int a_n_ = 0, kv_off_ = 0;  // the first GEMM's width and where [c | k_pe] starts in its rows
  float scale_ = 1.0f;
  std::vector<float> norm_, q_a_norm_, kv_a_norm_;
  std::unique_ptr<Linear> a_, q_b_, o_;
  // Per head: W_UKᵀ [R, qk_nope] and W_UV [v_head, R], small enough to run one head per thread on the
  // engine's own packed GEMM (strided rows in and out, the same bits at every kernel level); held as bf16
  // or f32 (the weights dtype), also when the file has them quantized.
  std::vector<PackedWeights> k_b_, v_b_;
  // Scratch for max_rows rows, sized at load, shared by the model's layers of the same sizes.
  std::shared_ptr<MlaBuffers> b_;
};

StatusOr<std::unique_ptr<Layer>> MlaAttention::Make(const LayerInit& in) {
  const ModelConfig& c = in.config;
  auto L = std::make_unique<MlaAttention>();
  L->c_ = c;
  L->kv_dtype_ = in.kv_dtype;
  L->kv_layer_ = in.kv_layer;
  L->rope_ = in.rope;
  L->nh_ = c.n_heads;
  L->R_ = c.mla.kv_lora_rank;
  L->P_ = c.rotary_dim;
  L->dn_ = c.mla.qk_nope_dim;
  L->dv_ = c.mla.v_head_dim;
  L->dk_ = c.mla_qk_dim();
  L->ql_ = c.mla.q_lora_rank;
  L->scale_ = c.AttentionScale();
  const int nh = L->nh_, R = L->R_, P = L->P_, dn = L->dn_, dv = L->dv_, dk = L->dk_, ql = L->ql_;
  const auto H = static_cast<uint64_t>(c.hidden);
  const auto U = [](int v) { return static_cast<uint64_t>(v); };
  const std::string p = "blk." + std::to_string(in.block) + ".";
  auto mk = [&](const std::vector<WeightRows>& rows, int k) {
    return MakeLinear(in.file, in.gemm, in.weights_dtype, in.keep_quantized, rows, k, nullptr);
  };
  QKV_ASSIGN_OR_RETURN(L->norm_, ReadTensor(in.file, p + "attn_norm.weight", {H}));
  QKV_ASSIGN_OR_RETURN(L->kv_a_norm_, ReadTensor(in.file, p + "attn_kv_a_norm.weight", {U(R)}));
  // One GEMM over h for the query path's first step and the latent + rope key.
  std::vector<WeightRows> first;
  if (ql > 0) {
    QKV_ASSIGN_OR_RETURN(L->q_a_norm_, ReadTensor(in.file, p + "attn_q_a_norm.weight", {U(ql)}));
    first.push_back({p + "attn_q_a.weight", U(ql), 0, ql});
    L->kv_off_ = ql;
  } else {
    first.push_back({p + "attn_q.weight", U(nh * dk), 0, nh * dk});
    L->kv_off_ = nh * dk;
  }
  first.push_back({p + "attn_kv_a_mqa.weight", U(R + P), 0, R + P});
  L->a_n_ = L->kv_off_ + R + P;
  QKV_ASSIGN_OR_RETURN(L->a_, mk(first, c.hidden));
  if (ql > 0) {
    QKV_ASSIGN_OR_RETURN(L->q_b_, mk({{p + "attn_q_b.weight", U(nh * dk), 0, nh * dk}}, ql));
  }
  // Per-head W_UKᵀ ([R, qk_nope] row-major) and W_UV ([v_head, R]) as f32, then packed.
  std::vector<float> wk(static_cast<size_t>(nh) * R * dn), wv(static_cast<size_t>(nh) * dv * R);
  if (c.mla.legacy_kv_b) {
    // attn_kv_b {kv_lora_rank, n_head × (qk_nope + v_head)}: per head qk_nope rows of W_UK, then v_head rows
    // of W_UV. W_UK is transposed here into the absorbed query's [R, qk_nope].
    QKV_ASSIGN_OR_RETURN(std::vector<float> kvb,
                         ReadTensor(in.file, p + "attn_kv_b.weight", {U(R), U(nh * (dn + dv))}));
    for (int h = 0; h < nh; ++h) {
      const float* rows = &kvb[static_cast<size_t>(h) * (dn + dv) * R];
      for (int r = 0; r < R; ++r)
        for (int d = 0; d < dn; ++d)
          wk[(static_cast<size_t>(h) * R + r) * dn + d] = rows[static_cast<size_t>(d) * R + r];
      std::copy_n(rows + static_cast<size_t>(dn) * R, static_cast<size_t>(dv) * R,
                  &wv[static_cast<size_t>(h) * dv * R]);
    }
  } else {
    QKV_ASSIGN_OR_RETURN(wk, ReadTensor(in.file, p + "attn_k_b.weight", {U(dn), U(R), U(nh)}));
    QKV_ASSIGN_OR_RETURN(wv, ReadTensor(in.file, p + "attn_v_b.weight", {U(R), U(dv), U(nh)}));
  }
  const bool bf16 = in.weights_dtype == DType::kBF16;
  for (int h = 0; h < nh; ++h) {
    L->k_b_.emplace_back(&wk[static_cast<size_t>(h) * R * dn], nullptr, R, dn, bf16);
    L->v_b_.emplace_back(&wv[static_cast<size_t>(h) * dv * R], nullptr, dv, R, bf16);
  }
  QKV_ASSIGN_OR_RETURN(L->o_, mk({{p + "attn_output.weight", H, 0, c.hidden}}, nh * dv));
  const auto rows = static_cast<size_t>(std::max(in.max_rows, 1));
  auto make = [&] {
    auto b = std::make_shared<MlaBuffers>();
    b->a.assign(rows * L->a_n_, 0);
    if (ql > 0) {
      b->qa.assign(rows * ql, 0);
      b->q.assign(rows * nh * dk, 0);
    }
    b->qm.assign(rows * nh * (R + P), 0);
    b->ol.assign(rows * nh * R, 0);
    b->ao.assign(rows * nh * dv, 0);
    return b;
  };
  // Every size the buffers depend on is in the key, so layers that share them agree on all of them.
  const std::string key = "mla rows " + std::to_string(rows) + " a " + std::to_string(L->a_n_) + " q_lora " +
                          std::to_string(ql) + " heads " + std::to_string(nh) + " qk " + std::to_string(dk) +
                          " latent " + std::to_string(R) + " rope " + std::to_string(P) + " v " + std::to_string(dv);
  L->b_ = in.shared ? in.shared->Get<MlaBuffers>(key, make) : make();
  return std::unique_ptr<Layer>(std::move(L));
}

void MlaAttention::Forward(float* x, const StepRows& rows, const LayerScratch& s) {
  const int T = rows.T, H = c_.hidden, nthr = s.n_threads;
  const int nh = nh_, R = R_, P = P_, dv = dv_, dk = dk_, ql = ql_, W = R + P, dn = dn_;
  const float eps = static_cast<float>(c_.rms_eps);
  ForwardProfile& pf = *s.profile;
  float* h = s.h;
  float* a = b_->a.data();

  ParallelRows(T, nthr, [&](int t) {
    RmsNorm(&x[static_cast<size_t>(t) * H], norm_.data(), &h[static_cast<size_t>(t) * H], H, eps);
  });
  s.timer->Mark(pf.norms);
  s.Gemm(*a_, h, T, a);
  // Queries: through the low-rank path, or straight from the first GEMM (row stride a_n_).
  const float* q = a;
  size_t q_stride = static_cast<size_t>(a_n_);
  if (ql > 0) {
    for (int t = 0; t < T; ++t) {
      RmsNorm(a + static_cast<size_t>(t) * a_n_, q_a_norm_.data(), &b_->qa[static_cast<size_t>(t) * ql], ql, eps);
    }
    s.Gemm(*q_b_, b_->qa.data(), T, b_->q.data());
    q = b_->q.data();
    q_stride = static_cast<size_t>(nh) * dk;
  }
  s.timer->Mark(pf.qkv);

  // The latent (normalized) and the rope key (rotated) into the cache; the rotated rope part of each
  // head's query beside its absorbed part.
  const RopeStyle style = RopeStyleOf(c_.arch);
  ParallelRows(T, nthr, [&](int t) {
    float* kv = a + static_cast<size_t>(t) * a_n_ + kv_off_;
    const int pos = rows.pos[t];
    RmsNorm(kv, kv_a_norm_.data(), kv, R, eps);
    if (P > 0) rope_->Apply(kv + R, pos, style);
    const BatchChunk& ch = rows.batch[rows.chunk_of[t]];
    StoreLatent(*s.kv, kv_layer_, ch.seq->blocks.data(), pos, kv, kv + R);
    for (int hh = 0; hh < nh; ++hh) {
      float* dst = &b_->qm[(static_cast<size_t>(t) * nh + hh) * W + R];
      std::copy_n(q + t * q_stride + static_cast<size_t>(hh) * dk + dn, P, dst);
      if (P > 0) rope_->Apply(dst, pos, style);
    }
  });
  s.timer->Mark(pf.rope_store);

  // Absorb: q_lat = W_UKᵀ q_nope, one GEMM per head over the step's rows (strided in and out), a head per
  // thread.
#pragma omp parallel for num_threads(nthr) schedule(dynamic, 1)
  for (int hh = 0; hh < nh; ++hh) {
    k_b_[hh].Compute(q + static_cast<size_t>(hh) * dk, static_cast<int>(q_stride), T, 0, k_b_[hh].panels(),
                     &b_->qm[static_cast<size_t>(hh) * W], nh * W);
  }
  s.timer->Mark(pf.qkv);

  // Attention in latent space. A decode step cuts the heads into one chunk per thread so that it uses every
  // thread; with at least a row per thread each row takes all its heads at once (each cached row chunk is
  // loaded once per tile of 4 heads and the row's pass over the cache is not repeated per chunk: MLA prefill
  // 1024 went 318-340 → 374 tok/s on a Zen 5). A head's result does not depend on its chunk.
  const int chunks = T >= nthr ? 1 : std::min(nh, std::max(nthr, 1));
  const int items = T * chunks;
  ParallelItems(items, nthr, [&](int it) {
    const int t = it / chunks, k = it % chunks;
    const int h0 = nh * k / chunks, h1 = nh * (k + 1) / chunks;
    const BatchChunk& ch = rows.batch[rows.chunk_of[t]];
    float* scratch = &s.attn_per_thread[s.attn_stride * omp_get_thread_num()];
    AttendLatent(*s.kv, kv_layer_, ch.seq->blocks.data(), rows.pos[t] + 1, &b_->qm[static_cast<size_t>(t) * nh * W],
                 &b_->ol[static_cast<size_t>(t) * nh * R], h0, h1 - h0, scale_, scratch);
  });
  // Back out of latent space: o_h = W_UV o_lat per head.
#pragma omp parallel for num_threads(nthr) schedule(dynamic, 1)
  for (int hh = 0; hh < nh; ++hh) {
    v_b_[hh].Compute(&b_->ol[static_cast<size_t>(hh) * R], nh * R, T, 0, v_b_[hh].panels(),
                     &b_->ao[static_cast<size_t>(hh) * dv], nh * dv);
  }
  s.timer->Mark(pf.attention);
  s.Gemm(*o_, b_->ao.data(), T, s.tmp);
  AddInPlace(x, s.tmp, T * H);
  s.timer->Mark(pf.o);
}

// One token, every thread of the team (the operations of Forward on the same values, so the same bits):
// each thread normalizes the row for itself and computes its share of the first GEMM; after a barrier (and,
// with a low-rank query path, each thread's own q_a norm, its share of W_QB and another barrier), the last
// thread normalizes, rotates and stores the latent and the rope key while the heads' rope queries and
// absorbed queries are shared out; after a barrier, the heads in one chunk per thread as Forward cuts them,
// each chunk's attention followed by its heads' W_UV (no other chunk reads them); after a barrier, each
// thread adds its share of the output projection to x. 4 barriers a layer (5 with q_lora) where Forward
// runs 5 parallel regions (6 with q_lora).
void MlaAttention::ForwardTeam(float* x, const StepRows& rows, const LayerScratch& s) {
  const int nh = nh_, R = R_, P = P_, dv = dv_, dk = dk_, ql = ql_, W = R + P, dn = dn_;
  const int me = omp_get_thread_num(), nt = omp_get_num_threads();
  const float eps = static_cast<float>(c_.rms_eps);
  ForwardProfile& pf = *s.profile;
  PhaseTimer* timer = me == 0 ? s.timer : nullptr;
  float* a = b_->a.data();
  float* own = s.TeamNormShare(x, norm_, eps, *a_, a);
  s.Barrier();
  const float* q = a;
  size_t q_stride = static_cast<size_t>(a_n_);
  if (ql > 0) {
    RmsNorm(a, q_a_norm_.data(), own, ql, eps);
    q_b_->ForwardShare(own, 1, b_->q.data(), [](int, int) {});
    s.Barrier();
    q = b_->q.data();
    q_stride = static_cast<size_t>(nh) * dk;
  }
  if (timer) timer->Mark(pf.qkv);
  const int pos = rows.pos[0];
  const int* blocks = rows.batch[rows.chunk_of[0]].seq->blocks.data();
  const RopeStyle style = RopeStyleOf(c_.arch);
  if (me == nt - 1) {
    float* kv = a + kv_off_;
    RmsNorm(kv, kv_a_norm_.data(), kv, R, eps);
    if (P > 0) rope_->Apply(kv + R, pos, style);
    StoreLatent(*s.kv, kv_layer_, blocks, pos, kv, kv + R);
  }
#pragma omp for schedule(static) nowait
  for (int hh = 0; hh < nh; ++hh) {
    float* dst = &b_->qm[static_cast<size_t>(hh) * W + R];
    std::copy_n(q + static_cast<size_t>(hh) * dk + dn, P, dst);
    if (P > 0) rope_->Apply(dst, pos, style);
    k_b_[hh].Compute(q + static_cast<size_t>(hh) * dk, static_cast<int>(q_stride), 1, 0, k_b_[hh].panels(),
                     &b_->qm[static_cast<size_t>(hh) * W], nh * W);
  }
  s.Barrier();
  if (timer) timer->Mark(pf.rope_store);
  const int chunks = 1 >= s.n_threads ? 1 : std::min(nh, s.n_threads);  // as Forward cuts one row
#pragma omp for schedule(dynamic, 1) nowait
  for (int k = 0; k < chunks; ++k) {
    const int h0 = nh * k / chunks, h1 = nh * (k + 1) / chunks;
    float* scratch = &s.attn_per_thread[s.attn_stride * me];
    AttendLatent(*s.kv, kv_layer_, blocks, pos + 1, b_->qm.data(), b_->ol.data(), h0, h1 - h0, scale_, scratch);
    for (int hh = h0; hh < h1; ++hh) {
      v_b_[hh].Compute(&b_->ol[static_cast<size_t>(hh) * R], nh * R, 1, 0, v_b_[hh].panels(),
                       &b_->ao[static_cast<size_t>(hh) * dv], nh * dv);
    }
  }
  s.Barrier();
  if (timer) timer->Mark(pf.attention);
  o_->ForwardShare(b_->ao.data(), 1, s.tmp, [&](int c0, int c1) { AddInPlace(x + c0, s.tmp + c0, c1 - c0); });
  s.Barrier();
  if (timer) timer->Mark(pf.o);
}

}  // namespace

StatusOr<std::unique_ptr<Layer>> MakeMlaAttention(const LayerInit& in) { return MlaAttention::Make(in); }

}  // namespace qkv
