#include "engine/kernels/quant_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

#include "engine/kernels/cpu.h"
#include "engine/kernels/quant_panel.h"

namespace qkv {
namespace {

// Per type: Prepare decodes a block's (or super-block's) scales and offsets per 16 values; Q gives its
// 32-value group j as int8 lanes in value order. Both follow DecodeRowI8 (quant.cc) exactly.
inline float F16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline __m256i Load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i Load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
// 16 bytes → 32 nibbles: the low nibbles are values 0-15, the high ones 16-31.
inline __m256i Nibbles(const uint8_t* p) {
  const __m128i v = Load128(p), m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
// Byte i of the result is 0x10 when bit i of the 32 bits at p is set, else 0.
inline __m256i Bits16(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i rep =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)),
                          _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit), _mm256_set1_epi8(0x10));
}
inline __m256i Iq4(__m256i idx) {
  const __m256i book = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
  return _mm256_shuffle_epi8(book, idx);
}
inline __m256i Lo4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i Hi4(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
// Bits (2 × s, 2 × s + 1) of each byte.
inline __m256i Crumb(__m256i v, int s) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
}

struct DecQ8_0 {
  static constexpr int kValues = 32, kBytes = 34;
  static constexpr bool kPer32 = true;
  static void Prepare(const uint8_t* b, float* sc, float* off) {
    sc[0] = sc[1] = F16(b);
    off[0] = off[1] = 0;
  }
  static __m256i Q(const uint8_t* b, int) { return Load256(b + 2); }
};
struct DecQ4_0 {
  static constexpr int kValues = 32, kBytes = 18;
  static constexpr bool kPer32 = true;
  static void Prepare(const uint8_t* b, float* sc, float* off) { DecQ8_0::Prepare(b, sc, off); }
  static __m256i Q(const uint8_t* b, int) { return _mm256_sub_epi8(Nibbles(b + 2), _mm256_set1_epi8(8)); }
};
struct DecIq4Nl {
  static constexpr int kValues = 32, kBytes = 18;
  static constexpr bool kPer32 = true;
  static void Prepare(const uint8_t* b, float* sc, float* off) { DecQ8_0::Prepare(b, sc, off); }
  static __m256i Q(const uint8_t* b, int) { return Iq4(Nibbles(b + 2)); }
};
struct DecQ4_1 {
  static constexpr int kValues = 32, kBytes = 20;
  static constexpr bool kPer32 = true;
  static void Prepare(const uint8_t* b, float* sc, float* off) {
    sc[0] = sc[1] = F16(b);
    off[0] = off[1] = -F16(b + 2);
  }
  static __m256i Q(const uint8_t* b, int) { return Nibbles(b + 4); }
};
struct DecQ5_0 {
  static constexpr int kValues = 32, kBytes = 22;
  static constexpr bool kPer32 = true;
  static void Prepare(const uint8_t* b, float* sc, float* off) { DecQ8_0::Prepare(b, sc, off); }
  static __m256i Q(const uint8_t* b, int) {
    return _mm256_sub_epi8(_mm256_or_si256(Nibbles(b + 6), Bits16(b + 2)), _mm256_set1_epi8(16));
  }
};
struct DecQ5_1 {
  static constexpr int kValues = 32, kBytes = 24;
  static constexpr bool kPer32 = true;
  static void Prepare(const uint8_t* b, float* sc, float* off) { DecQ4_1::Prepare(b, sc, off); }
  static __m256i Q(const uint8_t* b, int) { return _mm256_or_si256(Nibbles(b + 8), Bits16(b + 4)); }
};
struct DecQ2_K {
  static constexpr int kValues = 256, kBytes = 84;
  static constexpr bool kPer32 = false;
  static void Prepare(const uint8_t* b, float* sc, float* off) {
    const float d = F16(b + 80), dmin = F16(b + 82);
    for (int g = 0; g < 16; ++g) {
      sc[g] = d * static_cast<float>(b[g] & 0x0F);
      off[g] = dmin * static_cast<float>(b[g] >> 4);
    }
  }
  static __m256i Q(const uint8_t* b, int j) { return Crumb(Load256(b + 16 + (j / 4) * 32), j % 4); }
};
struct DecQ3_K {
  static constexpr int kValues = 256, kBytes = 110;
  static constexpr bool kPer32 = false;
  static void Prepare(const uint8_t* b, float* sc, float* off) {
    const float d = F16(b + 108);
    const uint8_t* s = b + 96;
    for (int g = 0; g < 16; ++g) {
      const int lo = g < 8 ? (s[g] & 0x0F) : (s[g - 8] >> 4);
      const int hi = (s[8 + (g % 4)] >> (2 * (g / 4))) & 3;
      sc[g] = d * static_cast<float>((lo | (hi << 4)) - 32);
      off[g] = 0;
    }
  }
  static __m256i Q(const uint8_t* b, int j) {
    const __m256i lo = Crumb(Load256(b + 32 + (j / 4) * 32), j % 4);
    const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(Load256(b), _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
    // lo − 4 where the high bit is clear: lo + 4·hb − 4
    return _mm256_sub_epi8(_mm256_add_epi8(lo, _mm256_slli_epi16(hb, 2)), _mm256_set1_epi8(4));
  }
};
template <bool kFive>
struct DecQ45_K {
  static constexpr int kValues = 256, kBytes = kFive ? 176 : 144;
  static constexpr bool kPer32 = true;
  // The eight 6-bit scales and mins, four bytes at a time (the layout is ScaleMinK4's in quant.cc).
  static void Prepare(const uint8_t* b, float* sc, float* off) {
    uint32_t u0, u1, u2;
    std::memcpy(&u0, b + 4, 4);
    std::memcpy(&u1, b + 8, 4);
    std::memcpy(&u2, b + 12, 4);
    const uint32_t sc_lo = u0 & 0x3F3F3F3Fu, m_lo = u1 & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u);
    const uint32_t m_hi = ((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u);
    const __m256 s8 = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), 0, 0)));
    const __m256 m8 =
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(m_lo), static_cast<int>(m_hi), 0, 0)));
    // Per 32 values: entries 2j and 2j + 1 of the per-16 arrays hold sub-block j's scale.
    const __m256 sd = _mm256_mul_ps(_mm256_set1_ps(F16(b)), s8), md = _mm256_mul_ps(_mm256_set1_ps(F16(b + 2)), m8);
    const __m256i dup_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
                  dup_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    _mm256_storeu_ps(sc, _mm256_permutevar8x32_ps(sd, dup_lo));
    _mm256_storeu_ps(sc + 8, _mm256_permutevar8x32_ps(sd, dup_hi));
    _mm256_storeu_ps(off, _mm256_permutevar8x32_ps(md, dup_lo));
    _mm256_storeu_ps(off + 8, _mm256_permutevar8x32_ps(md, dup_hi));
  }
  static __m256i Q(const uint8_t* b, int j) {
    const __m256i v = Load256(b + (kFive ? 48 : 16) + (j / 2) * 32);
    __m256i q = (j % 2) ? Hi4(v) : Lo4(v);
    if constexpr (kFive) {
      const __m256i h = _mm256_and_si256(_mm256_srl_epi16(Load256(b + 16), _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(h, 4));
    }
    return q;
  }
};
struct DecQ6_K {
  static constexpr int kValues = 256, kBytes = 210;
  static constexpr bool kPer32 = false;
  static void Prepare(const uint8_t* b, float* sc, float* off) {
    const float d = F16(b + 208);
    for (int g = 0; g < 16; ++g) {
      sc[g] = d * static_cast<float>(static_cast<int8_t>(b[192 + g]));
      off[g] = 0;
    }
  }
  static __m256i Q(const uint8_t* b, int j) {
    const int h = j / 4, s = j % 4;
    const __m256i l = Load256(b + h * 64 + (s & 1) * 32);
    const __m256i lo = (s >> 1) ? Hi4(l) : Lo4(l);
    const __m256i hi = Crumb(Load256(b + 128 + h * 32), s);
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
  }
};
struct DecIq4Xs {
  static constexpr int kValues = 256, kBytes = 136;
  static constexpr bool kPer32 = true;
  static void Prepare(const uint8_t* b, float* sc, float* off) {
    const float d = F16(b);
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    for (int g = 0; g < 8; ++g) {
      const int lo = (b[4 + g / 2] >> (4 * (g % 2))) & 0x0F, hi = (sh >> (2 * g)) & 3;
      sc[2 * g] = sc[2 * g + 1] = d * static_cast<float>((lo | (hi << 4)) - 32);
      off[2 * g] = off[2 * g + 1] = 0;
    }
  }
  static __m256i Q(const uint8_t* b, int j) { return Iq4(Nibbles(b + 8 + 16 * j)); }
};

