// Dense layers on oneDNN matmul: y[M, N] = x[M, K] · Wᵀ (+ b).
//
// Row independence. A row's output must have the same bits whatever M is and whatever other rows are in
// the call (continuous batching mixes requests in one GEMM). oneDNN promises nothing here, so:
//   * the N columns are split into one contiguous slice per compute thread, and each thread runs its own
//     single-threaded primitive on its slice (no K-splitting, no cross-thread reduction) into a dense
//     buffer of its own, copied into place (a strided destination would demote brgemm to gemm:jit);
//   * M is padded up to a bucket (1, 2, 4, ..., kTileRows) and larger M runs as kTileRows-row tiles,
//     so only a fixed set of primitives ever runs, all created at start-up against one weight layout.
// tests/linear_test.cc checks every row of M = 1..200 against M = 1 for each shape and dtype.
#pragma once

#include <dnnl.hpp>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "engine/status.h"

namespace qkv {

enum class DType { kF32, kBF16 };
const char* DTypeName(DType d);
StatusOr<DType> ParseDType(const std::string& s);
inline int DTypeBytes(DType d) { return d == DType::kF32 ? 4 : 2; }

inline constexpr int kTileRows = 128;
// Rows of input/output storage a call with m rows touches (m padded to its bucket within the last tile).
int PaddedRows(int m);

// Shared oneDNN state: the engine, one stream and scratchpad per compute thread, and the primitives,
// cached by shape so that layers of the same shape share them.
class GemmRuntime {
 public:
  explicit GemmRuntime(int n_threads);
  ~GemmRuntime();
  int n_threads() const { return n_threads_; }
  const dnnl::engine& engine() const { return engine_; }

  struct Prim {
    dnnl::matmul prim;
    dnnl::matmul::primitive_desc pd;
  };
  // Primitive for (rows, n, k, ld_out) with the given weight layout, created on first use (start-up).
  StatusOr<const Prim*> Get(int rows, int n, int k, int ld_out, DType dt, bool bias, const dnnl::memory::desc& wei);
  // The weight layout oneDNN prefers for an [n, k] slice at the largest bucket.
  StatusOr<dnnl::memory::desc> PreferredWeights(int n, int k, int ld_out, DType dt, bool bias);
  void* scratch(int thread) { return scratch_[thread].data(); }
  // A dense [kTileRows x slice] output buffer per thread (see Linear::Forward).
  float* out(int thread) { return out_[thread].data(); }
  size_t scratch_bytes() const {
    size_t n = 0;
    for (const auto& s : scratch_) n += s.capacity();
    for (const auto& o : out_) n += o.capacity() * sizeof(float);
    return n;
  }
  dnnl::stream& stream(int thread) { return streams_[thread]; }
  // One line per distinct primitive: shape and the kernel oneDNN picked.
  std::vector<std::string> KernelLog() const;

 private:
  StatusOr<dnnl::matmul::primitive_desc> MakePd(int rows, int n, int k, int ld_out, DType dt, bool bias,
                                                const dnnl::memory::desc& wei);
  int n_threads_;
  dnnl::engine engine_;
  std::vector<dnnl::stream> streams_;
  std::vector<std::vector<uint8_t>> scratch_;
  std::vector<std::vector<float>> out_;
  std::map<std::string, std::unique_ptr<Prim>> prims_;
};

class Linear {
 public:
  // w: [n, k] row-major f32 (PyTorch's layout); bias: n values or nullptr.
  static StatusOr<std::unique_ptr<Linear>> Create(GemmRuntime& rt, const float* w, const float* bias, int n, int k,
                                                  DType dt);
  int n() const { return n_; }
  int k() const { return k_; }
  DType dtype() const { return dt_; }
  size_t weight_bytes() const { return weight_bytes_; }

  // x: m rows of k values in dtype() (f32, or bf16 as uint16), row stride k, storage for PaddedRows(m)
  // rows; y: f32 with row stride n, storage for PaddedRows(m) rows. Runs on all compute threads.
  void Forward(const void* x, int m, float* y) const;

 private:
  struct Slice {
    int n0 = 0, n = 0;
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
  GemmRuntime* rt_ = nullptr;
  int n_ = 0, k_ = 0;
  DType dt_ = DType::kF32;
  size_t weight_bytes_ = 0;
  std::vector<Slice> slices_;  // one per compute thread (may be empty for tiny n)
};

}  // namespace qkv
