// The GEMM on weights kept in ggml's quantized block formats (quant.h): y[M, N] = x[M, K] · Wᵀ (+ b).
//
// Activations are quantized to int8 per row and per block of 32 values (scale = max|x| / 127, rounded to
// nearest), never per batch, so a row's int8 image does not depend on the other rows. Weight rows in
// panels of 16 (quant_panel.h) give each output one accumulator that takes each block's exact int32 sum.
// The other rows (past a part's last whole panel) are decoded to int8 values and per-16 scales and offsets
// (DecodeRowI8), and each output is
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
#include "engine/kernels/weights_arena.h"
#include "engine/quant.h"

namespace qkv {

// m rows of k activations as int8 with their per-32 scales and per-4 sums (see above).
struct QuantizedRows {
  int m = 0, k = 0;
  std::vector<int8_t> q;       // [m][k]
  std::vector<float> scale;    // [m][k / 32]
  std::vector<float> sum4;     // [m][k / 4]: scale × (sum of 4 consecutive q)
  std::vector<int32_t> sum16;  // [m][k / 16]: sum of 16 consecutive q (for the panels, quant_panel.h)
  std::vector<int32_t> sum32;  // [m][k / 32]: sum of the block's q
  // Quantizes rows [r0, r1) of x (row stride k); Resize first.
  void Resize(int rows, int cols);
  void Quantize(const float* x, int r0, int r1) { QuantizeBlocks(x, static_cast<size_t>(k), r0, r1, 0, k / 32); }
  // Quantizes the 32-blocks [b0, b1) of rows [r0, r1) of x (row stride ldx); each block's values, scale and
  // sums depend on that block only, so a row quantized in pieces has the bits of one quantized whole.
  void QuantizeBlocks(const float* x, size_t ldx, int r0, int r1, int b0, int b1);
  size_t bytes() const {
    return q.capacity() + (scale.capacity() + sum4.capacity()) * sizeof(float) +
           (sum16.capacity() + sum32.capacity()) * sizeof(int32_t);
  }
};

// The rows of a QuantizedRows a GEMM reads: output row i takes row idx[i] of src (rows 0 .. m − 1 in order
// when idx is null), so that tokens routed to one expert need no copy of their activations.
struct QuantizedRowSet {
  const QuantizedRows* src;
  const int* idx;
  int m;
  size_t row(int i) const { return static_cast<size_t>(idx ? idx[i] : i); }
};

// Rows are stored in panels of 16 (quant_panel.h) as far as a part has whole panels. Other rows are stored
// in groups of kInterleave whose blocks alternate (row 0 block 0, row 1 block 0, ..., row 0 block 1, ...):
// decode reads a group as one sequential stream. Rows past the last whole group are stored one after
// another. The bytes are the file's, reordered; nothing is added. Which kernel computes a row depends on
// its place in its part only.
inline constexpr int kInterleave = 4;

class QuantWeights {
 public:
  // `rows` consecutive weight rows of one type: row r of the part starts at data + r × row_bytes.
  struct Part {
    GgmlType type;
    int rows;
    const uint8_t* data;
  };
  // Copies the parts' bytes, into the arena if there is one. k must be a multiple of each part's block size
  // (and of 32).
  QuantWeights(const std::vector<Part>& parts, int k, const float* bias, std::shared_ptr<WeightsArena> arena = nullptr);
  // The arena the bytes live in (nullptr: operator new).
  const WeightsArena* arena() const { return data_.arena(); }
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
  // Whether row r is computed by the panel kernel (quant_panel.h) rather than the row-wise one.
  bool InPanel(int r) const { return At(r).panel; }
  // The first column of the unit (panel, interleaved group or single row) that column c belongs to; n() for
  // c = n(). Slices that start and end on unit starts read every unit whole.
  int UnitStart(int c) const { return c >= n_ ? n_ : At(c).unit; }
  // y[i, c] for rows i < a.m and columns c in [c0, c1); y has row stride ldy. Column ranges that start
  // and end on unit starts (UnitStart) read whole units; others compute a cut panel whole.
  void Compute(const QuantizedRows& a, int c0, int c1, float* y, size_t ldy) const {
    Compute(QuantizedRowSet{&a, nullptr, a.m}, c0, c1, y, ldy);
  }
  // The same for the rows a selects: y row i from row a.row(i).
  void Compute(const QuantizedRowSet& a, int c0, int c1, float* y, size_t ldy) const;
  // Bytes held by every thread's buffers for Compute (the packed activation rows, the output tile), in the
  // whole process: part of the runtime's scratch (GemmRuntime::scratch_bytes).
  static size_t ScratchBytes();

 private:
  // Where a column's blocks lie, worked out from its run. (A table of 32 bytes a column was 38 MB on the MoE
  // benchmark model, not counted in bytes(), and read cold at every decode GEMV: 5.6% on top of a Q4_K row
  // of 1,024 values. Dropping it: decode +3% and RSS -40 MB, 2026-12-04.)
  struct Row {
    GgmlType type;
    size_t offset;  // of its first block (for a panel row: of its panel)
    size_t stride;  // bytes from one of its blocks to the next (row-wise storage)
    int unit;       // first column of its unit
    bool panel;     // offset is a panel's; the row is lane (column − unit) of it
  };
  // Consecutive columns of one type stored one way: in panels, in interleaved groups, or one by one.
  struct Run {
    GgmlType type;
    int first, end;     // columns [first, end)
    int unit;           // columns per unit: kPanelRows, kInterleave or 1
    size_t offset;      // of the run's first unit
    size_t unit_bytes;  // bytes of one unit (unit × the row's bytes)
    size_t stride;      // from one block of a row to the next (row-wise); 0 in panels
  };
  const Run& RunOf(int c) const {
    size_t i = 0;
    while (c >= runs_[i].end) ++i;
    return runs_[i];
  }
  // Where column c (inside run r) starts: its unit's offset, plus its lane's first block in a group.
  static size_t OffsetIn(const Run& r, int c) {
    const int u = (c - r.first) / r.unit, lane = (c - r.first) % r.unit;
    const size_t unit_off = r.offset + static_cast<size_t>(u) * r.unit_bytes;
    return r.stride == 0 ? unit_off : unit_off + static_cast<size_t>(lane) * (r.stride / r.unit);
  }
  Row At(int c) const {
    const Run& r = RunOf(c);
    return {r.type, OffsetIn(r, c), r.stride, r.first + (c - r.first) / r.unit * r.unit, r.stride == 0};
  }
  int n_ = 0, k_ = 0;
  bool whole_blocks_ = true;
  bool panel_minimum_ = false;  // a panel run's type has a minimum (its tiles read PanelRows' scaled sums)
  // Every byte is written by the constructor (rows copied, panels repacked), so the buffer is not zeroed
  // first: that memset was 19% of loading the MoE benchmark file.
  WeightsBuffer data_;
  std::vector<Run> runs_;
  std::vector<float> bias_;
};

}  // namespace qkv