// Lanes added in a fixed order.
inline float HSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// R activation rows against C weight rows, decoded block by block in registers. Each output (row, column)
// has its own accumulator and runs the same operations in the same order whatever R and C are, so the
// tile shape (chosen from M) never changes a bit; it only decides how many independent chains and
// memory streams run side by side.
constexpr int kPrefetch = 384;  // bytes ahead in the weight row (measured: 384-768 best on an AVX2 EPYC)

// Where rows r0 .. r0 + R − 1 of the quantized activations start: values, per-32 scales, per-4 sums.
template <int R>
struct RowPtrs {
  const int8_t* q[R];
  const float* scale[R];
  const float* sum4[R];
  RowPtrs(const QuantizedRowSet& a, int r0) {
    for (int r = 0; r < R; ++r) {
      const size_t row = a.row(r0 + r), k = static_cast<size_t>(a.src->k);
      q[r] = a.src->q.data() + row * k;
      scale[r] = a.src->scale.data() + row * (k / 32);
      sum4[r] = a.src->sum4.data() + row * (k / 4);
    }
  }
};

// Super-block sb of C weight rows: its address per row (prefetched ahead) and its scales and offsets.
template <class D, int C>
inline void PrepareBlocks(const uint8_t* const* w, size_t stride, int sb, const uint8_t** blk, float (*sc16)[16],
                          float (*off16)[16]) {
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    blk[c] = w[c] + static_cast<size_t>(sb) * stride;
    _mm_prefetch(reinterpret_cast<const char*>(blk[c]) + kPrefetch, _MM_HINT_T0);
    D::Prepare(blk[c], sc16[c], off16[c]);
  }
}

