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
  size_t scratch_bytes() const override {
    return sizeof(float) * (logits_.size() + weights_.size() + xin_.size() + gu_.size() + act_.size() + y_.size() +
                            acc_.size() + route_.size()) +
           sizeof(int) * (chosen_.size() + rows_of_.size() + route_idx_.size() + tok_.size() + off_.size()) +
           hq_.bytes() + aq_[0].bytes() + aq_[1].bytes() + saq_.bytes() + OwnBytes() +
           sizeof(float) * (sgu_.size() + sact_.size() + sy_.size()) + sizeof(int) * (seq_.size() + active_.size());
  }

  size_t OwnBytes() const {
    size_t n = 0;
    for (const auto& q : hq_own_) n += q.bytes();
    return n;
  }

  const std::vector<uint64_t>* expert_tokens() const override { return &routed_; }

  static StatusOr<std::unique_ptr<Layer>> Make(const LayerInit& in);
  void Forward(float* x, const StepRows& rows, const LayerScratch& s) override;
  // The spread path without shared experts: one token's routed experts inside the step's team.
  bool team_ready() const override {
    if (sh_gate_up_ || !router_->team_ready() || team_.empty()) return false;
    if (fused_) return spread_slots_ >= m_.n_used;
    const auto K = static_cast<size_t>(m_.n_used);
    if (gu_.size() < K * 2 * m_.expert_ffn || y_.size() < K * hidden_) return false;
    for (size_t e = 0; e < gate_up_.size(); ++e) {
      if (!gate_up_[e]->team_ready() || !down_[e]->team_ready()) return false;
    }
    return true;
  }
  size_t team_floats() const override { return static_cast<size_t>(PaddedRows(1)) * std::max(hidden_, m_.expert_ffn); }
  void ForwardTeam(float* x, const StepRows& rows, const LayerScratch& s) override;

 private:
  // One token's routing: chosen experts (top-k, in the order of selection) and their weights. prob, sel:
  // E floats and idx E ints of scratch.
  void Route(const float* logits, int* chosen, float* weights, float* prob, float* sel, int* idx) const;
  // acc_ (T rows) = Σ over each token's experts of w · expert(h), experts on quantized weights (see above).
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
  // Scratch for max_rows rows, sized at load.
  std::vector<float> logits_, weights_, xin_, gu_, act_, y_, acc_, route_;
  std::vector<int> chosen_, rows_of_, route_idx_;
  // The fused quantized path (empty otherwise): slots grouped by expert (off_[e] .. off_[e + 1]), each with
  // its token (tok_) and its index t × K + k into chosen_/weights_ (rows_of_); the tokens' activations and
  // two experts' SiLU products in int8.
  bool fused_ = false;
  std::vector<int> tok_, off_;
  QuantizedRows hq_, aq_[2];
  std::vector<QuantizedRows> hq_own_;  // one per thread: the few tokens' rows at decode (kOwnQuantRows)
  // The spread path (ExpertsSpread): per slot its gate/up outputs, SiLU product (also in int8) and down output.
  static constexpr int kSpreadSlots = 64;
  int spread_slots_ = 0;  // slots the buffers hold (0: no spread path)
  std::vector<float> sgu_, sact_, sy_;
  std::vector<int> seq_, active_;  // seq_[i] = i (rows of saq_ in place); active_: the step's experts
  QuantizedRows saq_;
  int idx_stride_ = 0;
  std::vector<uint64_t> routed_;  // tokens routed to each expert
  // Per thread, for ForwardTeam: the token's routing, computed by every thread for itself.
  struct TeamRoute {
    std::vector<int> chosen, idx, active_k;  // active_k[a]: the k of the a-th expert in increasing index
    std::vector<float> weights, route;
  };
  std::vector<TeamRoute> team_;
  // ForwardTeam's experts on GEMMs that are not fused (h: the thread's normalized row, then its SiLU products).
  void ExpertsTeam(float* x, float* h, const TeamRoute& r, const LayerScratch& s);
  // The thread's share of x's columns += Σ over the token's experts in increasing index (expert a's output
  // in row a of ys, rows of H) of weight · output, summed from zero as Forward sums them.
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
  const GgufTensor* gt = in.file.FindTensor(tg);
  const GgufTensor* ut = in.file.FindTensor(tu);
  const GgufTensor* dt = in.file.FindTensor(td);
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
  L->logits_.assign(rows * E, 0);
  L->weights_.assign(rows * m.n_used, 0);
  L->chosen_.assign(rows * m.n_used, 0);
  const char* fused = std::getenv("QKV_MOE_FUSED");
  L->fused_ = quant && !(fused && std::strcmp(fused, "0") == 0);
  for (int e = 0; e < E && L->fused_; ++e) L->fused_ = L->gate_up_[e]->quantized() && L->down_[e]->quantized();
  L->rows_of_.assign(rows * (L->fused_ ? m.n_used : 1), 0);
  if (L->fused_) {
    L->tok_.assign(rows * m.n_used, 0);
    L->off_.assign(static_cast<size_t>(E) + 1, 0);
    L->hq_.Resize(static_cast<int>(rows), H);
    L->hq_own_.resize(static_cast<size_t>(in.gemm.n_threads()));
    for (auto& q : L->hq_own_) q.Resize(kOwnQuantRows, H);
    for (auto& q : L->aq_) q.Resize(static_cast<int>(rows), F);
    const int S = static_cast<int>(std::min<size_t>(rows * m.n_used, kSpreadSlots));
    L->spread_slots_ = S;
    L->sgu_.assign(static_cast<size_t>(S) * 2 * F, 0);
    L->sact_.assign(static_cast<size_t>(S) * F, 0);
    L->sy_.assign(static_cast<size_t>(S) * H, 0);
    L->seq_.resize(S);
    std::iota(L->seq_.begin(), L->seq_.end(), 0);
    L->active_.assign(static_cast<size_t>(E), 0);
    L->saq_.Resize(S, F);
  }
  L->team_.resize(static_cast<size_t>(in.gemm.n_threads()));
  for (TeamRoute& r : L->team_) {
    r.chosen.assign(static_cast<size_t>(m.n_used), 0);
    r.active_k.assign(static_cast<size_t>(m.n_used), 0);
    r.weights.assign(static_cast<size_t>(m.n_used), 0);
    r.route.assign(static_cast<size_t>(2 * E), 0);
    r.idx.assign(static_cast<size_t>(std::max(E, m.n_groups)), 0);
  }
  L->route_.assign(rows * 2 * E, 0);
  L->idx_stride_ = std::max(E, m.n_groups);
  L->route_idx_.assign(rows * L->idx_stride_, 0);
  if (!L->fused_) L->xin_.assign(rows * H, 0);  // the per-expert path's copy of an expert's tokens
  L->gu_.assign(rows * 2 * widest, 0);
  L->act_.assign(rows * widest, 0);
  L->y_.assign(rows * H, 0);
  L->acc_.assign(rows * H, 0);
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
  s.Gemm(*router_, s.h, T, logits_.data());
  ParallelRows(T, nthr, [&](int t) {
    float* r = &route_[static_cast<size_t>(t) * 2 * E];
    Route(&logits_[static_cast<size_t>(t) * E], &chosen_[static_cast<size_t>(t) * K],
          &weights_[static_cast<size_t>(t) * K], r, r + E, &route_idx_[static_cast<size_t>(t) * idx_stride_]);
  });
  std::fill_n(acc_.begin(), static_cast<size_t>(T) * H, 0.0f);
  // Each expert over the tokens that chose it, in increasing expert index.
  for (int e = 0; e < (fused_ ? 0 : E); ++e) {
    int n = 0;
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        if (chosen_[static_cast<size_t>(t) * K + k] == e) {
          rows_of_[n] = t * K + k;
          std::copy_n(&s.h[static_cast<size_t>(t) * H], H, &xin_[static_cast<size_t>(n) * H]);
          ++n;
        }
      }
    }
    if (n == 0) continue;
    routed_[e] += static_cast<uint64_t>(n);
    s.Gemm(*gate_up_[e], xin_.data(), n, gu_.data());
    for (int i = 0; i < n; ++i) {
      const float* g = &gu_[static_cast<size_t>(i) * 2 * F];
      SiluMul(g, g + F, &act_[static_cast<size_t>(i) * F], F);
    }
    s.Gemm(*down_[e], act_.data(), n, y_.data());
    for (int i = 0; i < n; ++i) {
      const int t = rows_of_[i] / K;
      const float w = weights_[rows_of_[i]];
      float* a = &acc_[static_cast<size_t>(t) * H];
      const float* y = &y_[static_cast<size_t>(i) * H];
      for (int d = 0; d < H; ++d) a[d] = std::fma(w, y[d], a[d]);
    }
  }
  if (fused_) ExpertsQuantized(T, s);
  s.timer->Mark(pf.ffn_up);
  if (sh_gate_up_) {  // the shared experts: one dense SwiGLU on every token
    const int SF = m_.n_shared * F;
    s.Gemm(*sh_gate_up_, s.h, T, gu_.data());
    for (int t = 0; t < T; ++t) {
      const float* g = &gu_[static_cast<size_t>(t) * 2 * SF];
      SiluMul(g, g + SF, &act_[static_cast<size_t>(t) * SF], SF);
    }
    s.Gemm(*sh_down_, act_.data(), T, y_.data());
    AddInPlace(acc_.data(), y_.data(), T * H);
  }
  AddInPlace(x, acc_.data(), T * H);
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
  std::fill(off_.begin(), off_.end(), 0);
  for (int i = 0; i < T * K; ++i) ++off_[chosen_[i] + 1];
  for (int e = 0; e < E; ++e) {
    routed_[e] += static_cast<uint64_t>(off_[e + 1]);
    off_[e + 1] += off_[e];
  }
  for (int i = 0; i < T * K; ++i) {  // off_[e] advances to the end of e's slots, then shifts back below
    const int slot = off_[chosen_[i]]++;
    tok_[slot] = i / K;
    rows_of_[slot] = i;
  }
  for (int e = E; e > 0; --e) off_[e] = off_[e - 1];
  off_[0] = 0;
  if (T * K <= spread_slots_) return ExpertsSpread(T, s);
  const int nb = F / 32;
