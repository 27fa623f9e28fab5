// A mixture-of-experts SwiGLU FFN (qwen3moe; deepseek2's routed layers), as llama.cpp's build_moe_ffn:
//   h = RMSNorm(x) → logits = h·W_routerᵀ → p = softmax(logits) (or sigmoid) → s = p (+ selection bias)
//   → (group-limited routing: keep the n_group_used groups with the largest sum of their top-2 s)
//   → the top-k experts by s (ties: the lower expert index, as llama.cpp's CPU argsort for up to 16
//     experts) → w_k = p[e_k], divided by max(Σ w, 6.1035e-5) if normalized, × scale if scaled
//   → x += Σ_k w_k · expert_{e_k}(h) (+ shared experts' dense SwiGLU on h).
// Per step the tokens are grouped by expert and each expert with tokens runs as one GEMM over them
// (gate+up fused, then down); experts nobody chose cost nothing. A token's experts are added in increasing
// expert index, and GEMM rows are independent of M, so a token's output has the same bits whatever else is
// in the batch.
// Experts kept quantized run all in one OpenMP region (ExpertsQuantized): the tokens' activations are
// quantized once and each expert's GEMMs read its tokens' rows in place (QuantizedRowSet); per expert a
// thread computes a slice of the gate and up columns, their SiLU product and its int8 image (32-blocks are
// independent), then after one barrier a slice of the down projection and of the accumulated output. Two
// regions and four barriers per expert become one barrier: at decode the experts' GEMMs are 10-40 µs, and
// a region costs ~3 µs and a barrier ~1.4 µs on 2 threads. The bits are those of the per-expert GEMMs
// (the same row-wise kernel, quantization and order of additions); QKV_MOE_FUSED=0 keeps the per-expert
// path (tests compare the two).
// With few slots (T × n_used ≤ kSpreadSlots: decode and small batches) the experts are not split one by one
// but spread: the active experts' gate/up columns, laid end to end, are cut into one contiguous share per
// thread, then (after one barrier) their down columns the same way, then (after another) each thread adds a
// slice of the output columns over the experts in increasing index. At decode a thread then streams whole
// experts (4 of 36 on 2 threads: two each) instead of half of each, and a layer has 3 barriers instead of
// n_used + 2; a throwaway program running only the experts measured 1.10-1.25 ms against 1.32-1.35 ms a token.
// Same bits: every output column is computed by the same kernel whatever the cut, and the additions keep
// their order.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "engine/kernels/parallel.h"
#include "engine/layers/layer.h"

namespace qkv {
namespace {

// Per thread, for ForwardTeam: the token's routing, computed by every thread for itself.
struct TeamRoute {
  std::vector<int> chosen, idx, active_k;  // active_k[a]: the k of the a-th expert in increasing index
  std::vector<float> weights, route;
};

// A mixture-of-experts layer's scratch (what one step needs, nothing kept between steps), shared by the
// model's layers of the same sizes (SharedScratch).
struct MoeBuffers {
  std::vector<float> logits, weights, xin, gu, act, y, acc, route;
  std::vector<int> chosen, rows_of, route_idx;
  std::vector<int> tok, off;
  QuantizedRows hq, aq[2];
  std::vector<QuantizedRows> hq_own;  // one per thread: the few tokens' rows at decode (kOwnQuantRows)
  std::vector<float> sgu, sact, sy;
  std::vector<float> shgu, shy;  // ForwardTeam: the shared experts' gate/up (2 × n_shared × F) and output (H)
  std::vector<int> seq, active;  // seq[i] = i (rows of saq in place); active: the step's experts
  QuantizedRows saq;
  std::vector<TeamRoute> team;
  size_t bytes() const {
    size_t n =
        sizeof(float) * (logits.size() + weights.size() + xin.size() + gu.size() + act.size() + y.size() + acc.size() +
                         route.size() + sgu.size() + sact.size() + sy.size() + shgu.size() + shy.size()) +
        sizeof(int) *
            (chosen.size() + rows_of.size() + route_idx.size() + tok.size() + off.size() + seq.size() + active.size()) +
        hq.bytes() + aq[0].bytes() + aq[1].bytes() + saq.bytes();
    for (const auto& q : hq_own) n += q.bytes();
    for (const TeamRoute& r : team) {
      n += sizeof(int) * (r.chosen.size() + r.idx.size() + r.active_k.size()) +
           sizeof(float) * (r.weights.size() + r.route.size());
    }
    return n;
  }
};

class MoeSwiGlu final : public Layer {
 public:
  std::string_view kind() const override { return "moe_swiglu"; }
  size_t weight_bytes() const override {
    size_t n = router_->weight_bytes() + 4 * (norm_.size() + bias_.size());
    for (const auto& e : gate_up_) n += e->weight_bytes();
    for (const auto& e : down_) n += e->weight_bytes();
    if (sh_gate_up_) n += sh_gate_up_->weight_bytes() + sh_down_->weight_bytes();
    return n;
  }
  // A token reads the router, n_used experts (the average expert's bytes) and the shared experts.
  size_t weight_bytes_per_token() const override {
    size_t experts = 0;
    for (size_t e = 0; e < gate_up_.size(); ++e) experts += gate_up_[e]->weight_bytes() + down_[e]->weight_bytes();
    size_t n = router_->weight_bytes() + experts / gate_up_.size() * static_cast<size_t>(m_.n_used);
    if (sh_gate_up_) n += sh_gate_up_->weight_bytes() + sh_down_->weight_bytes();
    return n;
  }
  void ForEachLinear(const std::function<void(const Linear&)>& f) const override {
    f(*router_);
    for (size_t e = 0; e < gate_up_.size(); ++e) {
      f(*gate_up_[e]);
      f(*down_[e]);
    }
    if (sh_gate_up_) {
      f(*sh_gate_up_);
      f(*sh_down_);
    }
  }
  // (its scratch is shared with the model's other mixture-of-experts layers: SharedScratch counts it)
  size_t scratch_bytes() const override { return 0; }