template <class D, int R, int C, bool kOff>
void DotTile(const uint8_t* const* w, size_t stride, int k, const QuantizedRowSet& a, int r0, float* out, int ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const RowPtrs<R> rows(a, r0);
  constexpr int G = D::kValues / 32;
  float sc16[C][16], off16[C][16];
  for (int sb = 0; sb < k / D::kValues; ++sb) {
    const uint8_t* blk[C];
    PrepareBlocks<D, C>(w, stride, sb, blk, sc16, off16);
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      const int b = sb * G + j;
      __m256i av[R];
      __m256 asv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        av[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.q[r] + 32 * b));
        asv[r] = _mm256_broadcast_ss(rows.scale[r] + b);
      }
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256i wv = D::Q(blk[c], j);
        const __m256i wabs = _mm256_sign_epi8(wv, wv);
        // One scale (and offset) per 32 values, or one per 16 (lanes 0-3 and 4-7). The lanes' values are
        // the same either way: scale × activation scale, rounded once.
        __m256 sc, off;
        if constexpr (D::kPer32) {
          sc = _mm256_set1_ps(sc16[c][2 * j]);
          if constexpr (kOff) off = _mm256_set1_ps(off16[c][2 * j]);
        } else {
          sc = _mm256_set_m128(_mm_set1_ps(sc16[c][2 * j + 1]), _mm_set1_ps(sc16[c][2 * j]));
          if constexpr (kOff) off = _mm256_set_m128(_mm_set1_ps(off16[c][2 * j + 1]), _mm_set1_ps(off16[c][2 * j]));
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(av[r], wv));
          const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
          acc[r][c] = _mm256_fmadd_ps(p, _mm256_mul_ps(sc, asv[r]), acc[r][c]);
          if constexpr (kOff) acc[r][c] = _mm256_fnmadd_ps(off, _mm256_loadu_ps(rows.sum4[r] + 8 * b), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = HSum(acc[r][c]);
}

