#include "engine/kernels/packed_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "engine/bf16.h"

namespace qkv {
namespace {

constexpr int P = PackedWeights::kPanel;

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

template <typename W>
using TileFn = void (*)(const float*, int, const W*, size_t, int, const float*, float*, int);

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

template <typename W>
void Run(const W* packed, const float* bias, int n, int K, const float* x, int ldx, int m, int p0, int p1, float* y,
         int ldy) {
  const size_t pstride = static_cast<size_t>(K) * P;
  auto tile = [&](int r, int mr, int p, int np) {
    const int col0 = p * P;
    const int ncols = std::min(np * P, n - col0);
    const float* xr = x + static_cast<size_t>(r) * ldx;
    const float* b = bias ? bias + col0 : nullptr;
    float* yr = y + static_cast<size_t>(r) * ldy + col0;
    if (ncols == np * P) {
      Pick<W>(mr, np)(xr, ldx, packed + p * pstride, pstride, K, b, yr, ldy);
      return;
    }
    // The last panel is partial: through a buffer, then the valid columns.
    alignas(32) float tmp[6 * 4 * P];
    Pick<W>(mr, np)(xr, ldx, packed + p * pstride, pstride, K, b, tmp, np * P);
    for (int i = 0; i < mr; ++i)
      std::memcpy(yr + static_cast<size_t>(i) * ldy, tmp + i * np * P, sizeof(float) * ncols);
  };
  if (m <= 6) {
    // Decode: one row block, several panels side by side to hide the FMA latency.
    for (int p = p0; p < p1;) {
      const int np = std::min(kMaxPanels[m], p1 - p);
      tile(0, m, p, np);
      p += np;
    }
    return;
  }
  // Prefill: one panel (K x 16 weights, in L1/L2) against every 6-row block of x.
  for (int p = p0; p < p1; ++p) {
    for (int r = 0; r < m; r += 6) tile(r, std::min(6, m - r), p, 1);
  }
}

}  // namespace

PackedWeights::PackedWeights(const float* w, const float* bias, int n, int k, bool bf16) : n_(n), k_(k) {
  const size_t total = static_cast<size_t>(panels()) * k * P;
  if (bf16) {
    bf16_.assign(total, 0);
  } else {
    f32_.assign(total, 0.0f);
  }
  for (int c = 0; c < n; ++c) {
    const int p = c / P, i = c % P;
    // bf16 rows hold columns (0, 8), (1, 9), ... in adjacent slots (see LoadRow).
    const int slot = bf16 ? (i < 8 ? 2 * i : 2 * (i - 8) + 1) : i;
    for (int kk = 0; kk < k; ++kk) {
      const size_t at = (static_cast<size_t>(p) * k + kk) * P + slot;
      const float v = w[static_cast<size_t>(c) * k + kk];
      if (bf16) {
        bf16_[at] = F32ToBf16(v);
      } else {
        f32_[at] = v;
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
  if (!bf16_.empty()) {
    Run(bf16_.data(), b, n_, k_, x, ldx, m, panel0, panel1, y, ldy);
  } else {
    Run(f32_.data(), b, n_, k_, x, ldx, m, panel0, panel1, y, ldy);
  }
}

}  // namespace qkv
