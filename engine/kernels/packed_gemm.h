// The engine's own GEMM, y[M, N] = x[M, K] · Wᵀ (+ b), for CPUs where oneDNN 2.6 cannot give one kernel
// family for every M (AVX2 and AVX-512 without bf16 instructions: no bf16 matmul at all below AVX-512,
// and gemm:jit sums the M = 1 row in another order).
//
// Same bits whatever M: every output element is one fused-multiply-add chain over k = 0, 1, ..., K-1,
// started at 0, and then the bias is added. The register tiles (how many rows and columns one call of the
// microkernel covers) change with M, but a tile only decides which chains run side by side, never the
// order inside a chain. Vector width does not enter either: on AVX-512 (kernels/cpu.h) a zmm holds a
// whole panel and the same chains give the same bits (tests/linear_test.cc compares the levels).
//
// Weights are packed once at load into panels of 16 columns, [panel][k][16], as f32 or bf16; a bf16 panel
// row stores columns (0, 8), (1, 9), ... in adjacent pairs so that one 32-byte load yields both halves
// with one shift and one mask. Inputs are f32: bf16 weights are widened, activations are not rounded.
//
// The bf16 form (`dot`, kernel level avx512_bf16 and up): weights [panel][k / 2][16][2] (column c's values
// k and k + 1 in one 32-bit lane, K padded to even with 0), activations rounded to bf16 (round to nearest
// even, as oneDNN does) and read in the same pairs, and every output one chain of `vdpbf16ps` over the pairs
// k = (0, 1), (2, 3), ... in order, started at 0, then the bias. Same bits whatever M and tile, as above;
// other bits than the f32 form (the activations are rounded and the pair's two products are the
// instruction's). Twice the products per instruction: prefill as fast as oneDNN's bf16 brgemm, and decode
// streams the weights like the f32 form (oneDNN's bf16 GEMV at M = 1 read them at 71-82% of the bandwidth).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kernels/cpu.h"
#include "engine/kernels/weights_arena.h"

namespace qkv {

class PackedWeights {
 public:
  static constexpr int kPanel = 16;
  // w: [n, k] row-major f32; bias: n values or nullptr; bf16 selects the stored dtype. The panels go into
  // the arena if there is one.
  // dot: the bf16 form (needs bf16 and a CPU at kernel level avx512_bf16 or above; runs at that level
  // whatever level is active later).
  PackedWeights(const float* w, const float* bias, int n, int k, bool bf16,
                std::shared_ptr<WeightsArena> arena = nullptr, bool dot = false);
  int n() const { return n_; }
  int k() const { return k_; }
  int panels() const { return (n_ + kPanel - 1) / kPanel; }
  size_t bytes() const { return w_.size() + bias_.size() * 4; }
  // The kernel level Compute runs at (ActiveKernelIsa, rounded down to a level with a kernel) for the f32
  // form; the bf16 form always runs at avx512_bf16.
  static KernelIsa Level();
  KernelIsa level() const { return dot_ ? KernelIsa::kAvx512Bf16 : Level(); }
  bool dot() const { return dot_; }

  // Columns [panel0 * 16, min(n, panel1 * 16)) of m rows. x: row stride ldx (f32); y: row stride ldy. The
  // bf16 form rounds the rows into a buffer of its own first (callers that stage them use the two below).
  void Compute(const float* x, int ldx, int m, int panel0, int panel1, float* y, int ldy) const;
  // The bf16 form's input: rows [r0, r1) of x (row stride ldx) rounded to bf16 into out, RoundedRowsSize(1)
  // values a row (K padded to even with 0); and Compute on such rows (m of them, from xb).
  size_t RoundedRowsSize(int m) const { return static_cast<size_t>(m) * ((k_ + 1) / 2 * 2); }
  void RoundRows(const float* x, int ldx, int r0, int r1, uint16_t* out) const;
  void ComputeRounded(const uint16_t* xb, int m, int panel0, int panel1, float* y, int ldy) const;

 private:
  int n_, k_;
  bool bf16_, dot_;
  WeightsBuffer w_;  // f32 [panel][k][16], bf16 [panel][k][16] with pairs (c, c + 8), or (dot) [panel][k/2][16][2]
  std::vector<float> bias_;  // padded to whole panels, or empty
};

}  // namespace qkv