// The same tile on AVX-512 VNNI, same bits: a zmm holds the 8 lanes of two columns (c, c + 1) side by
// side, and vpdpbusd gives each lane the exact int32 sum of its 4 products, as maddubs + madd does on AVX2.
// vpdpbusd multiplies unsigned by signed bytes, so the weights go in offset by 128 (w ^ 0x80 = w + 128) and
// the accumulator starts at −128 × (the 4 activations' sum), computed once per row and block. Every lane
// then runs the AVX2 kernel's float operations in the same order, and each half is summed by HSum.
// A column pair's 32-value groups j as one zmm of unsigned bytes, offset by 128 (the weight w is w + 128).
// The 4-, 5- and 6-bit types decode both columns in one 512-bit pass (fifth bits through a 64-bit mask);
// the others (Q8_0, Q2_K, Q3_K) pair the AVX2 decoders' ymm.
QKV_AVX512_VNNI inline __m512i NibblePair(const uint8_t* p0, const uint8_t* p1) {
  // [p0 | p1] → [p0 | p1 | p0 >> 4 | p1 >> 4] → low nibbles → [p0 lo, p0 hi, p1 lo, p1 hi] (value order).
  const __m256i x = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p1), reinterpret_cast<const __m128i*>(p0));
  const __m512i z = _mm512_inserti64x4(_mm512_zextsi256_si512(x), _mm256_srli_epi16(x, 4), 1);
  const __m512i n = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
  return _mm512_maskz_permutexvar_epi64(0xFF, _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), n);
}
// The fifth bits of two 32-value blocks (32 bits at p0, 32 at p1, bit i = value i) as bytes 0x10 or 0.
QKV_AVX512_VNNI inline __m512i HighBitPair(const uint8_t* p0, const uint8_t* p1) {
  uint32_t lo, hi;
  std::memcpy(&lo, p0, 4);
  std::memcpy(&hi, p1, 4);
  return _mm512_maskz_mov_epi8(static_cast<__mmask64>(lo) | (static_cast<__mmask64>(hi) << 32), _mm512_set1_epi8(0x10));
}
// Per-16 scales of a column pair: [p0[0] × 4, p0[1] × 4, p1[0] × 4, p1[1] × 4] (two 8-byte loads, one permute).
QKV_AVX512_VNNI inline __m512 Per16Pair(const float* p0, const float* p1) {
  double d0, d1;
  std::memcpy(&d0, p0, 8);
  std::memcpy(&d1, p1, 8);
  const __m512 v = _mm512_zextps128_ps512(_mm_castpd_ps(_mm_setr_pd(d0, d1)));
  return _mm512_maskz_permutexvar_ps(0xFFFF, _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), v);
}
// The IQ4 codebook plus 128, for vpshufb in each 128-bit lane.
QKV_AVX512_VNNI inline __m512i Iq4Pair(__m512i idx) {
  const __m512i book = _mm512_broadcast_i32x4(
      _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, static_cast<char>(129), static_cast<char>(141),
                    static_cast<char>(153), static_cast<char>(166), static_cast<char>(181), static_cast<char>(197),
                    static_cast<char>(217), static_cast<char>(241)));
  return _mm512_shuffle_epi8(book, idx);
}
template <class D>
QKV_AVX512_VNNI inline __m512i WeightPair(const uint8_t* b0, const uint8_t* b1, int j) {
  if constexpr (std::is_same_v<D, DecQ4_0>) {
    return _mm512_add_epi8(NibblePair(b0 + 2, b1 + 2), _mm512_set1_epi8(120));  // (q − 8) + 128
  } else if constexpr (std::is_same_v<D, DecIq4Nl>) {
    return Iq4Pair(NibblePair(b0 + 2, b1 + 2));
  } else if constexpr (std::is_same_v<D, DecIq4Xs>) {
    return Iq4Pair(NibblePair(b0 + 8 + 16 * j, b1 + 8 + 16 * j));
  } else if constexpr (std::is_same_v<D, DecQ4_1>) {
    return _mm512_or_si512(NibblePair(b0 + 4, b1 + 4), _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128
  } else if constexpr (std::is_same_v<D, DecQ5_0>) {
    return _mm512_add_epi8(_mm512_or_si512(NibblePair(b0 + 6, b1 + 6), HighBitPair(b0 + 2, b1 + 2)),
                           _mm512_set1_epi8(112));  // (q − 16) + 128
  } else if constexpr (std::is_same_v<D, DecQ5_1>) {
    return _mm512_or_si512(_mm512_or_si512(NibblePair(b0 + 8, b1 + 8), HighBitPair(b0 + 4, b1 + 4)),
                           _mm512_set1_epi8(static_cast<char>(0x80)));
  } else if constexpr (std::is_same_v<D, DecQ45_K<true>>) {
    const size_t at = 48 + static_cast<size_t>(j / 2) * 32;
    const __m512i v = _mm512_inserti64x4(_mm512_zextsi256_si512(Load256(b0 + at)), Load256(b1 + at), 1);
    const __m512i q = _mm512_and_si512((j % 2) ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
    const __m512i qh = _mm512_inserti64x4(_mm512_zextsi256_si512(Load256(b0 + 16)), Load256(b1 + 16), 1);
    const __mmask64 hb = _mm512_test_epi8_mask(qh, _mm512_set1_epi8(static_cast<char>(1 << j)));
    return _mm512_or_si512(_mm512_or_si512(q, _mm512_maskz_mov_epi8(hb, _mm512_set1_epi8(0x10))),
                           _mm512_set1_epi8(static_cast<char>(0x80)));
  } else if constexpr (std::is_same_v<D, DecQ6_K>) {
    const int h = j / 4, sh = j % 4;
    const size_t at = static_cast<size_t>(h) * 64 + (sh & 1) * 32, hat = 128 + static_cast<size_t>(h) * 32;
    const __m512i l = _mm512_inserti64x4(_mm512_zextsi256_si512(Load256(b0 + at)), Load256(b1 + at), 1);
    const __m512i lo = _mm512_and_si512((sh >> 1) ? _mm512_srli_epi16(l, 4) : l, _mm512_set1_epi8(0x0F));
    const __m512i qh = _mm512_inserti64x4(_mm512_zextsi256_si512(Load256(b0 + hat)), Load256(b1 + hat), 1);
    const __m512i hi = _mm512_and_si512(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(2 * sh)), _mm512_set1_epi8(3));
    return _mm512_add_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)), _mm512_set1_epi8(96));  // (q − 32) + 128
  } else if constexpr (std::is_same_v<D, DecQ45_K<false>>) {
    const size_t at = 16 + static_cast<size_t>(j / 2) * 32;
    const __m512i v = _mm512_inserti64x4(_mm512_zextsi256_si512(Load256(b0 + at)), Load256(b1 + at), 1);
    const __m512i q = (j % 2) ? _mm512_srli_epi16(v, 4) : v;
    return _mm512_or_si512(_mm512_and_si512(q, _mm512_set1_epi8(0x0F)), _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_zextsi256_si512(D::Q(b0, j)), D::Q(b1, j), 1),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  }
}

