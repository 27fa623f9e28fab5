// The engine's own bf16 GEMM on AMX tiles, y[M, N] = x[M, K] · Wᵀ (+ b), for CPUs with AMX-BF16
// (Sapphire Rapids and later; kernels/cpu.h level `amx`).
//
// Why our own: oneDNN 2.6's AMX brgemm blocks K differently at different M (the M = 128 primitive of
// the 4,864-wide down projection sums in another order than M = 1), so row independence forced either
// 64-row tiles or the packed GEMM, and its M = 1 kernel decoded ~15% slower than the packed GEMM.
//
// Same bits whatever M: every output element is one chain of tdpbf16ps over the K chunks of 32 in order,
// started from a zeroed tile, then the bias is added. A tile row's result depends only on that row of A
// and the column of B (the instruction computes rows independently), so which M tile a row is in, how many
// M and N tiles a block covers, and what the other rows hold never enter. Activations are rounded to bf16
// (round to nearest even) when they are packed for the tiles, as oneDNN's bf16 path does.
//
// Layouts. Weights: [group of 2 panels of 16 columns][K chunk of 32][panel in the group][16 k-pairs][16
// columns][2], zero-padded to whole chunks: each B tile is 1 KiB of contiguous memory and a group's tiles
// are read in memory order (decode is one sequential stream). Activations, packed per call by PackRows:
// [M tile of 16 rows][K chunk][16 rows][32], zero rows past M.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kernels/weights_arena.h"

namespace qkv {

class AmxWeights {
 public:
  static constexpr int kPanel = 16, kChunk = 32, kTileRows = 16, kGroup = 2;
  // w: [n, k] row-major f32 (rounded to bf16); bias: n values or nullptr. The packed weights go into the
  // arena if there is one (huge pages, counted with the model's other GEMM weights), else operator new.
  AmxWeights(const float* w, const float* bias, int n, int k, std::shared_ptr<WeightsArena> arena = nullptr);
  int n() const { return n_; }
  int k() const { return k_; }
  int panels() const { return (n_ + kPanel - 1) / kPanel; }
  int groups() const { return (panels() + kGroup - 1) / kGroup; }
  int chunks() const { return (k_ + kChunk - 1) / kChunk; }
  size_t bytes() const { return w_.size() + bias_.size() * 4; }
  // The bf16 bits stored for column c and index kk of K (the layout above; 0 in the padding).
  uint16_t Weight(int c, int kk) const;
  const WeightsArena* arena() const { return w_.arena(); }
  // bf16 elements PackRows writes for m rows.
  static size_t PackedRowsSize(int m, int k) {
    return static_cast<size_t>((m + kTileRows - 1) / kTileRows) * ((k + kChunk - 1) / kChunk) * kTileRows * kChunk;
  }
  // Packs M tiles [tile0, tile1) of x (m rows, row stride ldx, k values) into the layout above.
  static void PackRows(const float* x, int ldx, int m, int k, int tile0, int tile1, uint16_t* out);
  // Columns of panel groups [group0, group1) (at most n) of m rows from rows packed by PackRows; y: row
  // stride ldy.
  void Compute(const uint16_t* rows, int m, int group0, int group1, float* y, int ldy) const;

 private:
  size_t TileOffset(int panel, int chunk) const;
  int n_, k_;
  const uint16_t* w() const { return reinterpret_cast<const uint16_t*>(w_.data()); }
  WeightsBuffer w_;          // bf16 [panel][chunk][16][16][2]
  std::vector<float> bias_;  // padded to whole panels, or empty
};

}  // namespace qkv