  const std::vector<uint64_t>* expert_tokens() const override { return &routed_; }

  static StatusOr<std::unique_ptr<Layer>> Make(const LayerInit& in);
  void Forward(float* x, const StepRows& rows, const LayerScratch& s) override;
  // One token's routed and shared experts inside the step's team.
  bool team_ready() const override {
    if (!router_->team_ready() || b_->team.empty()) return false;
    if (sh_gate_up_ && (!sh_gate_up_->team_ready() || !sh_down_->team_ready())) return false;
    if (fused_) return spread_slots_ >= m_.n_used;
    const auto K = static_cast<size_t>(m_.n_used);
    if (b_->gu.size() < K * 2 * m_.expert_ffn || b_->y.size() < K * hidden_) return false;
    for (size_t e = 0; e < gate_up_.size(); ++e) {
      if (!gate_up_[e]->team_ready() || !down_[e]->team_ready()) return false;
    }
    return true;
  }
  size_t team_floats() const override {
    return static_cast<size_t>(PaddedRows(1)) * std::max({hidden_, m_.expert_ffn, m_.n_shared * m_.expert_ffn});
  }
  void ForwardTeam(float* x, const StepRows& rows, const LayerScratch& s) override;

 private:
  // One token's routing: chosen experts (top-k, in the order of selection) and their weights. prob, sel:
  // E floats and idx E ints of scratch.
  void Route(const float* logits, int* chosen, float* weights, float* prob, float* sel, int* idx) const;
  // b_->acc (T rows) = Σ over each token's experts of w · expert(h), experts on quantized weights (see above).
  void ExpertsQuantized(int T, const LayerScratch& s);
  // The same with the active experts' columns spread over the threads (T × n_used ≤ spread_slots_).
  void ExpertsSpread(int T, const LayerScratch& s);
  // One expert's gate and up columns [c0, c1) (and F + c0 ...) for the n rows of x into g (rows of 2F), their
  // SiLU product into act rows r0 .. r0 + n (rows of F) and its int8 32-blocks into aq's same rows.
  void GateUpSlice(const QuantWeights& gu, const QuantizedRowSet& x, int c0, int c1, float* g, float* act,
                   QuantizedRows& aq, int r0) const;