template <class D, int R, int CP, bool kOff>
QKV_AVX512_VNNI void DotTile512(const uint8_t* const* w, size_t stride, int k, const QuantizedRowSet& a, int r0,
                                float* out, int ldo) {
  constexpr int C = 2 * CP;
  const __m512i k80 = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][CP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < CP; ++p) acc[r][p] = _mm512_setzero_ps();
  const RowPtrs<R> rows(a, r0);
  constexpr int G = D::kValues / 32;
  float sc16[C][16], off16[C][16];
  for (int sb = 0; sb < k / D::kValues; ++sb) {
    const uint8_t* blk[C];
    PrepareBlocks<D, C>(w, stride, sb, blk, sc16, off16);
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      const int b = sb * G + j;
      __m512i av[R], corr[R];
      __m512 asv[R], a4v[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        av[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.q[r] + 32 * b)));
        corr[r] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), k80, av[r]));
        asv[r] = _mm512_set1_ps(rows.scale[r][b]);
        if constexpr (kOff) a4v[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(rows.sum4[r] + 8 * b));
      }
#pragma GCC unroll 4
      for (int p = 0; p < CP; ++p) {
        const int c0 = 2 * p, c1 = 2 * p + 1;
        const __m512i wv = WeightPair<D>(blk[c0], blk[c1], j);
        __m512 sc, off;
        if constexpr (D::kPer32) {
          sc = _mm512_insertf32x8(_mm512_zextps256_ps512(_mm256_set1_ps(sc16[c0][2 * j])),
                                  _mm256_set1_ps(sc16[c1][2 * j]), 1);
          if constexpr (kOff)
            off = _mm512_insertf32x8(_mm512_zextps256_ps512(_mm256_set1_ps(off16[c0][2 * j])),
                                     _mm256_set1_ps(off16[c1][2 * j]), 1);
        } else {
          sc = Per16Pair(&sc16[c0][2 * j], &sc16[c1][2 * j]);
          if constexpr (kOff) off = Per16Pair(&off16[c0][2 * j], &off16[c1][2 * j]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512 prod = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr[r], wv, av[r]));
          acc[r][p] = _mm512_fmadd_ps(prod, _mm512_mul_ps(sc, asv[r]), acc[r][p]);
          if constexpr (kOff) acc[r][p] = _mm512_fnmadd_ps(off, a4v[r], acc[r][p]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < CP; ++p) {
      out[r * ldo + 2 * p] = HSum(_mm512_extractf32x8_ps(acc[r][p], 0));
      out[r * ldo + 2 * p + 1] = HSum(_mm512_extractf32x8_ps(acc[r][p], 1));
    }
  }
}

// All rows of `a` against C weight rows of type D; out is [a.m][ldo].
template <class D, int C, bool kOff>
void DotCols(const uint8_t* const* w, size_t stride, int k, const QuantizedRowSet& a, float* out, int ldo) {
  int r = 0;
  if constexpr (C <= 2) {
    for (; r + 4 <= a.m; r += 4) DotTile<D, 4, C, kOff>(w, stride, k, a, r, out + r * ldo, ldo);
  }
  for (; r < a.m; ++r) DotTile<D, 1, C, kOff>(w, stride, k, a, r, out + r * ldo, ldo);
}

