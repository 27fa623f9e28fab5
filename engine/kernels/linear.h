// Dense layers: y[M, N] = x[M, K] · Wᵀ (+ b), on oneDNN matmul or on the engine's own packed GEMM.
//
// Row independence. A row's output must have the same bits whatever M is and whatever other rows are in
// the call (continuous batching mixes requests in one GEMM). oneDNN promises nothing here, so:
//   * the N columns are split into one contiguous slice per compute thread, and each slice runs its own
//     single-threaded primitive (no K-splitting, no cross-thread reduction) into a dense buffer of its
//     own, copied into place (a strided destination would demote brgemm to gemm:jit). Slices are shared
//     out with an OpenMP worksharing loop, so a smaller team than asked for still computes every slice;
//   * M is padded up to a bucket (min_rows, ..., 64, kTileRows) and larger M runs as kTileRows-row tiles,
//     so only a fixed set of primitives ever runs, all created at start-up against one weight layout;
//   * oneDNN is used only where one brgemm kernel serves every bucket (checked at start-up from the
//     kernel names). The smallest buckets are dropped (M padded up to 16 or 32 rows) if that makes the
//     kernels agree (AMX picks another kernel below a tile); failing that, or where oneDNN has no kernel
//     for the dtype (bf16 below AVX-512), the layer runs on PackedWeights (packed_gemm.h), which gives
//     the same bits for every M by construction.
//   * at kernel level amx (kernels/cpu.h), bf16 weights run on AmxWeights (amx_gemm.h), which gives the
//     same bits for every M by construction and is faster than oneDNN's AMX kernels at M = 1;
//   * at kernel level avx512_bf16, bf16 weights run on PackedWeights' bf16 form (vdpbf16ps over k-pairs,
//     activations rounded to bf16): oneDNN's prefill speed, and decode reads the weights at the bandwidth
//     where oneDNN's bf16 brgemm reached 70-82% of it at M = 1.
// QKV_GEMM=packed|onednn|amx|auto (default auto) forces a backend; onednn skips the same-kernel check (to
// measure oneDNN, or to see the same-bits tests fail) and fails only where oneDNN has no kernel; amx
// fails below kernel level amx.
// tests/linear_test.cc checks every row for M = 1..64, 65, 100, 127, 128, 129, 200 and 300 against M = 1,
// for each shape, dtype and backend.
#pragma once

#include <omp.h>

#include <atomic>
#include <dnnl.hpp>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "engine/dtype.h"
#include "engine/kernels/amx_gemm.h"
#include "engine/kernels/packed_gemm.h"
#include "engine/kernels/quant_gemm.h"
#include "engine/status.h"

namespace qkv {

inline constexpr int kTileRows = 128;
// Up to this many rows, a layer on quantized weights has every thread quantize the rows for itself.
inline constexpr int kOwnQuantRows = 2;
// Rows of input storage a call with m rows may read (m padded to its bucket within the last tile, and
// to at least the largest minimum bucket). Outputs are written for the m rows only.
int PaddedRows(int m);

enum class GemmBackend { kOneDnn, kPacked, kQuant, kAmx };
const char* GemmBackendName(GemmBackend b);
// QKV_GEMM from the environment: auto (unset or "auto"), or a forced backend.
StatusOr<std::optional<GemmBackend>> GemmBackendFromEnv();

// Shared oneDNN state: the engine, one stream and scratchpad per compute thread, and the primitives,
// cached by shape so that layers of the same shape share them.
class GemmRuntime {
 public:
  explicit GemmRuntime(int n_threads);
  ~GemmRuntime();
  int n_threads() const { return n_threads_; }
  const dnnl::engine& engine() const { return engine_; }
  // Where the model's weights live (weights_arena.h): quantized, packed, AMX and oneDNN's.
  const std::shared_ptr<WeightsArena>& weights_arena() const { return weights_arena_; }