  MoeConfig m_;
  int hidden_ = 0;
  float eps_ = 0;
  std::vector<float> norm_, bias_;
  std::unique_ptr<Linear> router_;
  std::vector<std::unique_ptr<Linear>> gate_up_, down_;  // per expert: [2 × expert_ffn, H] and [H, expert_ffn]
  std::unique_ptr<Linear> sh_gate_up_, sh_down_;         // shared experts, or null
  // The fused quantized path: slots grouped by expert (b_->off[e] .. b_->off[e + 1]), each with its token
  // (tok) and its index t × K + k into chosen/weights (rows_of); the tokens' activations and two experts'
  // SiLU products in int8. The spread path (ExpertsSpread): per slot its gate/up outputs, SiLU product
  // (also in int8) and down output.
  bool fused_ = false;
  static constexpr int kSpreadSlots = 64;
  int spread_slots_ = 0;  // slots the buffers hold (0: no spread path)
  int idx_stride_ = 0;
  std::vector<uint64_t> routed_;  // tokens routed to each expert
  // Scratch for max_rows rows, sized at load, shared by the model's layers of the same sizes.
  std::shared_ptr<MoeBuffers> b_;
  // ForwardTeam's experts on GEMMs that are not fused (h: the thread's normalized row, then its SiLU products).
  void ExpertsTeam(float* x, float* h, const TeamRoute& r, const LayerScratch& s);
  // The thread's shares of the shared experts (if any): gate/up of the normalized row h into b_->shgu, then
  // (after the caller's barrier) the SiLU product into act, which may be h, and down into b_->shy.
  void SharedGateUpShare(const float* h) const;
  void SharedDownShare(float* act) const;
  // The thread's share of x's columns += Σ over the token's experts in increasing index (expert a's output
  // in row a of ys, rows of H) of weight · output, summed from zero as Forward sums them, plus the shared
  // experts' output (b_->shy) as Forward adds it.
  void AddExpertOutputs(float* x, const float* ys, const TeamRoute& r);
};

StatusOr<std::unique_ptr<Layer>> MoeSwiGlu::Make(const LayerInit& in) {
  const ModelConfig& c = in.config;
  auto L = std::make_unique<MoeSwiGlu>();
  L->m_ = c.moe;
  L->hidden_ = c.hidden;
  L->eps_ = static_cast<float>(c.rms_eps);
  const MoeConfig& m = c.moe;
  const int E = m.n_experts, F = m.expert_ffn, H = c.hidden;
  const auto U = [](int v) { return static_cast<uint64_t>(v); };
  const std::string p = "blk." + std::to_string(in.block) + ".";
  QKV_ASSIGN_OR_RETURN(L->norm_, ReadTensor(in.file, p + "ffn_norm.weight", {U(H)}));
  if (m.selection_bias) {
    QKV_ASSIGN_OR_RETURN(L->bias_, ReadTensor(in.file, p + "exp_probs_b.bias", {U(E)}));
  }
  auto mk = [&](const std::vector<WeightRows>& r, int k) {
    return MakeLinear(in.file, in.gemm, in.weights_dtype, in.keep_quantized, r, k, nullptr);
  };
  // The router in f32 (as llama.cpp's logits): its top-k decides which experts run.
  QKV_ASSIGN_OR_RETURN(L->router_, MakeLinear(in.file, in.gemm, DType::kF32, in.keep_quantized,
                                              {{p + "ffn_gate_inp.weight", U(E), 0, E}}, H, nullptr));
  const std::string tg = p + "ffn_gate_exps.weight", tu = p + "ffn_up_exps.weight", td = p + "ffn_down_exps.weight";
  const GgufTensor* gt = in.file.UseTensor(tg);
  const GgufTensor* ut = in.file.UseTensor(tu);
  const GgufTensor* dt = in.file.UseTensor(td);
  const bool quant = in.keep_quantized && gt && ut && dt && GgmlIsQuantized(gt->type) && GgmlIsQuantized(ut->type) &&
                     GgmlIsQuantized(dt->type) && H % 32 == 0 && F % 32 == 0;
  // One expert at a time: its slices of the stacked tensors, kept in their block formats when quantized
  // (nothing copied per step), else expanded to f32 and created in the weights dtype.
  for (int e = 0; e < E; ++e) {
    QKV_ASSIGN_OR_RETURN(auto gu, mk({{tg, U(F * E), e * F, F, U(E)}, {tu, U(F * E), e * F, F, U(E)}}, H));
    QKV_ASSIGN_OR_RETURN(auto dn, mk({{td, U(H * E), e * H, H, U(E)}}, F));
    L->gate_up_.push_back(std::move(gu));
    L->down_.push_back(std::move(dn));
  }
  if (m.n_shared > 0) {
    const int SF = m.n_shared * F;
    QKV_ASSIGN_OR_RETURN(
        L->sh_gate_up_,
        mk({{p + "ffn_gate_shexp.weight", U(SF), 0, SF}, {p + "ffn_up_shexp.weight", U(SF), 0, SF}}, H));
    QKV_ASSIGN_OR_RETURN(L->sh_down_, mk({{p + "ffn_down_shexp.weight", U(H), 0, H}}, SF));
  }
  // An expert's GEMMs run over at most max_rows tokens (a token picks an expert at most once); the shared
  // experts over all of them.
  const auto rows = static_cast<size_t>(std::max(in.max_rows, 1));
  const int widest = std::max(F, m.n_shared * F);
  const char* fused = std::getenv("QKV_MOE_FUSED");
  L->fused_ = quant && !(fused && std::strcmp(fused, "0") == 0);
  for (int e = 0; e < E && L->fused_; ++e) L->fused_ = L->gate_up_[e]->quantized() && L->down_[e]->quantized();
  const int K = m.n_used, threads = in.gemm.n_threads();
  const int S = L->fused_ ? static_cast<int>(std::min<size_t>(rows * K, kSpreadSlots)) : 0;
  L->spread_slots_ = S;
  L->idx_stride_ = std::max(E, m.n_groups);
  auto make = [&] {
    auto b = std::make_shared<MoeBuffers>();
    b->logits.assign(rows * E, 0);
    b->weights.assign(rows * K, 0);
    b->chosen.assign(rows * K, 0);
    b->rows_of.assign(rows * (L->fused_ ? K : 1), 0);
    if (L->fused_) {
      b->tok.assign(rows * K, 0);
      b->off.assign(static_cast<size_t>(E) + 1, 0);
      b->hq.Resize(static_cast<int>(rows), H);
      b->hq_own.resize(static_cast<size_t>(threads));
      for (auto& q : b->hq_own) q.Resize(kOwnQuantRows, H);
      for (auto& q : b->aq) q.Resize(static_cast<int>(rows), F);
      b->sgu.assign(static_cast<size_t>(S) * 2 * F, 0);
      b->sact.assign(static_cast<size_t>(S) * F, 0);
      b->sy.assign(static_cast<size_t>(S) * H, 0);
      b->seq.resize(S);
      std::iota(b->seq.begin(), b->seq.end(), 0);
      b->active.assign(static_cast<size_t>(E), 0);
      b->saq.Resize(S, F);
    }
    b->shgu.assign(static_cast<size_t>(2 * widest), 0);  // widest ≥ n_shared × F
    b->shy.assign(static_cast<size_t>(H), 0);
    b->team.resize(static_cast<size_t>(threads));
    for (TeamRoute& r : b->team) {
      r.chosen.assign(static_cast<size_t>(K), 0);
      r.active_k.assign(static_cast<size_t>(K), 0);
      r.weights.assign(static_cast<size_t>(K), 0);
      r.route.assign(static_cast<size_t>(2 * E), 0);
      r.idx.assign(static_cast<size_t>(L->idx_stride_), 0);
    }
    b->route.assign(rows * 2 * E, 0);
    b->route_idx.assign(rows * L->idx_stride_, 0);
    if (!L->fused_) b->xin.assign(rows * H, 0);  // the per-expert path's copy of an expert's tokens
    b->gu.assign(rows * 2 * widest, 0);
    b->act.assign(rows * widest, 0);
    b->y.assign(rows * H, 0);
    b->acc.assign(rows * H, 0);
    return b;
  };
  // Every size the buffers depend on is in the key, so layers that share them agree on all of them.
  const std::string key = "moe rows " + std::to_string(rows) + " E " + std::to_string(E) + " K " + std::to_string(K) +
                          " F " + std::to_string(F) + " widest " + std::to_string(widest) + " H " + std::to_string(H) +
                          " groups " + std::to_string(L->idx_stride_) + " threads " + std::to_string(threads) +
                          (L->fused_ ? " fused" : "");
  L->b_ = in.shared ? in.shared->Get<MoeBuffers>(key, make) : make();
  L->routed_.assign(static_cast<size_t>(E), 0);
  return std::unique_ptr<Layer>(std::move(L));
}

void MoeSwiGlu::Route(const float* logits, int* chosen, float* weights, float* prob, float* sel, int* idx) const {
  const int E = m_.n_experts, K = m_.n_used;
  if (m_.gating == ExpertGating::kSoftmax) {
    float mx = -INFINITY;
    for (int e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
    float sum = 0;
    for (int e = 0; e < E; ++e) sum += (prob[e] = FastExp(logits[e] - mx));
    const float inv = 1.0f / sum;
    for (int e = 0; e < E; ++e) prob[e] *= inv;
  } else {
    for (int e = 0; e < E; ++e) prob[e] = 1.0f / (1.0f + FastExp(-logits[e]));
  }
  // A NaN score sorts last (the comparator below must be a strict weak order).
  for (int e = 0; e < E; ++e) {
    sel[e] = prob[e] + (bias_.empty() ? 0.0f : bias_[e]);
    if (std::isnan(sel[e])) sel[e] = -INFINITY;
  }
  // Descending by score, ties to the lower index.
  auto by = [](const float* v) { return [v](int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); }; };
  if (m_.n_groups > 1) {  // keep the n_group_used groups whose top-2 scores sum highest
    const int G = m_.n_groups, per = E / G;
    float gscore[256];
    for (int g = 0; g < G; ++g) {
      std::iota(idx, idx + per, g * per);
      std::partial_sort(idx, idx + std::min(2, per), idx + per, by(sel));
      gscore[g] = sel[idx[0]] + (per > 1 ? sel[idx[1]] : 0.0f);
    }
    std::iota(idx, idx + G, 0);
    std::partial_sort(idx, idx + m_.n_group_used, idx + G, by(gscore));
    bool keep[256] = {};
    for (int i = 0; i < m_.n_group_used; ++i) keep[idx[i]] = true;
    for (int e = 0; e < E; ++e)
      if (!keep[e / per]) sel[e] = -INFINITY;
  }
  std::iota(idx, idx + E, 0);
  std::partial_sort(idx, idx + K, idx + E, by(sel));
  float sum = 0;
  for (int k = 0; k < K; ++k) {
    chosen[k] = idx[k];
    weights[k] = prob[idx[k]];
    sum += weights[k];
  }
  if (m_.norm_weights) {
    const float d = std::max(sum, 6.103515625e-5f);
    for (int k = 0; k < K; ++k) weights[k] /= d;
  }
  if (m_.weights_scale != 0.0 && m_.weights_scale != 1.0) {
    for (int k = 0; k < K; ++k) weights[k] *= static_cast<float>(m_.weights_scale);
  }
}

void MoeSwiGlu::Forward(float* x, const StepRows& rows, const LayerScratch& s) {
  const int T = rows.T, H = hidden_, E = m_.n_experts, K = m_.n_used, F = m_.expert_ffn, nthr = s.n_threads;
  ForwardProfile& pf = *s.profile;
  ParallelRows(T, nthr, [&](int t) {
    RmsNorm(&x[static_cast<size_t>(t) * H], norm_.data(), &s.h[static_cast<size_t>(t) * H], H, eps_);
  });
  s.timer->Mark(pf.norms);
  s.Gemm(*router_, s.h, T, b_->logits.data());
  ParallelRows(T, nthr, [&](int t) {
    float* r = &b_->route[static_cast<size_t>(t) * 2 * E];
    Route(&b_->logits[static_cast<size_t>(t) * E], &b_->chosen[static_cast<size_t>(t) * K],
          &b_->weights[static_cast<size_t>(t) * K], r, r + E, &b_->route_idx[static_cast<size_t>(t) * idx_stride_]);
  });
  std::fill_n(b_->acc.begin(), static_cast<size_t>(T) * H, 0.0f);
  // Each expert over the tokens that chose it, in increasing expert index.
  for (int e = 0; e < (fused_ ? 0 : E); ++e) {
    int n = 0;
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        if (b_->chosen[static_cast<size_t>(t) * K + k] == e) {
          b_->rows_of[n] = t * K + k;
          std::copy_n(&s.h[static_cast<size_t>(t) * H], H, &b_->xin[static_cast<size_t>(n) * H]);
          ++n;
        }
      }
    }
    if (n == 0) continue;
    routed_[e] += static_cast<uint64_t>(n);
    s.Gemm(*gate_up_[e], b_->xin.data(), n, b_->gu.data());
    for (int i = 0; i < n; ++i) {
      const float* g = &b_->gu[static_cast<size_t>(i) * 2 * F];
      SiluMul(g, g + F, &b_->act[static_cast<size_t>(i) * F], F);
    }
    s.Gemm(*down_[e], b_->act.data(), n, b_->y.data());
    for (int i = 0; i < n; ++i) {
      const int t = b_->rows_of[i] / K;
      const float w = b_->weights[b_->rows_of[i]];
      float* a = &b_->acc[static_cast<size_t>(t) * H];
      const float* y = &b_->y[static_cast<size_t>(i) * H];
      for (int d = 0; d < H; ++d) a[d] = std::fma(w, y[d], a[d]);
    }
  }
  if (fused_) ExpertsQuantized(T, s);
  s.timer->Mark(pf.ffn_up);
  if (sh_gate_up_) {  // the shared experts: one dense SwiGLU on every token
    const int SF = m_.n_shared * F;
    s.Gemm(*sh_gate_up_, s.h, T, b_->gu.data());
    for (int t = 0; t < T; ++t) {
      const float* g = &b_->gu[static_cast<size_t>(t) * 2 * SF];
      SiluMul(g, g + SF, &b_->act[static_cast<size_t>(t) * SF], SF);
    }
    s.Gemm(*sh_down_, b_->act.data(), T, b_->y.data());
    AddInPlace(b_->acc.data(), b_->y.data(), T * H);
  }
  AddInPlace(x, b_->acc.data(), T * H);
  s.timer->Mark(pf.ffn_down);
}