// n weight rows of one type whose blocks lie `stride` bytes apart. For fewer than 4 activation rows
// (decode), kInterleave (4) interleaved rows at a time: their blocks alternate in memory, so the 4 rows
// are one sequential stream and 4 independent chains. Rows stored one after another go one at a time (a
// single stream reads fastest: 20-23 GB/s on 2 threads against 9-13 with 2 or 4 separate rows side by
// side; groups of 4 beat groups of 2 and 8; measured on an AVX2 EPYC). For 4 or more, 2 columns × 4 rows.
template <class D, bool kOff>
void DotType(const uint8_t* const* w, size_t stride, int n, int k, const QuantizedRowSet& a, float* out, int ldo) {
  int c = 0;
  if (a.m < 4) {
    if (stride == static_cast<size_t>(kInterleave) * D::kBytes) {
      for (; c + kInterleave <= n; c += kInterleave) DotCols<D, kInterleave, kOff>(w + c, stride, k, a, out + c, ldo);
    }
    for (; c < n; ++c) DotCols<D, 1, kOff>(w + c, stride, k, a, out + c, ldo);
  } else {
    for (; c + 2 <= n; c += 2) DotCols<D, 2, kOff>(w + c, stride, k, a, out + c, ldo);
  }
  for (; c < n; ++c) DotCols<D, 1, kOff>(w + c, stride, k, a, out + c, ldo);
}

// DotType on AVX-512 VNNI: column pairs. Decode (fewer than 4 rows): a group of kInterleave (4) interleaved
// rows is 2 pairs, one activation row at a time; otherwise 4 rows × 2 pairs. Odd columns left at the end
// run on the AVX2 tile (same bits).
template <class D, bool kOff>
QKV_AVX512_VNNI void DotType512(const uint8_t* const* w, size_t stride, int n, int k, const QuantizedRowSet& a,
                                float* out, int ldo) {
  int c = 0;
  if (a.m < 4) {
    for (; c + 4 <= n; c += 4)
      for (int r = 0; r < a.m; ++r) DotTile512<D, 1, 2, kOff>(w + c, stride, k, a, r, out + r * ldo + c, ldo);
    for (; c + 2 <= n; c += 2)
      for (int r = 0; r < a.m; ++r) DotTile512<D, 1, 1, kOff>(w + c, stride, k, a, r, out + r * ldo + c, ldo);
  } else {
    for (; c + 4 <= n; c += 4) {
      int r = 0;
      for (; r + 4 <= a.m; r += 4) DotTile512<D, 4, 2, kOff>(w + c, stride, k, a, r, out + r * ldo + c, ldo);
      for (; r < a.m; ++r) DotTile512<D, 1, 2, kOff>(w + c, stride, k, a, r, out + r * ldo + c, ldo);
    }
    for (; c + 2 <= n; c += 2)
      for (int r = 0; r < a.m; ++r) DotTile512<D, 1, 1, kOff>(w + c, stride, k, a, r, out + r * ldo + c, ldo);
  }
  for (; c < n; ++c) DotCols<D, 1, kOff>(w + c, stride, k, a, out + c, ldo);
}

template <class D, bool kOff>
void DotAt(bool vnni, const uint8_t* const* w, size_t stride, int n, int k, const QuantizedRowSet& a, float* out,
           int ldo) {
  if (vnni) {
    DotType512<D, kOff>(w, stride, n, k, a, out, ldo);
  } else {
    DotType<D, kOff>(w, stride, n, k, a, out, ldo);
  }
}

void Dot(bool vnni, GgmlType t, const uint8_t* const* w, size_t stride, int n, int k, const QuantizedRowSet& a,
         float* out, int ldo) {
  switch (t) {
    case GgmlType::kQ8_0: return DotAt<DecQ8_0, false>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kQ4_0: return DotAt<DecQ4_0, false>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kQ4_1: return DotAt<DecQ4_1, true>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kQ5_0: return DotAt<DecQ5_0, false>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kQ5_1: return DotAt<DecQ5_1, true>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kQ2_K: return DotAt<DecQ2_K, true>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kQ3_K: return DotAt<DecQ3_K, false>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kQ4_K: return DotAt<DecQ45_K<false>, true>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kQ5_K: return DotAt<DecQ45_K<true>, true>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kQ6_K: return DotAt<DecQ6_K, false>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kIQ4_NL: return DotAt<DecIq4Nl, false>(vnni, w, stride, n, k, a, out, ldo);
    case GgmlType::kIQ4_XS: return DotAt<DecIq4Xs, false>(vnni, w, stride, n, k, a, out, ldo);
    default: return;
  }
}

}  // namespace

