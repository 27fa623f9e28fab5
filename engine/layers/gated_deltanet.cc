// Gated DeltaNet, the linear-attention layer of qwen35 (Qwen3.5), as llama.cpp's qwen35.cpp computes it:
//   h = RMSNorm(x) → [qkv | z | b | a] = h·Wᵀ (attn_qkv, attn_gate, ssm_beta, ssm_alpha fused)
//   qkv → causal depthwise conv1d over the last conv_kernel inputs (ssm_conv1d, no bias) → SiLU → q, k, v
//   q, k L2-normalized per key head (q then × 1/sqrt(d_k)); value head h reads key head h mod n_k_heads
//   β = sigmoid(b); g = softplus(a + dt_bias) × ssm_a (ssm_a = −exp(A_log), so g ≤ 0 is a log decay)
//   per value head: S ← e^g S;  S ← S + k (β (v − Sᵀk))ᵀ;  o = Sᵀq   (S is d_k × d_v)
//   o → RMSNorm per head (ssm_norm) × silu(z) → x += o·W_outᵀ (ssm_out).
//
// The state is computed in chunks of C = kDeltaNetChunk positions so that a token's output does not depend
// on how its context was cut into steps. S is committed only at absolute positions that are multiples of C.
// Token j of a chunk (its position − j a multiple of C), with G_j = g_0 + … + g_j, reads the committed S₀:
//   u_j = β_j (v_j − e^{G_j} S₀ᵀk_j − Σ_{s<j} e^{G_j−G_s} (k_s·k_j) u_s)
//   o_j = e^{G_j} S₀ᵀq_j + Σ_{s≤j} e^{G_j−G_s} (k_s·q_j) u_s
// (exactly the recurrence above, written from S₀), and the chunk's last token commits
//   S₀ ← e^{G_{C−1}} S₀ + Σ_s e^{G_{C−1}−G_s} k_s u_sᵀ.
// The slot keeps k_s, u_s and G_s of the chunk's tokens so far, so a decode step costs O(C) beyond the two
// readouts of S₀, and a prefill in any cut, a decode, a recompute after preemption all do the same
// arithmetic in the same order: the same bits.
//
// State slot layout (f32, at this layer's offset): the conv window [(conv_kernel − 1) × channels, oldest
// first], S₀ [n_v_heads × d_k × d_v], then per chunk position j < C: keys [n_k_heads × d_k], corrected values
// [n_v_heads × d_v], log decays G [n_v_heads].
#include <omp.h>

#include <array>
#include <cmath>
#include <cstring>

#include "engine/kernels/parallel.h"
#include "engine/layers/layer.h"

namespace qkv {
namespace {

constexpr int kC = kDeltaNetChunk;
constexpr int kMaxDim = 1024;  // ModelConfig::Validate bounds d_k and d_v

inline float Sigmoid(float x) { return 1.0f / (1.0f + FastExp(-x)); }
// llama.cpp's ggml_compute_softplus_f32.
inline float Softplus(float x) { return x > 20.0f ? x : std::log1p(FastExp(x)); }

// A Gated DeltaNet layer's scratch for max_rows rows (what one step needs, nothing kept between steps):
// projections, conv outputs (q | k | v, normalized), head outputs, the window on its way to the slot. Shared
// by the model's layers of the same sizes (SharedScratch).
struct DeltaNetBuffers {
  std::vector<float> p, conv, o, win;
  size_t bytes() const { return sizeof(float) * (p.size() + conv.size() + o.size() + win.size()); }
};

class GatedDeltaNet final : public Layer {
 public:
  std::string_view kind() const override { return "gated_deltanet"; }
  size_t weight_bytes() const override {
    return proj_->weight_bytes() + out_->weight_bytes() +
           4 * (norm_.size() + conv_t_.size() + dt_bias_.size() + a_.size() + head_norm_.size());
  }
  size_t weight_bytes_per_token() const override { return proj_->weight_bytes() + out_->weight_bytes(); }
  void ForEachLinear(const std::function<void(const Linear&)>& f) const override {
    f(*proj_);
    f(*out_);
  }
  CacheSpec cache() const override { return {0, la_.state_bytes()}; }
  // (its scratch is shared with the model's other Gated DeltaNet layers: SharedScratch counts it)
  size_t scratch_bytes() const override { return 0; }