void MoeSwiGlu::GateUpSlice(const QuantWeights& gu, const QuantizedRowSet& x, int c0, int c1, float* g, float* act,
                            QuantizedRows& aq, int r0) const {
  const int F = m_.expert_ffn;
  gu.Compute(x, c0, c1, g, 2 * static_cast<size_t>(F));
  gu.Compute(x, F + c0, F + c1, g, 2 * static_cast<size_t>(F));
  for (int r = 0; r < x.m; ++r) {
    const float* gr = g + static_cast<size_t>(r) * 2 * F;
    SiluMul(gr + c0, gr + F + c0, act + static_cast<size_t>(r0 + r) * F + c0, c1 - c0);
  }
  aq.QuantizeBlocks(act, F, r0, r0 + x.m, c0 / 32, c1 / 32);
}

void MoeSwiGlu::ExpertsQuantized(int T, const LayerScratch& s) {
  const int H = hidden_, E = m_.n_experts, K = m_.n_used, F = m_.expert_ffn, nthr = s.n_threads;
  // Slots by expert (a counting sort), tokens in increasing order within an expert.
  std::fill(b_->off.begin(), b_->off.end(), 0);
  for (int i = 0; i < T * K; ++i) ++b_->off[b_->chosen[i] + 1];
  for (int e = 0; e < E; ++e) {
    routed_[e] += static_cast<uint64_t>(b_->off[e + 1]);
    b_->off[e + 1] += b_->off[e];
  }
  for (int i = 0; i < T * K; ++i) {  // b_->off[e] advances to the end of e's slots, then shifts back below
    const int slot = b_->off[b_->chosen[i]]++;
    b_->tok[slot] = i / K;
    b_->rows_of[slot] = i;
  }
  for (int e = E; e > 0; --e) b_->off[e] = b_->off[e - 1];
  b_->off[0] = 0;
  if (T * K <= spread_slots_) return ExpertsSpread(T, s);
  const int nb = F / 32;
#pragma omp parallel num_threads(nthr)
  {
#pragma omp for schedule(static)
    for (int i = 0; i < nthr; ++i) b_->hq.Quantize(s.h, T * i / nthr, T * (i + 1) / nthr);
    int j = 0;  // experts run so far: which of b_->aq this one writes
    for (int e = 0; e < E; ++e) {
      const int o = b_->off[e], n = b_->off[e + 1] - o;
      if (n == 0) continue;
      const QuantWeights& gu = *gate_up_[e]->quantized();
      const QuantWeights& dn = *down_[e]->quantized();
      QuantizedRows& aq = b_->aq[j++ % 2];
      // Gate and up columns [c0, c1) (and F + c0 ...), SiLU product, its int8 blocks. The barrier at the
      // end publishes aq to every thread.
#pragma omp for schedule(static)
      for (int i = 0; i < nthr; ++i) {
        const int c0 = nb * i / nthr * 32, c1 = nb * (i + 1) / nthr * 32;
        if (c0 == c1) continue;
        GateUpSlice(gu, QuantizedRowSet{&b_->hq, &b_->tok[o], n}, c0, c1, b_->gu.data(), b_->act.data(), aq, 0);
      }
      // Down columns [c0, c1) and their share of the output. No barrier: the next expert writes the other
      // b_->aq, and the one after waits at the next expert's barrier for this loop to end everywhere.
#pragma omp for schedule(static) nowait
      for (int i = 0; i < nthr; ++i) {
        const int c0 = dn.UnitStart(static_cast<int>(static_cast<int64_t>(H) * i / nthr));
        const int c1 = dn.UnitStart(static_cast<int>(static_cast<int64_t>(H) * (i + 1) / nthr));
        if (c0 == c1) continue;
        dn.Compute(QuantizedRowSet{&aq, nullptr, n}, c0, c1, b_->y.data(), H);
        for (int r = 0; r < n; ++r) {
          const float w = b_->weights[b_->rows_of[o + r]];
          float* a = &b_->acc[static_cast<size_t>(b_->tok[o + r]) * H];
          const float* y = &b_->y[static_cast<size_t>(r) * H];
          for (int d = c0; d < c1; ++d) a[d] = std::fma(w, y[d], a[d]);
        }
      }
    }
  }
}