void QuantizedRows::Resize(int rows, int cols) {
  m = rows, k = cols;
  const size_t n = static_cast<size_t>(rows) * cols;
  if (q.size() < n) q.resize(n), scale.resize(n / 32), sum4.resize(n / 4), sum16.resize(n / 16), sum32.resize(n / 32);
}

void QuantizedRows::QuantizeBlocks(const float* x, size_t ldx, int r0, int r1, int b0, int b1) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + static_cast<size_t>(r) * ldx;
    int8_t* qr = q.data() + static_cast<size_t>(r) * k;
    float* sr = scale.data() + static_cast<size_t>(r) * (k / 32);
    float* s4 = sum4.data() + static_cast<size_t>(r) * (k / 4);
    int32_t* s16 = sum16.data() + static_cast<size_t>(r) * (k / 16);
    int32_t* s32 = sum32.data() + static_cast<size_t>(r) * (k / 32);
    for (int b = b0; b < b1; ++b) {
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xr + 32 * b + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[j]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float mx = _mm_cvtss_f32(m4);
      const float d = mx / 127.0f;
      const __m256 id = _mm256_set1_ps(mx != 0 ? 127.0f / mx : 0.0f);
      __m256i i[4];
      for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // nearest, ties to even
      const __m256i p = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])), perm);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + 32 * b), p);
      sr[b] = d;
      const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, p), ones16);
      _mm256_storeu_ps(s4 + 8 * b, _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d)));
      const __m256i h2 = _mm256_hadd_epi32(s, s);    // per 8 values, in each half
      const __m256i h4 = _mm256_hadd_epi32(h2, h2);  // per 16 values: lane 0 and lane 4
      s16[2 * b] = _mm256_cvtsi256_si32(h4);
      s16[2 * b + 1] = _mm256_extract_epi32(h4, 4);
      s32[b] = s16[2 * b] + s16[2 * b + 1];
    }
  }
}

QuantWeights::QuantWeights(const std::vector<Part>& parts, int k, const float* bias,
                           std::shared_ptr<WeightsArena> arena)
    : k_(k) {
  size_t total = 0;
  for (const Part& p : parts) {
    total += GgmlRowBytes(p.type, k) * p.rows;
    whole_blocks_ = whole_blocks_ && GgmlIsQuantized(p.type) && k % GgmlBlockSize(p.type) == 0;
  }
  data_ = WeightsBuffer(std::move(arena), total);
  size_t off = 0;
  for (const Part& p : parts) {
    const size_t rb = GgmlRowBytes(p.type, k), bb = GgmlBlockBytes(p.type), nb = rb / bb;
    int r = 0;
    // Whole panels first, where the type has a panel kernel and k is whole blocks.
    if (HasPanelKernel(p.type) && k % GgmlBlockSize(p.type) == 0 && p.rows >= kPanelRows) {
      const int np = p.rows / kPanelRows;
      runs_.push_back({p.type, n_, n_ + np * kPanelRows, kPanelRows, off, rb * kPanelRows, 0});
      panel_minimum_ = panel_minimum_ || PanelHasMinimum(p.type);
      for (; r + kPanelRows <= p.rows; r += kPanelRows) {
        RepackPanel(p.type, p.data + rb * r, rb, k, data_.data() + off);
        off += rb * kPanelRows;
      }
    }
    // Whole groups of kInterleave: block b of row i of the group at (b × kInterleave + i) × bb.
    if (r + kInterleave <= p.rows) {
      const int ng = (p.rows - r) / kInterleave;
      runs_.push_back(
          {p.type, n_ + r, n_ + r + ng * kInterleave, kInterleave, off, rb * kInterleave, kInterleave * bb});
      for (; r + kInterleave <= p.rows; r += kInterleave) {
        for (int i = 0; i < kInterleave; ++i) {
          const uint8_t* src = p.data + rb * (r + i);
          for (size_t b = 0; b < nb; ++b)
            std::memcpy(data_.data() + off + (b * kInterleave + i) * bb, src + b * bb, bb);
        }
        off += rb * kInterleave;
      }
    }
    if (r < p.rows) {
      runs_.push_back({p.type, n_ + r, n_ + p.rows, 1, off, rb, bb});
      for (; r < p.rows; ++r) {
        std::memcpy(data_.data() + off, p.data + rb * r, rb);
        off += rb;
      }
    }
    n_ += p.rows;
  }
  if (bias) bias_.assign(bias, bias + n_);
}