  static StatusOr<std::unique_ptr<Layer>> Make(const LayerInit& in);
  void Forward(float* x, const StepRows& rows, const LayerScratch& s) override;
  bool team_ready() const override { return proj_->team_ready() && out_->team_ready(); }
  size_t team_floats() const override { return static_cast<size_t>(PaddedRows(1)) * hidden_; }
  void ForwardTeam(float* x, const StepRows& rows, const LayerScratch& s) override;

 private:
  // The slot regions of this layer for one sequence.
  struct View {
    float* window;  // [(K−1) × channels]
    float* S;       // [n_v × d_k × d_v]
    float* pk;      // [C × n_k × d_k]
    float* pu;      // [C × n_v × d_v]
    float* pg;      // [C × n_v]
  };
  View Slot(StateStore& st, int slot) const {
    auto* base = reinterpret_cast<float*>(st.Slot(slot) + state_offset_);
    View v;
    v.window = base;
    v.S = v.window + la_.window_floats();
    v.pk = v.S + la_.matrix_floats();
    v.pu = v.pk + int64_t{kC} * la_.n_k_heads * la_.k_dim;
    v.pg = v.pu + int64_t{kC} * la_.n_v_heads * la_.v_dim;
    return v;
  }
  // Conv input i of a step whose rows start at r0 (i < 0: from the window, which holds the inputs before it).
  const float* Input(int i, int r0, const View& v) const {
    const int ch = la_.conv_channels(), W = la_.conv_kernel - 1;
    return i < 0 ? v.window + static_cast<size_t>(W + i) * ch : &b_->p[static_cast<size_t>(r0 + i) * proj_n_];
  }
  void ConvRow(int i, int r0, const View& v);
  void MoveWindow(int r0, int n, const View& v);
  void Head(int h, int r0, int n, int pos0, const View& v);
  // The keys of the chunk left open by a step of n rows from r0 (positions pos0…) go to the slot.
  void KeepOpenKeys(int r0, int n, int pos0, const View& v);
  // Row t's value head h: RMSNorm (ssm_norm) × silu(z), in place.
  void GateHead(int t, int h);