void MoeSwiGlu::ExpertsSpread(int T, const LayerScratch& s) {
  const int H = hidden_, E = m_.n_experts, F = m_.expert_ffn, nthr = s.n_threads;
  int A = 0;  // active experts, in increasing index
  for (int e = 0; e < E; ++e)
    if (b_->off[e + 1] > b_->off[e]) b_->active[A++] = e;
  const int nb = F / 32;
  // Decode (T ≤ kOwnQuantRows): each thread quantizes the tokens' rows itself, as Linear::Forward does,
  // and the barrier after the shared quantization goes.
  const bool own = T <= kOwnQuantRows;
#pragma omp parallel num_threads(nthr)
  {
    const QuantizedRows* hq = &b_->hq;
    if (own) {
      QuantizedRows& q = b_->hq_own[static_cast<size_t>(omp_get_thread_num())];
      q.Quantize(s.h, 0, T);
      hq = &q;
    } else {
#pragma omp for schedule(static)
      for (int i = 0; i < nthr; ++i) b_->hq.Quantize(s.h, T * i / nthr, T * (i + 1) / nthr);
    }
    // Gate/up: thread i takes the 32-column blocks [A·nb·i/nthr, A·nb·(i+1)/nthr) of the active experts'
    // columns laid end to end; each slot's rows land at its place (b_->off) in the slot buffers.
#pragma omp for schedule(static)
    for (int i = 0; i < nthr; ++i) {
      const int64_t g0 = int64_t{A} * nb * i / nthr, g1 = int64_t{A} * nb * (i + 1) / nthr;
      for (int64_t a = g0 / nb; a < A && a * nb < g1; ++a) {
        const int e = b_->active[a], o = b_->off[e], n = b_->off[e + 1] - o;
        const int c0 = static_cast<int>(std::max(g0, a * nb) - a * nb) * 32;
        const int c1 = static_cast<int>(std::min(g1, (a + 1) * nb) - a * nb) * 32;
        if (c0 == c1) continue;
        GateUpSlice(*gate_up_[e]->quantized(), QuantizedRowSet{hq, &b_->tok[o], n}, c0, c1,
                    &b_->sgu[static_cast<size_t>(o) * 2 * F], b_->sact.data(), b_->saq, o);
      }
    }
    // Down: the active experts' H output columns end to end, cut on unit starts.
#pragma omp for schedule(static)
    for (int i = 0; i < nthr; ++i) {
      const int64_t g0 = int64_t{A} * H * i / nthr, g1 = int64_t{A} * H * (i + 1) / nthr;
      for (int64_t a = g0 / H; a < A && a * H < g1; ++a) {
        const int e = b_->active[a], o = b_->off[e], n = b_->off[e + 1] - o;
        const QuantWeights& dn = *down_[e]->quantized();
        const int c0 = dn.UnitStart(static_cast<int>(std::max(g0, a * H) - a * H));
        const int c1 = dn.UnitStart(static_cast<int>(std::min(g1, (a + 1) * H) - a * H));
        if (c0 == c1) continue;
        dn.Compute(QuantizedRowSet{&b_->saq, &b_->seq[o], n}, c0, c1, &b_->sy[static_cast<size_t>(o) * H], H);
      }
    }
    // Output columns [d0, d1): Σ over the experts in increasing index, as the per-expert path adds them.
#pragma omp for schedule(static)
    for (int i = 0; i < nthr; ++i) {
      const int d0 = H * i / nthr / 16 * 16, d1 = i + 1 == nthr ? H : H * (i + 1) / nthr / 16 * 16;
      for (int a = 0; a < A; ++a) {
        const int e = b_->active[a];
        for (int slot = b_->off[e]; slot < b_->off[e + 1]; ++slot) {
          const float w = b_->weights[b_->rows_of[slot]];
          float* acc = &b_->acc[static_cast<size_t>(b_->tok[slot]) * H];
          const float* y = &b_->sy[static_cast<size_t>(slot) * H];
          for (int d = d0; d < d1; ++d) acc[d] = std::fma(w, y[d], acc[d]);
        }
      }
    }
  }
}