  struct Prim {
    dnnl::matmul prim;
    dnnl::matmul::primitive_desc pd;
  };
  // Primitive for (rows, n, k, ld_out) with the given weight layout, created on first use (start-up).
  StatusOr<const Prim*> Get(int rows, int n, int k, int ld_out, DType dt, bool bias, const dnnl::memory::desc& wei);
  // The kernel oneDNN would pick for (rows, n, k) with this weight layout; nothing is registered.
  StatusOr<std::string> KernelFor(int rows, int n, int k, int ld_out, DType dt, bool bias,
                                  const dnnl::memory::desc& wei);
  // The weight layout oneDNN prefers for an [n, k] slice at the largest bucket.
  StatusOr<dnnl::memory::desc> PreferredWeights(int n, int k, int ld_out, DType dt, bool bias);
  void* scratch(int thread) { return scratch_[thread].data(); }
  // A dense [kTileRows x slice] output buffer per thread (see Linear::Forward).
  float* out(int thread) { return out_[thread].data(); }
  // Staging for the activations (engine thread only), sized here for rows x cols: quantized for the layers
  // on quantized weights, bf16 (`elems` values: tiles for the AMX GEMM, rounded rows for the packed GEMM's
  // bf16 form) for the others that round them. Their bytes are published
  // through an atomic, since scratch_bytes() is read by the metrics threads while these grow.
  QuantizedRows& QuantizedRowsFor(int rows, int cols) {
    qrows_.Resize(rows, cols);
    PublishStagingBytes();
    return qrows_;
  }
  // Thread t's copy alone, sized by that thread (team steps); ThreadQuantizedRowsFor reserves them at load.
  QuantizedRows& OwnQuantizedRows(int t, int rows, int cols) {
    thread_qrows_[t].Resize(rows, cols);
    return thread_qrows_[t];
  }
  // Thread t's bf16 copy of a step's rows for team steps (elems values), reserved by ReserveOwnBf16.
  uint16_t* OwnBf16Rows(int t, size_t elems) {
    if (own_bf16_[t].size() < elems) own_bf16_[t].resize(elems);
    return own_bf16_[t].data();
  }
  void ReserveOwnBf16(size_t elems) {
    for (auto& b : own_bf16_) b.resize(std::max(b.size(), elems));
    PublishStagingBytes();
  }
  // One copy per thread, for Linear::Forward's few-row (decode) path; sized here on the engine thread.
  QuantizedRows* ThreadQuantizedRowsFor(int rows, int cols) {
    for (auto& q : thread_qrows_) q.Resize(rows, cols);
    PublishStagingBytes();
    return thread_qrows_.data();
  }
  uint16_t* Bf16RowsFor(size_t elems) {
    if (bf16_rows_.size() < elems) {
      bf16_rows_.resize(elems);
      PublishStagingBytes();
    }
    return bf16_rows_.data();
  }
  size_t scratch_bytes() const {
    size_t n = staging_bytes_.load(std::memory_order_relaxed) + QuantWeights::ScratchBytes();
    for (const auto& s : scratch_) n += s.capacity();
    for (const auto& o : out_) n += o.capacity() * sizeof(float);
    return n;
  }
  dnnl::stream& stream(int thread) { return streams_[thread]; }
  // One line per distinct primitive: shape and the kernel oneDNN picked (packed layers: one line each shape).
  std::vector<std::string> KernelLog() const;
  // What the layers created so far run on, e.g. "onednn brg:avx512_core_bf16", "packed avx2 f32 x bf16",
  // or both joined by " + " when layers differ.
  std::string Summary() const;
  // oneDNN's effective instruction set, e.g. "avx2", "avx512_core_amx" (ONEDNN_MAX_CPU_ISA caps it).
  static std::string CpuIsa();
  // Records a created layer: its GEMM path (for Summary) and the dtype it takes its input in.
  // compute: the dtype the products are taken in (bf16 on the AMX GEMM although it takes f32 input).
  void NoteLayer(const std::string& what, DType input, DType compute) {
    layers_.insert(what);
    bf16_input_ |= input == DType::kBF16;
    bf16_compute_ |= compute == DType::kBF16;
  }
  // Verdicts of Linear's same-bits probe, by the primitives of a slice's buckets (empty: same bits).
  std::map<std::vector<const Prim*>, std::string>& probe_verdicts() { return probes_; }
  // Whether any layer takes bf16 input (then callers need a bf16 staging buffer).
  bool any_bf16_input() const { return bf16_input_; }
  // Whether any layer rounds its activations to bf16 (GetModelInfo's compute_dtype).
  bool any_bf16_compute() const { return bf16_compute_; }

 private:
  StatusOr<dnnl::matmul::primitive_desc> MakePd(int rows, int n, int k, int ld_out, DType dt, bool bias,
                                                const dnnl::memory::desc& wei);
  int n_threads_;
  dnnl::engine engine_;
  std::shared_ptr<WeightsArena> weights_arena_ = std::make_shared<WeightsArena>();
  std::vector<dnnl::stream> streams_;
  std::vector<std::vector<uint8_t>> scratch_;
  std::vector<std::vector<float>> out_;
  std::map<std::string, std::unique_ptr<Prim>> prims_;
  std::set<std::string> layers_;
  std::map<std::vector<const Prim*>, std::string> probes_;
  bool bf16_input_ = false;
  bool bf16_compute_ = false;
  QuantizedRows qrows_;
  std::vector<QuantizedRows> thread_qrows_;
  std::vector<std::vector<uint16_t>> own_bf16_;
  std::vector<uint16_t> bf16_rows_;
  std::atomic<size_t> staging_bytes_{0};

