#include "engine/kernels/packed_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "engine/bf16.h"
#include "engine/kernels/cpu.h"

namespace qkv {
namespace {

constexpr int P = PackedWeights::kPanel;
// AVX2 decode tiles (one or two rows) are bound by reading the weights, up to 4 panels side by side: 4
// streams of K × 32 (bf16) or × 64 (f32) bytes, some KiB to some tens of KiB each, which the hardware
// prefetcher alone follows at ~80% of the bandwidth on a Zen 5. Each such tile asks for every panel's line
// Ahead(NP) bytes on as it reads one (8 KiB ahead in all, at most 4 KiB per stream; 4 and 16 KiB in all
// measured slower): bf16 MoE decode at the avx2 level +8-17% (docs/performance.md). The asks go into L2 (T1),
// as the bf16 form's and the quantized tiles' do: into L1 (T0) they took the miss buffers the tile's own loads
// wait on, and on a Zen 4 (2 vCPUs) bf16 MoE decode at the avx2 level ran at a median ~81% of the roofline
// against ~88% into L2 (dense ~88% both; 2 KiB in all measured the same as 8, within the noise). The AVX-512 FMA
// tiles (8 panels of 64 bytes a step) measured 2-6% slower with the same asking, so they do without. Past a
// panel's end the line is the next panel's, read next or by the next tile; prefetches never fault.
constexpr size_t Ahead(int np) { return std::min<size_t>(4096, 8192 / np); }
template <int MR, int NP>
inline void PrefetchPanels(const void* w, size_t pstride_bytes) {
  if constexpr (MR <= 2) {
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) _mm_prefetch(static_cast<const char*>(w) + j * pstride_bytes + Ahead(NP), _MM_HINT_T1);
  }
}

// Columns 0..7 and 8..15 of one panel row.
inline void LoadRow(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void LoadRow(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                                  // even slots: 0..7
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));  // odd slots: 8..15
}

// MR rows × NP panels. Each accumulator lane is one output's FMA chain over k in order. The loops over
// rows and panels are unrolled so the accumulators live in registers; y gets whole panels (ldy apart).
template <typename W, int MR, int NP>
void Tile(const float* __restrict x, int ldx, const W* __restrict w, size_t pstride, int K,
          const float* __restrict bias, float* __restrict y, int ldy) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  for (int k = 0; k < K; ++k) {
    if ((k * sizeof(W) * P) % 64 == 0) PrefetchPanels<MR, NP>(w + static_cast<size_t>(k) * P, pstride * sizeof(W));
    __m256 lo[NP], hi[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) LoadRow(w + j * pstride + static_cast<size_t>(k) * P, lo[j], hi[j]);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + static_cast<size_t>(r) * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) {
        acc[r][j][0] = _mm256_fmadd_ps(xb, lo[j], acc[r][j][0]);
        acc[r][j][1] = _mm256_fmadd_ps(xb, hi[j], acc[r][j][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      __m256 a = acc[r][j][0], b = acc[r][j][1];
      if (bias) {
        a = _mm256_add_ps(a, _mm256_loadu_ps(bias + j * P));
        b = _mm256_add_ps(b, _mm256_loadu_ps(bias + j * P + 8));
      }
      _mm256_storeu_ps(y + static_cast<size_t>(r) * ldy + j * P, a);
      _mm256_storeu_ps(y + static_cast<size_t>(r) * ldy + j * P + 8, b);
    }
  }
}

template <typename W, typename X = float>
using TileFn = void (*)(const X*, int, const W*, size_t, int, const float*, float*, int);

// Widest panel group per row count that keeps the accumulators in 16 ymm registers.
constexpr int kMaxPanels[7] = {0, 4, 3, 2, 1, 1, 1};

template <typename W, int MR>
TileFn<W> PickNp(int np) {
  switch (np) {
    case 1: return Tile<W, MR, 1>;
    case 2:
      if constexpr (kMaxPanels[MR] >= 2) return Tile<W, MR, 2>;
      break;
    case 3:
      if constexpr (kMaxPanels[MR] >= 3) return Tile<W, MR, 3>;
      break;
    case 4:
      if constexpr (kMaxPanels[MR] >= 4) return Tile<W, MR, 4>;
      break;
  }
  return Tile<W, MR, 1>;
}

template <typename W>
TileFn<W> Pick(int mr, int np) {
  switch (mr) {
    case 1: return PickNp<W, 1>(np);
    case 2: return PickNp<W, 2>(np);
    case 3: return PickNp<W, 3>(np);
    case 4: return PickNp<W, 4>(np);
    case 5: return PickNp<W, 5>(np);
    default: return PickNp<W, 6>(np);
  }
}