// One token, every thread of the team (what Forward and ExpertsSpread compute, with the same bits): each
// thread normalizes the row, computes its share of the router, and after a barrier routes the token for
// itself (every thread gets the same experts); then the active experts' gate/up blocks, their down
// columns and the output columns are shared as in ExpertsSpread, with a barrier after each. Shared experts
// (deepseek2) go along: each thread's share of their gate/up columns in the first phase, its SiLU product and
// share of their down columns in the second, their output added to the routed sum as Forward adds it.
void MoeSwiGlu::ForwardTeam(float* x, const StepRows& /*rows*/, const LayerScratch& s) {
  const int H = hidden_, E = m_.n_experts, K = m_.n_used, F = m_.expert_ffn, nb = F / 32;
  const int me = omp_get_thread_num(), nt = omp_get_num_threads();
  ForwardProfile& pf = *s.profile;
  PhaseTimer* timer = me == 0 ? s.timer : nullptr;
  float* h = s.TeamNormShare(x, norm_, eps_, *router_, b_->logits.data());
  if (fused_) b_->hq_own[static_cast<size_t>(me)].Quantize(h, 0, 1);
  s.Barrier();
  TeamRoute& r = b_->team[static_cast<size_t>(me)];
  Route(b_->logits.data(), r.chosen.data(), r.weights.data(), r.route.data(), r.route.data() + E, r.idx.data());
  // The chosen experts in increasing index (top-k picks each at most once).
  for (int k = 0; k < K; ++k) {
    int a = k;
    while (a > 0 && r.chosen[r.active_k[a - 1]] > r.chosen[k]) {
      r.active_k[a] = r.active_k[a - 1];
      --a;
    }
    r.active_k[a] = k;
  }
  if (me == 0) {
    for (int k = 0; k < K; ++k) ++routed_[r.chosen[k]];
  }
  if (!fused_) return ExpertsTeam(x, h, r, s);
  QuantizedRows& hq = b_->hq_own[static_cast<size_t>(me)];
  // Gate/up: the 32-column blocks of the K experts end to end; expert a's product lands in slot a.
  {
    const int64_t g0 = int64_t{K} * nb * me / nt, g1 = int64_t{K} * nb * (me + 1) / nt;
    for (int64_t a = g0 / nb; a < K && a * nb < g1; ++a) {
      const int e = r.chosen[r.active_k[a]];
      const int c0 = static_cast<int>(std::max(g0, a * nb) - a * nb) * 32;
      const int c1 = static_cast<int>(std::min(g1, (a + 1) * nb) - a * nb) * 32;
      if (c0 == c1) continue;
      GateUpSlice(*gate_up_[e]->quantized(), QuantizedRowSet{&hq, b_->seq.data(), 1}, c0, c1,
                  &b_->sgu[static_cast<size_t>(a) * 2 * F], b_->sact.data(), b_->saq, static_cast<int>(a));
    }
  }
  SharedGateUpShare(h);
  s.Barrier();
  if (timer) timer->Mark(pf.ffn_up);
  // Down: the K experts' H output columns end to end, cut on unit starts.
  {
    const int64_t g0 = int64_t{K} * H * me / nt, g1 = int64_t{K} * H * (me + 1) / nt;
    for (int64_t a = g0 / H; a < K && a * H < g1; ++a) {
      const QuantWeights& dn = *down_[r.chosen[r.active_k[a]]]->quantized();
      const int c0 = dn.UnitStart(static_cast<int>(std::max(g0, a * H) - a * H));
      const int c1 = dn.UnitStart(static_cast<int>(std::min(g1, (a + 1) * H) - a * H));
      if (c0 == c1) continue;
      dn.Compute(QuantizedRowSet{&b_->saq, &b_->seq[static_cast<size_t>(a)], 1}, c0, c1,
                 &b_->sy[static_cast<size_t>(a) * H], H);
    }
  }
  SharedDownShare(h);
  s.Barrier();
  AddExpertOutputs(x, b_->sy.data(), r);
  s.Barrier();
  if (timer) timer->Mark(pf.ffn_down);
}