  void PublishStagingBytes() {
    size_t n = qrows_.bytes() + bf16_rows_.capacity() * sizeof(uint16_t);
    for (const auto& q : thread_qrows_) n += q.bytes();
    for (const auto& b : own_bf16_) n += b.capacity() * sizeof(uint16_t);
    staging_bytes_.store(n, std::memory_order_relaxed);
  }
};

class Linear {
 public:
  // w: [n, k] row-major f32 (PyTorch's layout); bias: n values or nullptr.
  static StatusOr<std::unique_ptr<Linear>> Create(GemmRuntime& rt, const float* w, const float* bias, int n, int k,
                                                  DType dt);
  // Weights kept in a ggml block format (quant_gemm.h), shared with whoever else reads them (the token
  // embedding of a model with tied embeddings).
  static StatusOr<std::unique_ptr<Linear>> CreateQuantized(GemmRuntime& rt, std::shared_ptr<const QuantWeights> w);
  int n() const { return n_; }
  int k() const { return k_; }
  DType dtype() const { return dt_; }
  GemmBackend backend() const {
    return quant_    ? GemmBackend::kQuant
           : packed_ ? GemmBackend::kPacked
           : amx_    ? GemmBackend::kAmx
                     : GemmBackend::kOneDnn;
  }
  // The dtype Forward expects x in: the weights' dtype on oneDNN, always f32 on the packed, AMX and
  // quantized backends.
  DType input_dtype() const { return packed_ || quant_ || amx_ ? DType::kF32 : dt_; }
  const QuantWeights* quantized() const { return quant_.get(); }
  size_t weight_bytes() const { return weight_bytes_; }

  // x: m rows of k values in input_dtype() (f32, or bf16 as uint16), row stride k, storage for
  // PaddedRows(m) rows; y: f32 with row stride n, m rows. Runs on all compute threads.
  void Forward(const void* x, int m, float* y) const;

  // The decode step inside one parallel region (Model::Forward's team step): every thread of the team
  // calls ForwardShare with the same x (f32, m ≤ kOwnQuantRows rows, row stride k, storage for
  // PaddedRows(m) rows) and computes some of the columns of y, each column once across the team, with the
  // bits of Forward; done(c0, c1) is called on the calling thread for each column range it wrote. No
  // barrier: the caller synchronizes before any thread reads another's columns. On oneDNN's bf16 GEMM each
  // thread rounds x to bf16 for itself. Every backend but AMX (team_ready).
  bool team_ready() const { return !amx_; }
  template <class Done>
  void ForwardShare(const float* x, int m, float* y, const Done& done) const {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const void* in = PrepareShare(x, m, t);
    const int shares = quant_ || packed_ ? rt_->n_threads() : static_cast<int>(slices_.size());
    for (int i = t; i < shares; i += nt) {
      const auto [c0, c1] = ComputeShare(i, t, in, m, y);
      if (c1 > c0) done(c0, c1);
    }
  }

 private:
  // x as the share's input on thread t: its own QuantizedRows holding x quantized (quantized backend), its
  // own buffer holding x rounded to bf16 (oneDNN bf16), or x itself.
  const void* PrepareShare(const float* x, int m, int t) const;
  // Share i of the columns (one per compute thread) on thread t's resources: the columns it wrote.
  std::pair<int, int> ComputeShare(int i, int t, const void* in, int m, float* y) const;
  struct Slice {
    int n0 = 0, n = 0;
    WeightsBuffer weights_mem;  // in the model's arena; `weights` points at it
    dnnl::memory weights;
    dnnl::memory bias;
    // Per bucket: the primitive and its argument memories (handles are set per call).
    struct Bucket {
      const GemmRuntime::Prim* p = nullptr;
      dnnl::memory src, dst, scratch;
      std::unordered_map<int, dnnl::memory> args;
    };
    std::vector<Bucket> buckets;
  };
  Linear() = default;
  Status CreateOneDnn(const float* w, const float* bias, int min_bucket, int max_bucket, bool same_kernel);
  Status ProbeSameBits(Slice& s);
  GemmRuntime* rt_ = nullptr;
  std::unique_ptr<PackedWeights> packed_;
  std::unique_ptr<AmxWeights> amx_;
  std::shared_ptr<const QuantWeights> quant_;
  int first_bucket_ = 0;  // buckets below it are padded up to it
  int last_bucket_ = 0;   // oneDNN: M runs in tiles of this bucket's rows
  int n_ = 0, k_ = 0;
  DType dt_ = DType::kF32;
  size_t weight_bytes_ = 0;
  std::vector<Slice> slices_;      // oneDNN: one per compute thread (may be empty for tiny n)
  std::vector<int> panel_bounds_;  // packed (AMX): slice t covers panels (groups) [bounds[t], bounds[t + 1])
};

}  // namespace qkv