// The same GEMM on AVX-512 (kernels/cpu.h), same bits: a zmm holds a whole panel, so every lane is still
// one output's FMA chain over k in order from 0, then the bias. bf16 panel rows are widened with
// vpmovzxwd, which leaves the columns in slot order (0, 8, 1, 9, ...); the accumulators keep that order and
// are put back in column order once, at the store. 32 registers allow tiles up to 12 rows × 2 panels.
QKV_AVX512 inline __m512 LoadPanel(const float* p) { return _mm512_loadu_ps(p); }
QKV_AVX512 inline __m512 LoadPanel(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
// Accumulator lanes to columns: f32 panels are in column order already, bf16 ones in slot order.
QKV_AVX512 inline __m512 ToColumns(const float*, __m512 v) { return v; }
QKV_AVX512 inline __m512 ToColumns(const uint16_t*, __m512 v) {
  // (The maskz form: GCC 12 warns on the undefined pass-through of the unmasked one.)
  return _mm512_maskz_permutexvar_ps(0xFFFF, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15),
                                     v);
}

template <typename W, int MR, int NP>
QKV_AVX512 void Tile512(const float* __restrict x, int ldx, const W* __restrict w, size_t pstride, int K,
                        const float* __restrict bias, float* __restrict y, int ldy) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int k = 0; k < K; ++k) {
    __m512 wv[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) wv[j] = LoadPanel(w + j * pstride + static_cast<size_t>(k) * P);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[static_cast<size_t>(r) * ldx + k]);
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(xb, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      __m512 a = ToColumns(w, acc[r][j]);
      if (bias) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + j * P));
      _mm512_storeu_ps(y + static_cast<size_t>(r) * ldy + j * P, a);
    }
  }
}

// Decode tiles of the bf16 form ask for each panel's line kDotAhead bytes on, into L2 (T1): on a Zen 4 EPYC
// (2 vCPUs) bf16 decode then ran at a median 94% of qkv-bench's roofline against 88% without (dense) and 92%
// against 86% (MoE), six alternated pairs each (docs/performance.md, 2026-12-06). Into L1 (T0) the same
// asking measured 2-6% slower on a Zen 5; T1 there is not measured yet.
constexpr size_t kDotAhead = 1024;

// The bf16 form (packed_gemm.h): MR rows × NP panels; x holds each row's bf16 values (K even, rows ldx
// values apart), read as k-pairs of 32 bits; a panel row (one pair of k) is 16 columns' pairs in one zmm.
// Each accumulator lane is one output's chain of vdpbf16ps over the pairs in order.
template <int MR, int NP>
QKV_AVX512_BF16 void TileDot(const uint16_t* __restrict x, int ldx, const uint16_t* __restrict w, size_t pstride, int K,
                             const float* __restrict bias, float* __restrict y, int ldy) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int k = 0; k < K / 2; ++k) {
    if constexpr (MR <= 2) {
      // Each panel's line 1 KiB on, into L2 (see kDotAhead).
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * pstride + static_cast<size_t>(k) * 2 * P) + kDotAhead,
                     _MM_HINT_T1);
    }
    __m512bh wv[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * pstride + static_cast<size_t>(k) * 2 * P);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int pair;  // values 2k and 2k + 1 of row r
      std::memcpy(&pair, x + static_cast<size_t>(r) * ldx + 2 * k, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      __m512 a = acc[r][j];
      if (bias) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + j * P));
      _mm512_storeu_ps(y + static_cast<size_t>(r) * ldy + j * P, a);
    }
  }
}

// Widest panel group per row count (up to 12) that keeps the accumulators, the panel loads and the
// broadcast in 32 zmm registers.
constexpr int kMaxRows512 = 12;
constexpr int kMaxPanels512[kMaxRows512 + 1] = {0, 8, 8, 6, 5, 4, 3, 3, 3, 2, 2, 2, 2};

// The AVX-512 microkernels as a family: K::Fn<MR, NP> (Tile512 on weights W, or TileDot).
template <typename W>
struct Fma512 {
  template <int MR, int NP>
  static constexpr TileFn<W> Fn = Tile512<W, MR, NP>;
};
struct Dot512 {
  template <int MR, int NP>
  static constexpr TileFn<uint16_t, uint16_t> Fn = TileDot<MR, NP>;
};

