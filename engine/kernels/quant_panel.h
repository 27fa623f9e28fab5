// Panels: 16 weight rows of one quantized type repacked at load so that a 64-byte panel row holds 4
// consecutive values of each of the 16 rows, one row per 32-bit lane (one zmm; two ymm halves on AVX2). An
// integer dot product (vpdpbusd, or maddubs + madd on AVX2) then adds 4 exact products to each of 16 int32
// sums, and each output has one float accumulator: per 32-block b in order (per 16 values for Q2_K, Q3_K,
// Q6_K, whose scales are per 16)
//   acc = fma(float(Σ w·a), w_scale × a_scale, acc)
//   acc = fma(−w_offset, float(Σ a) × a_scale, acc)      (types with a minimum: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)
// with w, w_scale, w_offset as DecodeRowI8 (quant.h) gives them and Σ w·a exact in int32. Per block that is 3
// float operations per 16 outputs instead of 3 per 2 in the row-wise kernel (quant_gemm.cc), which is what
// bound quantized decode. The order never depends on M, the other rows or the thread, and every level runs
// the same exact integer sums and the same float operations: the same bits at AVX2 and AVX-512 VNNI. The
// bytes are the file's, reordered (16 × a block's bytes per panel block; scales gathered into rows, fifth
// bits into rows by quad, Q3_K's 6-bit scales regrouped bit by bit); nothing is added. The layout of each type
// is in quant_panel.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/quant.h"

namespace qkv {

struct QuantizedRowSet;

inline constexpr int kPanelRows = 16;

// The activation rows of a QuantizedRowSet laid out for the panel tiles, built once per GEMM call and read by
// every panel: rows in groups of `top` (8 for the AVX-512 tiles, 4 for AVX2), then at most one group of each
// smaller power of two (the tiles' heights), and per group of R rows and 32-block b, at b × 48R: the R rows'
// 32 values (row r at 32r), their scales (float, at 32R + 4r), block sums (int32, at 36R + 4r) and half-block
// sums (int32, at 40R + 8r). After all rows, in the same order at b × 12R, the block and half-block sums times
// the scale (float(Σ a) × a_scale at 4r and 4R + 8r): the minimum's factor, worked out once a row instead of
// in every panel (hot Q4_K GEMV +3%, Zen 4), and apart so that the types without a minimum do not read it
// (interleaved it cost Q6_K and Q8_0 tiles 2% at M = 64; packed only for panels of those types). A tile then
// finds everything from two pointers at fixed offsets; with a pointer per row and per array (32 for 8 rows)
// the 8-row tile spilled them and spent a quarter of its time on address and bias arithmetic (Q4_0, 16 rows,
// Zen 5). The values are the QuantizedRows' own: the same bits as reading them there.
class PanelRows {
 public:
  // The scaled sums only where `scaled` (PanelHasMinimum of a type the panels have).
  void Pack(const QuantizedRowSet& a, int top, bool scaled);
  int m() const { return m_; }
  size_t bytes() const { return data_.capacity(); }
  // The group that starts at row r0 (a multiple of the heights before it, as PanelDot walks them).
  const uint8_t* group(int r0) const { return data_.data() + static_cast<size_t>(r0) * row_bytes_; }
  // Its scaled sums.
  const uint8_t* scaled(int r0) const {
    return data_.data() + static_cast<size_t>(m_) * row_bytes_ + static_cast<size_t>(r0) * scaled_row_bytes_;
  }

 private:
  int m_ = 0;
  size_t row_bytes_ = 0, scaled_row_bytes_ = 0;
  std::vector<uint8_t> data_;
};

// Whether rows of type t can be kept as panels.
bool HasPanelKernel(GgmlType t);
// Whether its panel tiles subtract a minimum (read PanelRows' scaled sums): Q4_1, Q5_1, Q2_K, Q4_K, Q5_K.
bool PanelHasMinimum(GgmlType t);
// Repacks kPanelRows rows of k values (row r at src + r × row_bytes) into dst (kPanelRows × row_bytes bytes).
void RepackPanel(GgmlType t, const uint8_t* src, size_t row_bytes, int k, uint8_t* dst);
// The file's bytes of block b of row c of a panel (GgmlBlockBytes(t) bytes to dst).
void PanelBlock(GgmlType t, const uint8_t* panel, int b, int c, uint8_t* dst);
// out[r × ldo + c] = Σ_b (see above) for every activation row r < a.m() and panel row c < kPanelRows; a packed
// with top 8 for vnni (the AVX-512 tiles), 4 otherwise (AVX2).
void PanelDot(bool vnni, GgmlType t, const uint8_t* panel, int k, const PanelRows& a, float* out, int ldo);

}  // namespace qkv
