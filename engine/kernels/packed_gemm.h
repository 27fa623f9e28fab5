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
  PackedWeights(const float* w, const float* bias, int n, int k, bool bf16,
                std::shared_ptr<WeightsArena> arena = nullptr);
  int n() const { return n_; }
  int k() const { return k_; }
  int panels() const { return (n_ + kPanel - 1) / kPanel; }
  size_t bytes() const { return w_.size() + bias_.size() * 4; }
  // The kernel level Compute runs at (ActiveKernelIsa, rounded down to a level with a kernel).
  static KernelIsa Level();

  // Columns [panel0 * 16, min(n, panel1 * 16)) of m rows. x: row stride ldx (f32); y: row stride ldy.
  void Compute(const float* x, int ldx, int m, int panel0, int panel1, float* y, int ldy) const;

 private:
  int n_, k_;
  bool bf16_;
  WeightsBuffer w_;          // f32 [panel][k][16], or bf16 [panel][k][16] with pairs (c, c + 8)
  std::vector<float> bias_;  // padded to whole panels, or empty
};

}  // namespace qkv
