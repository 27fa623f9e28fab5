// The vector pieces both attention kernels (kernels/attention.cc for GQA, kernels/mla_attention.cc for
// MLA) build on: loads of cached rows as f32 and the weighted sums o_h += Σ_j w_h[j] · row_j, at the AVX2
// level (8 lanes) and the AVX-512 ones (16 lanes). Internal to the kernels; not part of the engine's API.
//
// A weighted sum is, for every output element, one FMA chain over the rows in position order, whatever the
// number of heads, the tile and the lane width: so the 8- and 16-lane versions give the same bits.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "engine/kernels/cpu.h"

namespace qkv::kernels {

inline __m256 I8x8ToF32(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Loads of 8 (16) cached elements [i, i + 8) as f32: int8 values, or f32 / bf16 ones (bf16 → f32 is exact).
struct LoadI8x8 {
  const int8_t* v;
  __m256 operator()(size_t i) const { return I8x8ToF32(v + i); }
};
template <bool BF16>
struct LoadRow8 {
  const uint8_t* v;
  __m256 operator()(size_t i) const {
    if constexpr (BF16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(v) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(v) + i);
    }
  }
};
struct LoadI8x16 {
  const int8_t* v;
  QKV_AVX512 __m512 operator()(size_t i) const {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i))));
  }
};
template <bool BF16>
struct LoadRow16 {
  const uint8_t* v;
  QKV_AVX512 __m512 operator()(size_t i) const {
    if constexpr (BF16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(v) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(v) + i);
    }
  }
};

// o_h[d] += Σ_j w_h[j] · row_j[d] for NH heads over nj rows, dims [d_begin, d_end) in steps of 8·ND
// (d_end − d_begin a multiple of 8·ND); load(i) gives the elements [i, i + 8), row j starting at
// j · stride. Each row chunk is loaded once in registers and shared by the heads.
template <int NH, int ND, class Load>
inline void WeightedSumTile8(const float* const* w, const Load& load, int nj, size_t stride, int d_begin, int d_end,
                             float* const* o) {
  for (int d0 = d_begin; d0 < d_end; d0 += 8 * ND) {
    __m256 acc[NH][ND];
    for (int h = 0; h < NH; ++h)
      for (int n = 0; n < ND; ++n) acc[h][n] = _mm256_loadu_ps(o[h] + d0 + 8 * n);
    for (int j = 0; j < nj; ++j) {
      __m256 vf[ND];
      for (int n = 0; n < ND; ++n) vf[n] = load(static_cast<size_t>(j) * stride + d0 + 8 * n);
      for (int h = 0; h < NH; ++h) {
        const __m256 wb = _mm256_broadcast_ss(w[h] + j);
        for (int n = 0; n < ND; ++n) acc[h][n] = _mm256_fmadd_ps(wb, vf[n], acc[h][n]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int n = 0; n < ND; ++n) _mm256_storeu_ps(o[h] + d0 + 8 * n, acc[h][n]);
  }
}

// WeightedSumTile8 with 16 lanes (steps of 16·ND; up to 16 accumulators of the 32 zmm registers).
template <int NH, int ND, class Load>
QKV_AVX512 inline void WeightedSumTile16(const float* const* w, const Load& load, int nj, size_t stride, int d_begin,
                                         int d_end, float* const* o) {
  for (int d0 = d_begin; d0 < d_end; d0 += 16 * ND) {
    __m512 acc[NH][ND];
    for (int h = 0; h < NH; ++h)
      for (int n = 0; n < ND; ++n) acc[h][n] = _mm512_loadu_ps(o[h] + d0 + 16 * n);
    for (int j = 0; j < nj; ++j) {
      __m512 vf[ND];
      for (int n = 0; n < ND; ++n) vf[n] = load(static_cast<size_t>(j) * stride + d0 + 16 * n);
      for (int h = 0; h < NH; ++h) {
        const __m512 wb = _mm512_set1_ps(w[h][j]);
        for (int n = 0; n < ND; ++n) acc[h][n] = _mm512_fmadd_ps(wb, vf[n], acc[h][n]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int n = 0; n < ND; ++n) _mm512_storeu_ps(o[h] + d0 + 16 * n, acc[h][n]);
  }
}

}  // namespace qkv::kernels