#pragma omp parallel num_threads(nthr)
  {
#pragma omp for schedule(static)
    for (int i = 0; i < nthr; ++i) hq_.Quantize(s.h, T * i / nthr, T * (i + 1) / nthr);
    int j = 0;  // experts run so far: which of aq_ this one writes
    for (int e = 0; e < E; ++e) {
      const int o = off_[e], n = off_[e + 1] - o;
      if (n == 0) continue;
      const QuantWeights& gu = *gate_up_[e]->quantized();
      const QuantWeights& dn = *down_[e]->quantized();
      QuantizedRows& aq = aq_[j++ % 2];
      // Gate and up columns [c0, c1) (and F + c0 ...), SiLU product, its int8 blocks. The barrier at the
      // end publishes aq to every thread.
#pragma omp for schedule(static)
      for (int i = 0; i < nthr; ++i) {
        const int c0 = nb * i / nthr * 32, c1 = nb * (i + 1) / nthr * 32;
        if (c0 == c1) continue;
        GateUpSlice(gu, QuantizedRowSet{&hq_, &tok_[o], n}, c0, c1, gu_.data(), act_.data(), aq, 0);
      }
      // Down columns [c0, c1) and their share of the output. No barrier: the next expert writes the other
      // aq_, and the one after waits at the next expert's barrier for this loop to end everywhere.
#pragma omp for schedule(static) nowait
      for (int i = 0; i < nthr; ++i) {
        const int c0 = dn.UnitStart(static_cast<int>(static_cast<int64_t>(H) * i / nthr));
        const int c1 = dn.UnitStart(static_cast<int>(static_cast<int64_t>(H) * (i + 1) / nthr));
        if (c0 == c1) continue;
        dn.Compute(QuantizedRowSet{&aq, nullptr, n}, c0, c1, y_.data(), H);
        for (int r = 0; r < n; ++r) {
          const float w = weights_[rows_of_[o + r]];
          float* a = &acc_[static_cast<size_t>(tok_[o + r]) * H];
          const float* y = &y_[static_cast<size_t>(r) * H];
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
    if (off_[e + 1] > off_[e]) active_[A++] = e;
  const int nb = F / 32;
  // Decode (T ≤ kOwnQuantRows): each thread quantizes the tokens' rows itself, as Linear::Forward does,
  // and the barrier after the shared quantization goes.
  const bool own = T <= kOwnQuantRows;
#pragma omp parallel num_threads(nthr)
  {
    const QuantizedRows* hq = &hq_;
    if (own) {
      QuantizedRows& q = hq_own_[static_cast<size_t>(omp_get_thread_num())];
      q.Quantize(s.h, 0, T);
      hq = &q;
    } else {
#pragma omp for schedule(static)
      for (int i = 0; i < nthr; ++i) hq_.Quantize(s.h, T * i / nthr, T * (i + 1) / nthr);
    }
    // Gate/up: thread i takes the 32-column blocks [A·nb·i/nthr, A·nb·(i+1)/nthr) of the active experts'
    // columns laid end to end; each slot's rows land at its place (off_) in the slot buffers.
#pragma omp for schedule(static)
    for (int i = 0; i < nthr; ++i) {
      const int64_t g0 = int64_t{A} * nb * i / nthr, g1 = int64_t{A} * nb * (i + 1) / nthr;
      for (int64_t a = g0 / nb; a < A && a * nb < g1; ++a) {
        const int e = active_[a], o = off_[e], n = off_[e + 1] - o;
        const int c0 = static_cast<int>(std::max(g0, a * nb) - a * nb) * 32;
        const int c1 = static_cast<int>(std::min(g1, (a + 1) * nb) - a * nb) * 32;
        if (c0 == c1) continue;
        GateUpSlice(*gate_up_[e]->quantized(), QuantizedRowSet{hq, &tok_[o], n}, c0, c1,
                    &sgu_[static_cast<size_t>(o) * 2 * F], sact_.data(), saq_, o);
      }
    }
    // Down: the active experts' H output columns end to end, cut on unit starts.
#pragma omp for schedule(static)
    for (int i = 0; i < nthr; ++i) {
      const int64_t g0 = int64_t{A} * H * i / nthr, g1 = int64_t{A} * H * (i + 1) / nthr;
      for (int64_t a = g0 / H; a < A && a * H < g1; ++a) {
        const int e = active_[a], o = off_[e], n = off_[e + 1] - o;
        const QuantWeights& dn = *down_[e]->quantized();
        const int c0 = dn.UnitStart(static_cast<int>(std::max(g0, a * H) - a * H));
        const int c1 = dn.UnitStart(static_cast<int>(std::min(g1, (a + 1) * H) - a * H));
        if (c0 == c1) continue;
        dn.Compute(QuantizedRowSet{&saq_, &seq_[o], n}, c0, c1, &sy_[static_cast<size_t>(o) * H], H);
      }
    }
    // Output columns [d0, d1): Σ over the experts in increasing index, as the per-expert path adds them.
#pragma omp for schedule(static)
    for (int i = 0; i < nthr; ++i) {
      const int d0 = H * i / nthr / 16 * 16, d1 = i + 1 == nthr ? H : H * (i + 1) / nthr / 16 * 16;
      for (int a = 0; a < A; ++a) {
        const int e = active_[a];
        for (int slot = off_[e]; slot < off_[e + 1]; ++slot) {
          const float w = weights_[rows_of_[slot]];
          float* acc = &acc_[static_cast<size_t>(tok_[slot]) * H];
          const float* y = &sy_[static_cast<size_t>(slot) * H];
          for (int d = d0; d < d1; ++d) acc[d] = std::fma(w, y[d], acc[d]);
        }
      }
    }
  }
}

// One token, every thread of the team (what Forward and ExpertsSpread compute, with the same bits): each
// thread normalizes the row, computes its share of the router, and after a barrier routes the token for
// itself (every thread gets the same experts); then the active experts' gate/up blocks, their down
// columns and the output columns are shared as in ExpertsSpread, with a barrier after each.
void MoeSwiGlu::ForwardTeam(float* x, const StepRows& /*rows*/, const LayerScratch& s) {
  const int H = hidden_, E = m_.n_experts, K = m_.n_used, F = m_.expert_ffn, nb = F / 32;
  const int me = omp_get_thread_num(), nt = omp_get_num_threads();
  ForwardProfile& pf = *s.profile;
  PhaseTimer* timer = me == 0 ? s.timer : nullptr;
  float* h = s.TeamRows(me);
  RmsNorm(x, norm_.data(), h, H, eps_);
  if (timer) timer->Mark(pf.norms);
  router_->ForwardShare(h, 1, logits_.data(), [](int, int) {});
  if (fused_) hq_own_[static_cast<size_t>(me)].Quantize(h, 0, 1);
  s.Barrier();
  TeamRoute& r = team_[static_cast<size_t>(me)];
  Route(logits_.data(), r.chosen.data(), r.weights.data(), r.route.data(), r.route.data() + E, r.idx.data());
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
  QuantizedRows& hq = hq_own_[static_cast<size_t>(me)];
  // Gate/up: the 32-column blocks of the K experts end to end; expert a's product lands in slot a.
  {
    const int64_t g0 = int64_t{K} * nb * me / nt, g1 = int64_t{K} * nb * (me + 1) / nt;
    for (int64_t a = g0 / nb; a < K && a * nb < g1; ++a) {
      const int e = r.chosen[r.active_k[a]];
      const int c0 = static_cast<int>(std::max(g0, a * nb) - a * nb) * 32;
      const int c1 = static_cast<int>(std::min(g1, (a + 1) * nb) - a * nb) * 32;
      if (c0 == c1) continue;
      GateUpSlice(*gate_up_[e]->quantized(), QuantizedRowSet{&hq, seq_.data(), 1}, c0, c1,
                  &sgu_[static_cast<size_t>(a) * 2 * F], sact_.data(), saq_, static_cast<int>(a));
    }
  }
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
      dn.Compute(QuantizedRowSet{&saq_, &seq_[static_cast<size_t>(a)], 1}, c0, c1, &sy_[static_cast<size_t>(a) * H], H);
    }
  }
  s.Barrier();
  AddExpertOutputs(x, sy_.data(), r);
  s.Barrier();
  if (timer) timer->Mark(pf.ffn_down);
}

// The experts of ForwardTeam on GEMMs of another kind (bf16, f32): each thread computes its share of every
// chosen expert's gate/up columns (expert a's in gu_ row a); after a barrier, each expert's SiLU product for
// itself and its share of the expert's down columns (into y_ row a); after a barrier, its output columns as
// Forward adds them (experts in increasing index, from zero).
void MoeSwiGlu::ExpertsTeam(float* x, float* h, const TeamRoute& r, const LayerScratch& s) {
  const int H = hidden_, K = m_.n_used, F = m_.expert_ffn;
  const int me = omp_get_thread_num();
  ForwardProfile& pf = *s.profile;
  PhaseTimer* timer = me == 0 ? s.timer : nullptr;
  for (int a = 0; a < K; ++a) {
    gate_up_[r.chosen[r.active_k[a]]]->ForwardShare(h, 1, &gu_[static_cast<size_t>(a) * 2 * F], [](int, int) {});
  }
  s.Barrier();
  if (timer) timer->Mark(pf.ffn_up);
  for (int a = 0; a < K; ++a) {  // h is the SiLU product from here on
    const float* g = &gu_[static_cast<size_t>(a) * 2 * F];
    SiluMul(g, g + F, h, F);
    down_[r.chosen[r.active_k[a]]]->ForwardShare(h, 1, &y_[static_cast<size_t>(a) * H], [](int, int) {});
  }
  s.Barrier();
  AddExpertOutputs(x, y_.data(), r);
  s.Barrier();
  if (timer) timer->Mark(pf.ffn_down);
}

void MoeSwiGlu::AddExpertOutputs(float* x, const float* ys, const TeamRoute& r) {
  const int H = hidden_, me = omp_get_thread_num(), nt = omp_get_num_threads();
  const int d0 = H * me / nt, d1 = H * (me + 1) / nt;
  float* acc = &acc_[static_cast<size_t>(d0)];
  std::fill(acc, acc + (d1 - d0), 0.0f);
  for (int a = 0; a < m_.n_used; ++a) {
    const float w = r.weights[r.active_k[a]];
    const float* y = ys + static_cast<size_t>(a) * H + d0;
    for (int d = 0; d < d1 - d0; ++d) acc[d] = std::fma(w, y[d], acc[d]);
  }
  AddInPlace(x + d0, acc, d1 - d0);
}

}  // namespace

StatusOr<std::unique_ptr<Layer>> MakeMoeSwiGlu(const LayerInit& in) { return MoeSwiGlu::Make(in); }

}  // namespace qkv