  LinearAttnConfig la_;
  int hidden_ = 0, proj_n_ = 0, z_off_ = 0, b_off_ = 0, a_off_ = 0;
  int64_t state_offset_ = 0;
  float eps_ = 0;
  std::vector<float> norm_, conv_t_ /* [K][channels] */, dt_bias_, a_, head_norm_;
  std::unique_ptr<Linear> proj_, out_;
  // Scratch for max_rows rows, sized at load, shared by the model's layers of the same sizes.
  std::shared_ptr<DeltaNetBuffers> b_;
};

StatusOr<std::unique_ptr<Layer>> GatedDeltaNet::Make(const LayerInit& in) {
  const ModelConfig& c = in.config;
  auto L = std::make_unique<GatedDeltaNet>();
  const LinearAttnConfig& la = c.linear;
  L->la_ = la;
  L->hidden_ = c.hidden;
  L->eps_ = static_cast<float>(c.rms_eps);
  L->state_offset_ = in.state_offset;
  const auto H = static_cast<uint64_t>(c.hidden);
  const int ch = la.conv_channels(), vd = la.n_v_heads * la.v_dim, nv = la.n_v_heads;
  const std::string p = "blk." + std::to_string(in.block) + ".";
  QKV_ASSIGN_OR_RETURN(L->norm_, ReadTensor(in.file, p + "attn_norm.weight", {H}));
  QKV_ASSIGN_OR_RETURN(
      std::vector<float> conv,
      ReadTensor(in.file, p + "ssm_conv1d.weight", {static_cast<uint64_t>(la.conv_kernel), static_cast<uint64_t>(ch)}));
  L->conv_t_.resize(conv.size());
  for (int cc = 0; cc < ch; ++cc)
    for (int j = 0; j < la.conv_kernel; ++j)
      L->conv_t_[static_cast<size_t>(j) * ch + cc] = conv[static_cast<size_t>(cc) * la.conv_kernel + j];
  const auto NV = static_cast<uint64_t>(nv);
  QKV_ASSIGN_OR_RETURN(L->dt_bias_, ReadTensor(in.file, p + "ssm_dt.bias", {NV}));
  QKV_ASSIGN_OR_RETURN(L->a_, ReadTensor(in.file, p + "ssm_a", {NV}));
  QKV_ASSIGN_OR_RETURN(L->head_norm_, ReadTensor(in.file, p + "ssm_norm.weight", {static_cast<uint64_t>(la.v_dim)}));
  L->z_off_ = ch;
  L->b_off_ = ch + vd;
  L->a_off_ = ch + vd + nv;
  L->proj_n_ = ch + vd + 2 * nv;
  QKV_ASSIGN_OR_RETURN(L->proj_, MakeLinear(in.file, in.gemm, in.weights_dtype, in.keep_quantized,
                                            {{p + "attn_qkv.weight", static_cast<uint64_t>(ch), 0, ch},
                                             {p + "attn_gate.weight", static_cast<uint64_t>(vd), 0, vd},
                                             {p + "ssm_beta.weight", NV, 0, nv},
                                             {p + "ssm_alpha.weight", NV, 0, nv}},
                                            c.hidden, nullptr));
  QKV_ASSIGN_OR_RETURN(L->out_, MakeLinear(in.file, in.gemm, in.weights_dtype, in.keep_quantized,
                                           {{p + "ssm_out.weight", H, 0, c.hidden}}, vd, nullptr));
  const auto R = static_cast<size_t>(std::max(in.max_rows, 1));
  auto make = [&] {
    auto b = std::make_shared<DeltaNetBuffers>();
    b->p.assign(R * L->proj_n_, 0);
    b->conv.assign(R * ch, 0);
    b->o.assign(R * vd, 0);
    b->win.assign(static_cast<size_t>(la.window_floats()), 0);
    return b;
  };
  // Every size the buffers depend on is in the key, so layers that share them agree on all of them.
  const std::string key = "deltanet rows " + std::to_string(R) + " proj " + std::to_string(L->proj_n_) + " channels " +
                          std::to_string(ch) + " v " + std::to_string(vd) + " window " +
                          std::to_string(la.window_floats());
  L->b_ = in.shared ? in.shared->Get<DeltaNetBuffers>(key, make) : make();
  return std::unique_ptr<Layer>(std::move(L));
}

// Row i (of n, from r0) of one sequence's step through the causal conv: the conv_kernel latest inputs, those
// before the step from the window; SiLU; then its query and key heads L2-normalized (llama.cpp's
// ggml_l2_norm: x / max(‖x‖, eps)), the query then scaled by 1/sqrt(d_k).
void GatedDeltaNet::ConvRow(int i, int r0, const View& v) {
  const int K = la_.conv_kernel, ch = la_.conv_channels(), W = K - 1, dk = la_.k_dim;
  float* y = &b_->conv[static_cast<size_t>(r0 + i) * ch];
  for (int cc = 0; cc < ch; ++cc) y[cc] = 0.0f;
  for (int j = 0; j < K; ++j) {
    const float* src = Input(i - W + j, r0, v);
    const float* w = &conv_t_[static_cast<size_t>(j) * ch];
    for (int cc = 0; cc < ch; ++cc) y[cc] += w[cc] * src[cc];
  }
  for (int cc = 0; cc < ch; ++cc) y[cc] = y[cc] / (1.0f + FastExp(-y[cc]));
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int hh = 0; hh < 2 * la_.n_k_heads; ++hh) {
    float* e = y + static_cast<size_t>(hh) * dk;
    const float inv = 1.0f / std::fmax(std::sqrt(Dot(e, e, dk)), eps_);
    for (int d = 0; d < dk; ++d) e[d] *= inv;
    if (hh < la_.n_k_heads) {
      for (int d = 0; d < dk; ++d) e[d] *= q_scale;
    }
  }
}

// After the step: the sequence's last conv_kernel − 1 inputs become its window.
void GatedDeltaNet::MoveWindow(int r0, int n, const View& v) {
  const int ch = la_.conv_channels(), W = la_.conv_kernel - 1;
  if (W == 0) return;
  for (int i = 0; i < W; ++i)
    std::memcpy(&b_->win[static_cast<size_t>(i) * ch], Input(n - W + i, r0, v), sizeof(float) * ch);
  std::memcpy(v.window, b_->win.data(), sizeof(float) * static_cast<size_t>(W) * ch);
}

// Value head h of one sequence over its n new rows (r0…, positions pos0…).
void GatedDeltaNet::Head(int h, int r0, int n, int pos0, const View& v) {
  const int dk = la_.k_dim, dv = la_.v_dim, nk = la_.n_k_heads, nv = la_.n_v_heads, ch = la_.conv_channels();
  const int kh = h % nk;  // llama.cpp's tiled broadcast of key heads over value heads
  const size_t k_stride = static_cast<size_t>(nk) * dk, u_stride = static_cast<size_t>(nv) * dv;
  float* S = v.S + static_cast<size_t>(h) * dk * dv;
  // Chunk position s's key: from the slot if it came before this step, else from this step's conv rows.
  auto key = [&](int chunk0, int s) -> const float* {
    const int p = chunk0 + s;
    if (p < pos0) return v.pk + static_cast<size_t>(s) * k_stride + static_cast<size_t>(kh) * dk;
    return &b_->conv[static_cast<size_t>(r0 + p - pos0) * ch + static_cast<size_t>(nk + kh) * dk];
  };
  std::array<float, kMaxDim> sk, sq;
  std::array<float, kC> coef;
  for (int i = 0; i < n; ++i) {
    const int pos = pos0 + i, j = pos % kC, chunk0 = pos - j;
    const float* row = &b_->conv[static_cast<size_t>(r0 + i) * ch];
    const float* q = row + static_cast<size_t>(kh) * dk;
    const float* k = row + static_cast<size_t>(nk + kh) * dk;
    const float* vv = row + static_cast<size_t>(2 * nk) * dk + static_cast<size_t>(h) * dv;
    const float* pr = &b_->p[static_cast<size_t>(r0 + i) * proj_n_];
    const float beta = Sigmoid(pr[b_off_ + h]);
    const float g = Softplus(pr[a_off_ + h] + dt_bias_[h]) * a_[h];
    const float G = (j == 0 ? 0.0f : v.pg[static_cast<size_t>(j - 1) * nv + h]) + g;
    v.pg[static_cast<size_t>(j) * nv + h] = G;
    // Readouts of the committed state: S₀ᵀk and S₀ᵀq (rows of S in order).
    for (int d = 0; d < dv; ++d) sk[d] = sq[d] = 0.0f;
    for (int e = 0; e < dk; ++e) {
      const float* Se = S + static_cast<size_t>(e) * dv;
      const float ke = k[e], qe = q[e];
      for (int d = 0; d < dv; ++d) {
        sk[d] += Se[d] * ke;
        sq[d] += Se[d] * qe;
      }
    }
    const float decay = FastExp(G);
    // u_j = β (v − e^G S₀ᵀk − Σ_{s<j} e^{G−G_s} (k_s·k) u_s)
    float* u = v.pu + static_cast<size_t>(j) * u_stride + static_cast<size_t>(h) * dv;
    for (int s = 0; s < j; ++s)
      coef[s] = FastExp(G - v.pg[static_cast<size_t>(s) * nv + h]) * Dot(key(chunk0, s), k, dk);
    for (int d = 0; d < dv; ++d) u[d] = vv[d] - decay * sk[d];
    for (int s = 0; s < j; ++s) {
      const float* us = v.pu + static_cast<size_t>(s) * u_stride + static_cast<size_t>(h) * dv;
      const float cs = coef[s];
      for (int d = 0; d < dv; ++d) u[d] -= cs * us[d];
    }
    for (int d = 0; d < dv; ++d) u[d] *= beta;
    // o_j = e^G S₀ᵀq + Σ_{s≤j} e^{G−G_s} (k_s·q) u_s
    float* o = &b_->o[static_cast<size_t>(r0 + i) * u_stride + static_cast<size_t>(h) * dv];
    for (int d = 0; d < dv; ++d) o[d] = decay * sq[d];
    for (int s = 0; s <= j; ++s) {
      const float cs =
          (s == j ? 1.0f : FastExp(G - v.pg[static_cast<size_t>(s) * nv + h])) * Dot(key(chunk0, s), q, dk);
      const float* us = v.pu + static_cast<size_t>(s) * u_stride + static_cast<size_t>(h) * dv;
      for (int d = 0; d < dv; ++d) o[d] += cs * us[d];
    }
    if (j == kC - 1) {  // the chunk is complete: commit S₀ ← e^G S₀ + Σ_s e^{G−G_s} k_s u_sᵀ
      for (size_t e = 0; e < static_cast<size_t>(dk) * dv; ++e) S[e] *= decay;
      for (int s = 0; s < kC; ++s) {
        const float w = s == j ? 1.0f : FastExp(G - v.pg[static_cast<size_t>(s) * nv + h]);
        const float* ks = key(chunk0, s);
        const float* us = v.pu + static_cast<size_t>(s) * u_stride + static_cast<size_t>(h) * dv;
        for (int e = 0; e < dk; ++e) {
          const float f = w * ks[e];
          float* Se = S + static_cast<size_t>(e) * dv;
          for (int d = 0; d < dv; ++d) Se[d] += f * us[d];
        }
      }
    }
  }
}

void GatedDeltaNet::Forward(float* x, const StepRows& rows, const LayerScratch& s) {
  const int T = rows.T, H = hidden_, nthr = s.n_threads;
  const int nv = la_.n_v_heads;
  ForwardProfile& pf = *s.profile;
  float* h = s.h;
  ParallelRows(T, nthr, [&](int t) {
    RmsNorm(&x[static_cast<size_t>(t) * H], norm_.data(), &h[static_cast<size_t>(t) * H], H, eps_);
  });
  s.timer->Mark(pf.norms);
  s.Gemm(*proj_, h, T, b_->p.data());
  s.timer->Mark(pf.qkv);

  // The batch's sequences: their first row and count (a chunk's rows are contiguous).
  const int n_seq = static_cast<int>(rows.batch.size());
  std::vector<int> r0(static_cast<size_t>(n_seq) + 1, 0);
  for (int ci = 0; ci < n_seq; ++ci) r0[ci + 1] = r0[ci] + static_cast<int>(rows.batch[ci].tokens.size());
  std::vector<View> views(static_cast<size_t>(n_seq));
  for (int ci = 0; ci < n_seq; ++ci) views[ci] = Slot(*s.states, rows.batch[ci].seq->state_slot);
  // Every row's conv reads only inputs, so rows run in parallel; the windows move after.
  ParallelRows(T, nthr, [&](int t) {
    const int ci = rows.chunk_of[t];
    ConvRow(t - r0[ci], r0[ci], views[ci]);
  });
  for (int ci = 0; ci < n_seq; ++ci) MoveWindow(r0[ci], r0[ci + 1] - r0[ci], views[ci]);
  s.timer->Mark(pf.rope_store);

  const int items = n_seq * nv;
  ParallelItems(items, nthr, [&](int it) {
    const int ci = it / nv, hh = it % nv;
    Head(hh, r0[ci], r0[ci + 1] - r0[ci], rows.pos[r0[ci]], views[ci]);
  });
  // Keys of the chunk left open go to the slot (every value head of the group read them from the rows).
  for (int ci = 0; ci < n_seq; ++ci) KeepOpenKeys(r0[ci], r0[ci + 1] - r0[ci], rows.pos[r0[ci]], views[ci]);
  // Gated RMSNorm per value head with z, then the output projection.
  ParallelRows(T, nthr, [&](int t) {
    for (int hh = 0; hh < nv; ++hh) GateHead(t, hh);
  });
  s.timer->Mark(pf.attention);
  s.Gemm(*out_, b_->o.data(), T, s.tmp);
  AddInPlace(x, s.tmp, T * H);
  s.timer->Mark(pf.o);
}

void GatedDeltaNet::KeepOpenKeys(int r0, int n, int pos0, const View& v) {
  const size_t k_stride = static_cast<size_t>(la_.n_k_heads) * la_.k_dim;
  const int end = pos0 + n;
  for (int p = std::max(pos0, end - end % kC); p < end; ++p) {
    const float* k = &b_->conv[static_cast<size_t>(r0 + p - pos0) * la_.conv_channels() + k_stride];
    std::memcpy(v.pk + static_cast<size_t>(p % kC) * k_stride, k, sizeof(float) * k_stride);
  }
}

void GatedDeltaNet::GateHead(int t, int h) {
  const int dv = la_.v_dim;
  float* oh = &b_->o[(static_cast<size_t>(t) * la_.n_v_heads + h) * dv];
  const float* z = &b_->p[static_cast<size_t>(t) * proj_n_ + z_off_ + static_cast<size_t>(h) * dv];
  RmsNorm(oh, head_norm_.data(), oh, dv, eps_);
  SiluMul(z, oh, oh, dv);
}

// One token, every thread of the team (the operations of Forward on the same values, so the same bits):
// each thread normalizes the row for itself and computes its share of the fused projection; after a barrier
// the last thread runs the conv row, moves the window and keeps the open chunk's key (the heads read only
// earlier chunk positions from the slot, never that one); after a barrier, the value heads are shared out,
// each followed by its gated norm (which reads nothing of the other heads); after a barrier, each thread adds
// its share of the output projection to x.
void GatedDeltaNet::ForwardTeam(float* x, const StepRows& rows, const LayerScratch& s) {
  const int me = omp_get_thread_num(), nt = omp_get_num_threads();
  ForwardProfile& pf = *s.profile;
  PhaseTimer* timer = me == 0 ? s.timer : nullptr;
  s.TeamNormShare(x, norm_, eps_, *proj_, b_->p.data());
  s.Barrier();
  if (timer) timer->Mark(pf.qkv);
  const View v = Slot(*s.states, rows.batch[rows.chunk_of[0]].seq->state_slot);
  const int pos = rows.pos[0];
  if (me == nt - 1) {
    ConvRow(0, 0, v);
    MoveWindow(0, 1, v);
    KeepOpenKeys(0, 1, pos, v);
  }
  s.Barrier();
  if (timer) timer->Mark(pf.rope_store);
#pragma omp for schedule(static) nowait
  for (int hh = 0; hh < la_.n_v_heads; ++hh) {
    // static: a fixed run of heads per thread, so a head's state is updated by the same core every token (as
    // the attention's kv heads; docs/performance.md, "Decode attention: a fixed share of kv heads per thread").
    Head(hh, 0, 1, pos, v);
    GateHead(0, hh);
  }
  s.Barrier();
  if (timer) timer->Mark(pf.attention);
  out_->ForwardShare(b_->o.data(), 1, s.tmp, [&](int c0, int c1) { AddInPlace(x + c0, s.tmp + c0, c1 - c0); });
  s.Barrier();
  if (timer) timer->Mark(pf.o);
}

}  // namespace

StatusOr<std::unique_ptr<Layer>> MakeGatedDeltaNet(const LayerInit& in) { return GatedDeltaNet::Make(in); }

}  // namespace qkv
