// The GEMM on weights kept in ggml's quantized block formats (quant.h): y[M, N] = x[M, K] · Wᵀ (+ b).
//
// Activations are quantized to int8 per row and per block of 32 values (scale = max|x| / 127, rounded to
// nearest), never per batch, so a row's int8 image does not depend on the other rows. A weight row is
// decoded to int8 values and per-16 scales and offsets (DecodeRowI8), and each output is
//   Σ over 32-blocks b, in order, of 8 lanes: lane i += float(Σ_{4 values} w·a) · (w_scale · a_scale)
//                                             − w_offset · (a_scale · Σ_{4 values} a)
// with integer products summed exactly in int32 and the 8 lanes added in a fixed order at the end. The
// order never depends on M, the rows beside it or the thread that computes it, so the bits of a row's
// outputs are the same whatever the batch (row independence and batch invariance by construction).
// AVX2 integer dot products (maddubs), or on AVX-512 VNNI (vpdpbusd, two columns per zmm) where the CPU has
// it (kernels/cpu.h): the same bits at both levels, since every lane does the same exact integer sums and
// the same float operations in the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kernels/cpu.h"
#include "engine/quant.h"

namespace qkv {

// m rows of k activations as int8 with their per-32 scales and per-4 sums (see above).
struct QuantizedRows {
  int m = 0, k = 0;
  std::vector<int8_t> q;     // [m][k]
  std::vector<float> scale;  // [m][k / 32]
  std::vector<float> sum4;   // [m][k / 4]: scale × (sum of 4 consecutive q)
  // Quantizes rows [r0, r1) of x (row stride k); Resize first.
  void Resize(int rows, int cols);
  void Quantize(const float* x, int r0, int r1);
  size_t bytes() const { return q.capacity() + (scale.capacity() + sum4.capacity()) * sizeof(float); }
};

// Rows are stored in groups of kInterleave whose blocks alternate (row 0 block 0, row 1 block 0, ...,
// row 0 block 1, ...): decode reads a group as one sequential stream. Rows past the last whole group are
// stored one after another. The bytes are the file's, reordered; nothing is added.
inline constexpr int kInterleave = 4;

class QuantWeights {
 public:
  // `rows` consecutive weight rows of one type: row r of the part starts at data + r × row_bytes.
  struct Part {
    GgmlType type;
    int rows;
    const uint8_t* data;
  };
  // Copies the parts' bytes. k must be a multiple of each part's block size (and of 32).
  QuantWeights(const std::vector<Part>& parts, int k, const float* bias);
  int n() const { return n_; }
  int k() const { return k_; }
  // Whether k is a whole number of blocks of every part's type (Linear::CreateQuantized refuses otherwise).
  bool whole_blocks() const { return whole_blocks_; }
  size_t bytes() const { return data_.size() + bias_.size() * sizeof(float); }
  // The types of the parts, e.g. "q4_k+q6_k".
  std::string types() const;
  // The kernel level Compute runs at (ActiveKernelIsa, rounded down to a level with a kernel).
  static KernelIsa Level();
  // Row r expanded to f32 (as DequantizeRow).
  void DequantizeRow(int r, float* dst) const;
  // y[i, c] for rows i < a.m and columns c in [c0, c1); y has row stride ldy. Column ranges that start
  // and end on multiples of kInterleave read whole groups.
  void Compute(const QuantizedRows& a, int c0, int c1, float* y, size_t ldy) const;

 private:
  struct Row {
    GgmlType type;
    size_t offset;  // of its first block
    size_t stride;  // bytes from one of its blocks to the next
  };
  int n_ = 0, k_ = 0;
  bool whole_blocks_ = true;
  std::vector<uint8_t> data_;
  std::vector<Row> rows_;
  std::vector<float> bias_;
};

}  // namespace qkv