template <class K, int MR>
auto PickNp512(int np) {
  switch (std::min(np, kMaxPanels512[MR])) {
    case 2:
      if constexpr (kMaxPanels512[MR] >= 2) return K::template Fn<MR, 2>;
      break;
    case 3:
      if constexpr (kMaxPanels512[MR] >= 3) return K::template Fn<MR, 3>;
      break;
    case 4:
      if constexpr (kMaxPanels512[MR] >= 4) return K::template Fn<MR, 4>;
      break;
    case 5:
      if constexpr (kMaxPanels512[MR] >= 5) return K::template Fn<MR, 5>;
      break;
    case 6:
      if constexpr (kMaxPanels512[MR] >= 6) return K::template Fn<MR, 6>;
      break;
    case 8:
      if constexpr (kMaxPanels512[MR] >= 8) return K::template Fn<MR, 8>;
      break;
  }
  return K::template Fn<MR, 1>;
}

template <class K>
auto Pick512(int mr, int np) {
  switch (mr) {
    case 1: return PickNp512<K, 1>(np);
    case 2: return PickNp512<K, 2>(np);
    case 3: return PickNp512<K, 3>(np);
    case 4: return PickNp512<K, 4>(np);
    case 5: return PickNp512<K, 5>(np);
    case 6: return PickNp512<K, 6>(np);
    case 7: return PickNp512<K, 7>(np);
    case 8: return PickNp512<K, 8>(np);
    case 9: return PickNp512<K, 9>(np);
    case 10: return PickNp512<K, 10>(np);
    case 11: return PickNp512<K, 11>(np);
    default: return PickNp512<K, 12>(np);
  }
}

// A level's tile set: the tallest tile, the panels a prefill tile spans, the widest tile per row count, and
// the picker.
struct Avx2Tiles {
  static constexpr int kMaxRows = 6, kPrefillPanels = 1;
  static int Panels(int mr, int left) { return std::min(kMaxPanels[mr], left); }
  template <typename W>
  static TileFn<W> Get(int mr, int np) {
    return Pick<W>(mr, np);
  }
};
struct Avx512Tiles {
  static constexpr int kMaxRows = kMaxRows512, kPrefillPanels = 2;
  static int Panels(int mr, int left) {
    const int np = std::min(kMaxPanels512[mr], left);
    return np == 7 ? 6 : np;  // no 7-panel tile
  }
  template <typename W>
  static TileFn<W> Get(int mr, int np) {
    return Pick512<Fma512<W>>(mr, np);
  }
};
// The bf16 form's: Avx512Tiles' shapes, on TileDot (x as bf16).
struct Avx512DotTiles : Avx512Tiles {
  template <typename W>
  static TileFn<uint16_t, uint16_t> Get(int mr, int np) {
    return Pick512<Dot512>(mr, np);
  }
};

template <class Tiles, typename W, typename X = float>
void Run(const W* packed, const float* bias, int n, int K, const X* x, int ldx, int m, int p0, int p1, float* y,
         int ldy) {
  const size_t pstride = static_cast<size_t>(K) * P;
  auto tile = [&](int r, int mr, int p, int np) {
    const int col0 = p * P;
    const int ncols = std::min(np * P, n - col0);
    const X* xr = x + static_cast<size_t>(r) * ldx;
    const float* b = bias ? bias + col0 : nullptr;
    float* yr = y + static_cast<size_t>(r) * ldy + col0;
    if (ncols == np * P) {
      Tiles::template Get<W>(mr, np)(xr, ldx, packed + p * pstride, pstride, K, b, yr, ldy);
      return;
    }
    // The last panel is partial: through a buffer, then the valid columns.
    alignas(64) float tmp[Tiles::kMaxRows * 8 * P];
    Tiles::template Get<W>(mr, np)(xr, ldx, packed + p * pstride, pstride, K, b, tmp, np * P);
    for (int i = 0; i < mr; ++i)
      std::memcpy(yr + static_cast<size_t>(i) * ldy, tmp + i * np * P, sizeof(float) * ncols);
  };
  if (m <= Tiles::kMaxRows) {
    // Decode and small batches: one row block, several panels side by side to hide the FMA latency.
    for (int p = p0; p < p1;) {
      const int np = Tiles::Panels(m, p1 - p);
      tile(0, m, p, np);
      p += np;
    }
    return;
  }
  // Prefill: a panel group (K × 16 or K × 32 weights, in L1/L2) against every row block of x.
  for (int p = p0; p < p1;) {
    const int np = std::min(Tiles::kPrefillPanels, p1 - p);
    for (int r = 0; r < m; r += Tiles::kMaxRows) tile(r, std::min(Tiles::kMaxRows, m - r), p, np);
    p += np;
  }
}

}  // namespace

