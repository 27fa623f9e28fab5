// Panels: 16 weight rows of a 32-value block type (Q4_0, Q5_0, Q8_0, IQ4_NL) repacked at load so that one
// zmm (two ymm on AVX2) holds 4 consecutive values of each of the 16 rows, one row per 32-bit lane. An
// integer dot product (vpdpbusd, or maddubs + madd on AVX2) then gives each lane the exact int32 sum of
// its row's block against the activation block, and each output is
//   Σ over 32-blocks b, in order: acc = fma(float(Σ_{32 values} w·a), w_scale × a_scale, acc)
// with one accumulator per output and no horizontal sum. Per 32 values that is 3 float operations per 16
// outputs instead of 3 per 2 in the row-wise kernel (quant_gemm.cc), which is what bounds quantized decode.
// Like the row-wise kernel, the order never depends on M, the other rows or the thread, and every level
// computes the same exact integer sums and the same float operations: the same bits at AVX2 and AVX-512
// VNNI. The bytes are the file's, reordered (16 × a block's bytes per panel block); nothing is added.
//
// Panel block layout (one per 32 values; blocks follow each other):
//   16 f16 scales (32 bytes), then for Q5_0 eight 64-bit masks (bit 4c + i of mask t: fifth bit of value
//   4t + i of row c), then the quants: Q8_0 eight 64-byte rows (dword c of row t: values 4t..4t+3 of row
//   c), the 4-bit types four 64-byte rows (dword c of row t: the file's bytes 4t..4t+3 of row c, whose low
//   nibbles are values 4t.. and high nibbles values 16 + 4t..). AVX2 reads each 64-byte row as two halves
//   of 8 rows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/quant.h"

namespace qkv {

struct QuantizedRows;

inline constexpr int kPanelRows = 16;

// Whether rows of type t can be kept as panels.
bool HasPanelKernel(GgmlType t);
// Repacks kPanelRows rows of k values (row r at src + r × row_bytes) into dst (kPanelRows × row_bytes bytes).
void RepackPanel(GgmlType t, const uint8_t* src, size_t row_bytes, int k, uint8_t* dst);
// The file's bytes of block b of row c of a panel (GgmlBlockBytes(t) bytes to dst).
void PanelBlock(GgmlType t, const uint8_t* panel, int b, int c, uint8_t* dst);
// out[r × ldo + c] = Σ_b (see above) for every activation row r < a.m and panel row c < kPanelRows.
void PanelDot(bool vnni, GgmlType t, const uint8_t* panel, int k, const QuantizedRows& a, float* out, int ldo);

}  // namespace qkv