KernelIsa QuantWeights::Level() {
  return ActiveKernelIsa() >= KernelIsa::kAvx512Vnni ? KernelIsa::kAvx512Vnni : KernelIsa::kAvx2;
}

std::string QuantWeights::types() const {
  std::vector<GgmlType> seen;
  for (const Run& r : runs_)
    if (std::find(seen.begin(), seen.end(), r.type) == seen.end()) seen.push_back(r.type);
  std::string s;
  for (GgmlType t : seen) {
    if (!s.empty()) s.push_back('+');
    s.append(GgmlTypeName(t));
  }
  return s;
}

void QuantWeights::DequantizeRow(int r, float* dst) const {
  const Row row = At(r);
  const int bs = static_cast<int>(GgmlBlockSize(row.type));
  uint8_t blk[256];
  for (int b = 0; b < k_ / bs; ++b) {
    const uint8_t* src = data_.data() + row.offset + b * row.stride;
    if (row.panel) {
      PanelBlock(row.type, data_.data() + row.offset, b, r - row.unit, blk);
      src = blk;
    }
    qkv::DequantizeRow(row.type, src, bs, dst + b * bs);
  }
}

namespace {
std::atomic<size_t> g_compute_scratch_bytes{0};

// A thread's buffers for QuantWeights::Compute, their bytes kept in g_compute_scratch_bytes.
struct ComputeScratch {
  PanelRows packed;
  std::vector<float> out;
  size_t counted = 0;
  void Count() {
    const size_t n = packed.bytes() + out.capacity() * sizeof(float);
    if (n != counted) {
      g_compute_scratch_bytes.fetch_add(n - counted, std::memory_order_relaxed);  // modular: shrinking works too
      counted = n;
    }
  }
  ~ComputeScratch() { g_compute_scratch_bytes.fetch_sub(counted, std::memory_order_relaxed); }
};
}  // namespace

size_t QuantWeights::ScratchBytes() { return g_compute_scratch_bytes.load(std::memory_order_relaxed); }

void QuantWeights::Compute(const QuantizedRowSet& a, int c0, int c1, float* y, size_t ldy) const {
  // Columns in runs of one type, 64 at a time (the tile's output stays in L1); a panel is a run of its own.
  constexpr int kRun = 64;
  thread_local ComputeScratch scratch;
  std::vector<float>& out = scratch.out;
  PanelRows& packed = scratch.packed;
  out.resize(static_cast<size_t>(a.m) * kRun);
  const bool vnni = Level() == KernelIsa::kAvx512Vnni;
  bool is_packed = false;  // packed holds a (packed at the first panel)
  const uint8_t* w[kRun];
  for (int c = c0; c < c1;) {
    int n = 0, first = c;  // out holds columns first .. first + n − 1
    const Run& run = RunOf(c);
    const GgmlType t = run.type;
    if (run.stride == 0) {  // a panel
      first = run.first + (c - run.first) / run.unit * run.unit;
      if (!is_packed) packed.Pack(a, vnni ? 8 : 4, panel_minimum_), is_packed = true;
      if (first == c && c + kPanelRows <= c1 && bias_.empty()) {  // a whole panel: straight into y
        PanelDot(vnni, t, data_.data() + OffsetIn(run, c), k_, packed, y + c, static_cast<int>(ldy));
        c += kPanelRows;
        continue;
      }
      PanelDot(vnni, t, data_.data() + OffsetIn(run, c), k_, packed, out.data(), kRun);
      n = std::min(c1, first + kPanelRows) - first;
    } else {
      n = std::min({c1, run.end, c + kRun}) - c;
      for (int i = 0; i < n; ++i) w[i] = data_.data() + OffsetIn(run, c + i);
      Dot(vnni, t, w, run.stride, n, k_, a, out.data(), kRun);
    }
    for (int r = 0; r < a.m; ++r) {
      float* yr = y + static_cast<size_t>(r) * ldy;
      const float* o = out.data() + static_cast<size_t>(r) * kRun - first;
      for (int i = c; i < first + n; ++i) yr[i] = bias_.empty() ? o[i] : o[i] + bias_[i];
    }
    c = first + n;
  }
  scratch.Count();
}

}  // namespace qkv