KernelIsa PackedWeights::Level() {
  return ActiveKernelIsa() >= KernelIsa::kAvx512 ? KernelIsa::kAvx512 : KernelIsa::kAvx2;
}

PackedWeights::PackedWeights(const float* w, const float* bias, int n, int k, bool bf16,
                             std::shared_ptr<WeightsArena> arena, bool dot)
    : n_(n), k_(k), bf16_(bf16), dot_(dot && bf16 && CpuKernelIsa() >= KernelIsa::kAvx512Bf16) {
  const int kp = dot_ ? (k + 1) / 2 * 2 : k;  // the bf16 form pads K to whole pairs
  const size_t total = static_cast<size_t>(panels()) * kp * P;
  w_ = WeightsBuffer(std::move(arena), total * (bf16 ? 2 : 4));
  std::memset(w_.data(), 0, w_.size());  // columns past n in the last panel stay 0
  auto* const w16 = reinterpret_cast<uint16_t*>(w_.data());
  auto* const w32 = reinterpret_cast<float*>(w_.data());
  for (int c = 0; c < n; ++c) {
    const int p = c / P, i = c % P;
    // bf16 rows hold columns (0, 8), (1, 9), ... in adjacent slots (see LoadRow); the bf16 form holds
    // column i's k-pair in lane i.
    const int slot = bf16 ? (i < 8 ? 2 * i : 2 * (i - 8) + 1) : i;
    for (int kk = 0; kk < k; ++kk) {
      const size_t at = dot_ ? static_cast<size_t>(p) * kp * P + static_cast<size_t>(kk / 2) * 2 * P + 2 * i + kk % 2
                             : (static_cast<size_t>(p) * k + kk) * P + slot;
      const float v = w[static_cast<size_t>(c) * k + kk];
      if (bf16) {
        w16[at] = F32ToBf16(v);
      } else {
        w32[at] = v;
      }
    }
  }
  if (bias) {
    bias_.assign(static_cast<size_t>(panels()) * P, 0.0f);
    std::memcpy(bias_.data(), bias, sizeof(float) * n);
  }
}

void PackedWeights::Compute(const float* x, int ldx, int m, int panel0, int panel1, float* y, int ldy) const {
  if (m <= 0 || panel0 >= panel1) return;
  const float* b = bias_.empty() ? nullptr : bias_.data();
  if (dot_) {
    std::vector<uint16_t> rows(RoundedRowsSize(m));
    RoundRows(x, ldx, 0, m, rows.data());
    ComputeRounded(rows.data(), m, panel0, panel1, y, ldy);
    return;
  }
  const bool wide = Level() == KernelIsa::kAvx512;
  if (bf16_) {
    const auto* w = reinterpret_cast<const uint16_t*>(w_.data());
    (wide ? Run<Avx512Tiles, uint16_t> : Run<Avx2Tiles, uint16_t>)(w, b, n_, k_, x, ldx, m, panel0, panel1, y, ldy);
  } else {
    const auto* w = reinterpret_cast<const float*>(w_.data());
    (wide ? Run<Avx512Tiles, float> : Run<Avx2Tiles, float>)(w, b, n_, k_, x, ldx, m, panel0, panel1, y, ldy);
  }
}

void PackedWeights::RoundRows(const float* x, int ldx, int r0, int r1, uint16_t* out) const {
  const size_t kp = RoundedRowsSize(1);
  for (int r = r0; r < r1; ++r) {
    uint16_t* row = out + static_cast<size_t>(r) * kp;
    F32ToBf16Bulk(x + static_cast<size_t>(r) * ldx, row, k_);
    if (kp > static_cast<size_t>(k_)) row[k_] = 0;
  }
}

void PackedWeights::ComputeRounded(const uint16_t* xb, int m, int panel0, int panel1, float* y, int ldy) const {
  if (m <= 0 || panel0 >= panel1) return;
  const int kp = static_cast<int>(RoundedRowsSize(1));
  Run<Avx512DotTiles>(reinterpret_cast<const uint16_t*>(w_.data()), bias_.empty() ? nullptr : bias_.data(), n_, kp, xb,
                      kp, m, panel0, panel1, y, ldy);
}

}  // namespace qkv
