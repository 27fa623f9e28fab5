// The dense SwiGLU FFN: h = RMSNorm(x) → [g | u] = h·W_GUᵀ (gate and up fused) → x += (silu(g)·u)·W_downᵀ.
#include <omp.h>

#include <algorithm>

#include "engine/kernels/parallel.h"
#include "engine/layers/layer.h"

namespace qkv {
namespace {

class DenseSwiGlu final : public Layer {
 public:
  std::string_view kind() const override { return "dense_swiglu"; }
  size_t weight_bytes() const override { return gate_up_->weight_bytes() + down_->weight_bytes() + 4 * norm_.size(); }
  size_t weight_bytes_per_token() const override { return gate_up_->weight_bytes() + down_->weight_bytes(); }
  void ForEachLinear(const std::function<void(const Linear&)>& f) const override {
    f(*gate_up_);
    f(*down_);
  }

  static StatusOr<std::unique_ptr<Layer>> Make(const LayerInit& in);
  void Forward(float* x, const StepRows& rows, const LayerScratch& s) override;
  bool team_ready() const override { return gate_up_->team_ready() && down_->team_ready(); }
  size_t team_floats() const override { return static_cast<size_t>(PaddedRows(1)) * std::max(hidden_, ffn_); }
  void ForwardTeam(float* x, const StepRows& rows, const LayerScratch& s) override;

 private:
  int hidden_ = 0, ffn_ = 0;
  float eps_ = 0;
  std::vector<float> norm_;
  std::unique_ptr<Linear> gate_up_, down_;
};

StatusOr<std::unique_ptr<Layer>> DenseSwiGlu::Make(const LayerInit& in) {
  const ModelConfig& c = in.config;
  auto L = std::make_unique<DenseSwiGlu>();
  L->hidden_ = c.hidden;
  L->ffn_ = c.ffn;
  L->eps_ = static_cast<float>(c.rms_eps);
  const auto H = static_cast<uint64_t>(c.hidden), F = static_cast<uint64_t>(c.ffn);
  const std::string p = "blk." + std::to_string(in.block) + ".";
  QKV_ASSIGN_OR_RETURN(L->norm_, ReadTensor(in.file, c.FfnNormName(in.block), {H}));
  const int ffn = c.ffn;
  QKV_ASSIGN_OR_RETURN(L->gate_up_, MakeLinear(in.file, in.gemm, in.weights_dtype, in.keep_quantized,
                                               {{p + "ffn_gate.weight", F, 0, ffn}, {p + "ffn_up.weight", F, 0, ffn}},
                                               c.hidden, nullptr));
  QKV_ASSIGN_OR_RETURN(L->down_, MakeLinear(in.file, in.gemm, in.weights_dtype, in.keep_quantized,
                                            {{p + "ffn_down.weight", H, 0, c.hidden}}, ffn, nullptr));
  return std::unique_ptr<Layer>(std::move(L));
}

void DenseSwiGlu::Forward(float* x, const StepRows& rows, const LayerScratch& s) {
  const int T = rows.T, H = hidden_, F = ffn_, nthr = s.n_threads;
  ForwardProfile& pf = *s.profile;
  ParallelRows(T, nthr, [&](int t) {
    RmsNorm(&x[static_cast<size_t>(t) * H], norm_.data(), &s.h[static_cast<size_t>(t) * H], H, eps_);
  });
  s.timer->Mark(pf.norms);
  s.Gemm(*gate_up_, s.h, T, s.gu);
  s.timer->Mark(pf.ffn_up);
  ParallelRows(T, nthr, [&](int t) {
    const float* g = &s.gu[static_cast<size_t>(t) * 2 * F];
    SiluMul(g, g + F, &s.act[static_cast<size_t>(t) * F], F);
  });
  s.timer->Mark(pf.ffn_act);
  s.Gemm(*down_, s.act, T, s.tmp);
  AddInPlace(x, s.tmp, T * H);
  s.timer->Mark(pf.ffn_down);
}

// One token, every thread of the team: each thread normalizes the row and computes its share of the gate/up
// columns; after a barrier each computes the whole SiLU product for itself (the down share reads all of
// it) and adds its share of the down columns to x.
void DenseSwiGlu::ForwardTeam(float* x, const StepRows& /*rows*/, const LayerScratch& s) {
  const int F = ffn_, me = omp_get_thread_num();
  ForwardProfile& pf = *s.profile;
  PhaseTimer* timer = me == 0 ? s.timer : nullptr;
  float* own = s.TeamNormShare(x, norm_, eps_, *gate_up_, s.gu);
  s.Barrier();
  if (timer) timer->Mark(pf.ffn_up);
  SiluMul(s.gu, s.gu + F, own, F);
  if (timer) timer->Mark(pf.ffn_act);
  down_->ForwardShare(own, 1, s.tmp, [&](int c0, int c1) { AddInPlace(x + c0, s.tmp + c0, c1 - c0); });
  s.Barrier();
  if (timer) timer->Mark(pf.ffn_down);
}

}  // namespace

StatusOr<std::unique_ptr<Layer>> MakeDenseSwiGlu(const LayerInit& in) { return DenseSwiGlu::Make(in); }

}  // namespace qkv