// The experts of ForwardTeam on GEMMs of another kind (bf16, f32): each thread computes its share of every
// chosen expert's gate/up columns (expert a's in b_->gu row a); after a barrier, each expert's SiLU product for
// itself and its share of the expert's down columns (into b_->y row a); after a barrier, its output columns as
// Forward adds them (experts in increasing index, from zero).
void MoeSwiGlu::ExpertsTeam(float* x, float* h, const TeamRoute& r, const LayerScratch& s) {
  const int H = hidden_, K = m_.n_used, F = m_.expert_ffn;
  const int me = omp_get_thread_num();
  ForwardProfile& pf = *s.profile;
  PhaseTimer* timer = me == 0 ? s.timer : nullptr;
  for (int a = 0; a < K; ++a) {
    gate_up_[r.chosen[r.active_k[a]]]->ForwardShare(h, 1, &b_->gu[static_cast<size_t>(a) * 2 * F], [](int, int) {});
  }
  SharedGateUpShare(h);
  s.Barrier();
  if (timer) timer->Mark(pf.ffn_up);
  for (int a = 0; a < K; ++a) {  // h is the SiLU product from here on
    const float* g = &b_->gu[static_cast<size_t>(a) * 2 * F];
    SiluMul(g, g + F, h, F);
    down_[r.chosen[r.active_k[a]]]->ForwardShare(h, 1, &b_->y[static_cast<size_t>(a) * H], [](int, int) {});
  }
  SharedDownShare(h);
  s.Barrier();
  AddExpertOutputs(x, b_->y.data(), r);
  s.Barrier();
  if (timer) timer->Mark(pf.ffn_down);
}

void MoeSwiGlu::AddExpertOutputs(float* x, const float* ys, const TeamRoute& r) {
  const int H = hidden_, me = omp_get_thread_num(), nt = omp_get_num_threads();
  const int d0 = H * me / nt, d1 = H * (me + 1) / nt;
  float* acc = &b_->acc[static_cast<size_t>(d0)];
  std::fill(acc, acc + (d1 - d0), 0.0f);
  for (int a = 0; a < m_.n_used; ++a) {
    const float w = r.weights[r.active_k[a]];
    const float* y = ys + static_cast<size_t>(a) * H + d0;
    for (int d = 0; d < d1 - d0; ++d) acc[d] = std::fma(w, y[d], acc[d]);
  }
  if (sh_gate_up_) AddInPlace(acc, &b_->shy[static_cast<size_t>(d0)], d1 - d0);
  AddInPlace(x + d0, acc, d1 - d0);
}

void MoeSwiGlu::SharedGateUpShare(const float* h) const {
  if (sh_gate_up_) sh_gate_up_->ForwardShare(h, 1, b_->shgu.data(), [](int, int) {});
}

void MoeSwiGlu::SharedDownShare(float* act) const {
  if (!sh_gate_up_) return;
  const int SF = m_.n_shared * m_.expert_ffn;
  SiluMul(b_->shgu.data(), b_->shgu.data() + SF, act, SF);
  sh_down_->ForwardShare(act, 1, b_->shy.data(), [](int, int) {});
}

}  // namespace

StatusOr<std::unique_ptr<Layer>> MakeMoeSwiGlu(const LayerInit& in) { return MoeSwiGlu::Make(in); }

}  // namespace qkv
