#include "engine/kernels/quant_panel.h"

#include <immintrin.h>

#include <cstring>

#include "engine/kernels/quant_gemm.h"

namespace qkv {
namespace {

#define QKV_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// Per type: the bytes of a block, where the masks and quants start in a panel block, and how the integer
// dot products see the weights. On AVX-512 VNNI every type goes in as unsigned bytes w + kBias and the
// int32 starts at −kBias × Σ a; on AVX2 the 4- and 5-bit codes go in unsigned the same way (maddubs cannot
// saturate: 2 × 31 × 127 < 2^15) and Q8_0 / IQ4_NL signed, through |w| and a × sign(w).
struct PanelFormat {
  int block_bytes;  // of one row's block in the file
  int mask_at;      // Q5_0's fifth-bit masks (0: none)
  int quant_at;     // the quant rows
  int bias;         // kBias above
};
constexpr PanelFormat Format(GgmlType t) {
  switch (t) {
    case GgmlType::kQ4_0: return {18, 0, 32, 8};
    case GgmlType::kIQ4_NL: return {18, 0, 32, 128};
    case GgmlType::kQ5_0: return {22, 32, 96, 16};
    case GgmlType::kQ8_0: return {34, 0, 32, 128};
    default: return {0, 0, 0, 0};
  }
}
constexpr size_t PanelBlockBytes(GgmlType t) { return static_cast<size_t>(kPanelRows) * Format(t).block_bytes; }

inline int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- AVX-512 VNNI: a zmm holds the 16 rows' values 4t..4t+3, as unsigned bytes w + kBias.
template <GgmlType T>
QKV_AVX512_VNNI inline __m512i Operand512(const uint8_t* blk, int t) {
  constexpr PanelFormat f = Format(T);
  if constexpr (T == GgmlType::kQ8_0) {
    return _mm512_xor_si512(_mm512_loadu_si512(blk + f.quant_at + 64 * t), _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m512i v = _mm512_loadu_si512(blk + f.quant_at + 64 * (t % 4));
    __m512i q = _mm512_and_si512(t < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
    if constexpr (T == GgmlType::kQ5_0) {
      uint64_t m;
      std::memcpy(&m, blk + f.mask_at + 8 * t, 8);
      q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(m, _mm512_set1_epi8(0x10)));
    } else if constexpr (T == GgmlType::kIQ4_NL) {
      // The IQ4 codebook plus 128.
      const __m512i book = _mm512_broadcast_i32x4(
          _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, static_cast<char>(129), static_cast<char>(141),
                        static_cast<char>(153), static_cast<char>(166), static_cast<char>(181), static_cast<char>(197),
                        static_cast<char>(217), static_cast<char>(241)));
      q = _mm512_shuffle_epi8(book, q);
    }
    return q;
  }
}

// R activation rows (from r0) against the panel; with R < 4 each row's integer sum runs as two chains
// (values 0-15 and 16-31, added exactly) so that decode is not bound by the dot product's latency.
template <GgmlType T, int R>
QKV_AVX512_VNNI void PanelTile512(const uint8_t* panel, int k, const QuantizedRows& a, int r0, float* out, int ldo) {
  constexpr int kBias = Format(T).bias;
  constexpr size_t PB = PanelBlockBytes(T);
  constexpr bool kTwo = R < 4;
  __m512 acc[R];
  const int8_t* q[R];
  const float* s[R];
  const int32_t* s32[R];
  for (int r = 0; r < R; ++r) {
    const size_t row = static_cast<size_t>(r0 + r);
    acc[r] = _mm512_setzero_ps();
    q[r] = a.q.data() + row * a.k;
    s[r] = a.scale.data() + row * (a.k / 32);
    s32[r] = a.sum32.data() + row * (a.k / 32);
  }
  for (int b = 0; b < k / 32; ++b) {
    const uint8_t* blk = panel + b * PB;
    __m512i lo[R], hi[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_set1_epi32(-kBias * s32[r][b]);
      if constexpr (kTwo) hi[r] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i w = Operand512<T>(blk, t);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i av = _mm512_set1_epi32(Load32(q[r] + 32 * b + 4 * t));
        if (kTwo && t >= 4) {
          hi[r] = _mm512_dpbusd_epi32(hi[r], w, av);
        } else {
          lo[r] = _mm512_dpbusd_epi32(lo[r], w, av);
        }
      }
    }
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i sum = kTwo ? _mm512_add_epi32(lo[r], hi[r]) : lo[r];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc, _mm512_set1_ps(s[r][b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + static_cast<size_t>(r) * ldo, acc[r]);
}

template <GgmlType T>
QKV_AVX512_VNNI void PanelDot512(const uint8_t* panel, int k, const QuantizedRows& a, float* out, int ldo) {
  int r = 0;
  for (; r + 8 <= a.m; r += 8) PanelTile512<T, 8>(panel, k, a, r, out + static_cast<size_t>(r) * ldo, ldo);
  if (r + 4 <= a.m) PanelTile512<T, 4>(panel, k, a, r, out + static_cast<size_t>(r) * ldo, ldo), r += 4;
  if (r + 2 <= a.m) PanelTile512<T, 2>(panel, k, a, r, out + static_cast<size_t>(r) * ldo, ldo), r += 2;
  if (r < a.m) PanelTile512<T, 1>(panel, k, a, r, out + static_cast<size_t>(r) * ldo, ldo);
}

// ---- AVX2: half h of a panel (rows 8h..8h+7) in a ymm; the same int32 sums through maddubs + madd.
// Byte i of the result is 0x10 when bit i of the 32 bits is set, else 0.
inline __m256i FifthBits(uint32_t x) {
  const __m256i rep =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)),
                          _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit), _mm256_set1_epi8(0x10));
}
// The 4-bit and 5-bit codes unsigned (w + kBias); Q8_0 and IQ4_NL signed (w).
template <GgmlType T>
inline __m256i Operand256(const uint8_t* blk, int t, int h) {
  constexpr PanelFormat f = Format(T);
  if constexpr (T == GgmlType::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + f.quant_at + 64 * t + 32 * h));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + f.quant_at + 64 * (t % 4) + 32 * h));
    __m256i q = _mm256_and_si256(t < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
    if constexpr (T == GgmlType::kQ5_0) {
      uint32_t m;
      std::memcpy(&m, blk + f.mask_at + 8 * t + 4 * h, 4);
      q = _mm256_or_si256(q, FifthBits(m));
    } else if constexpr (T == GgmlType::kIQ4_NL) {
      const __m256i book = _mm256_broadcastsi128_si256(
          _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
      q = _mm256_shuffle_epi8(book, q);
    }
    return q;
  }
}
constexpr bool SignedOnAvx2(GgmlType t) { return t == GgmlType::kQ8_0 || t == GgmlType::kIQ4_NL; }

// R activation rows against halves [h0, h0 + H) of the panel.
template <GgmlType T, int R, int H>
void PanelTile256(const uint8_t* panel, int h0, int k, const QuantizedRows& a, int r0, float* out, int ldo) {
  constexpr bool kSigned = SignedOnAvx2(T);
  constexpr int kBias = kSigned ? 0 : Format(T).bias;
  constexpr size_t PB = PanelBlockBytes(T);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][H];
  const int8_t* q[R];
  const float* s[R];
  const int32_t* s32[R];
  for (int r = 0; r < R; ++r) {
    const size_t row = static_cast<size_t>(r0 + r);
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
    q[r] = a.q.data() + row * a.k;
    s[r] = a.scale.data() + row * (a.k / 32);
    s32[r] = a.sum32.data() + row * (a.k / 32);
  }
  for (int b = 0; b < k / 32; ++b) {
    const uint8_t* blk = panel + b * PB;
    __m256i sum[R][H];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) sum[r][h] = _mm256_set1_epi32(-kBias * s32[r][b]);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        const __m256i w = Operand256<T>(blk, t, h0 + h);
        const __m256i wu = kSigned ? _mm256_sign_epi8(w, w) : w;
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i av = _mm256_set1_epi32(Load32(q[r] + 32 * b + 4 * t));
          const __m256i p16 = _mm256_maddubs_epi16(wu, kSigned ? _mm256_sign_epi8(av, w) : av);
          sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(p16, ones));
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * (h0 + h))));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        acc[r][h] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), _mm256_mul_ps(sc, _mm256_set1_ps(s[r][b])), acc[r][h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(out + static_cast<size_t>(r) * ldo + 8 * (h0 + h), acc[r][h]);
}

template <GgmlType T>
void PanelDot256(const uint8_t* panel, int k, const QuantizedRows& a, float* out, int ldo) {
  int r = 0;
  for (; r + 4 <= a.m; r += 4)
    for (int h = 0; h < 2; ++h) PanelTile256<T, 4, 1>(panel, h, k, a, r, out + static_cast<size_t>(r) * ldo, ldo);
  for (; r < a.m; ++r) PanelTile256<T, 1, 2>(panel, 0, k, a, r, out + static_cast<size_t>(r) * ldo, ldo);
}

template <GgmlType T>
void PanelDotAt(bool vnni, const uint8_t* panel, int k, const QuantizedRows& a, float* out, int ldo) {
  if (vnni) {
    PanelDot512<T>(panel, k, a, out, ldo);
  } else {
    PanelDot256<T>(panel, k, a, out, ldo);
  }
}

}  // namespace

bool HasPanelKernel(GgmlType t) { return Format(t).block_bytes != 0; }

void RepackPanel(GgmlType t, const uint8_t* src, size_t row_bytes, int k, uint8_t* dst) {
  const PanelFormat f = Format(t);
  const size_t bb = f.block_bytes, pb = PanelBlockBytes(t);
  const int quads = t == GgmlType::kQ8_0 ? 8 : 4;  // 64-byte quant rows per block
  const int qs_at = t == GgmlType::kQ5_0 ? 6 : 2;  // the quants in a file block
  for (int b = 0; b < k / 32; ++b) {
    uint8_t* d = dst + b * pb;
    uint64_t masks[8] = {};
    for (int c = 0; c < kPanelRows; ++c) {
      const uint8_t* blk = src + c * row_bytes + b * bb;
      std::memcpy(d + 2 * c, blk, 2);
      for (int q = 0; q < quads; ++q) std::memcpy(d + f.quant_at + 64 * q + 4 * c, blk + qs_at + 4 * q, 4);
      if (f.mask_at) {
        uint32_t qh;
        std::memcpy(&qh, blk + 2, 4);
        for (int v = 0; v < 32; ++v) masks[v / 4] |= static_cast<uint64_t>((qh >> v) & 1) << (4 * c + v % 4);
      }
    }
    if (f.mask_at) std::memcpy(d + f.mask_at, masks, sizeof(masks));
  }
}

void PanelBlock(GgmlType t, const uint8_t* panel, int b, int c, uint8_t* dst) {
  const PanelFormat f = Format(t);
  const uint8_t* d = panel + b * PanelBlockBytes(t);
  const int quads = t == GgmlType::kQ8_0 ? 8 : 4;
  const int qs_at = t == GgmlType::kQ5_0 ? 6 : 2;
  std::memcpy(dst, d + 2 * c, 2);
  for (int q = 0; q < quads; ++q) std::memcpy(dst + qs_at + 4 * q, d + f.quant_at + 64 * q + 4 * c, 4);
  if (f.mask_at) {
    uint64_t masks[8];
    std::memcpy(masks, d + f.mask_at, sizeof(masks));
    uint32_t qh = 0;
    for (int v = 0; v < 32; ++v) qh |= static_cast<uint32_t>((masks[v / 4] >> (4 * c + v % 4)) & 1) << v;
    std::memcpy(dst + 2, &qh, 4);
  }
}

void PanelDot(bool vnni, GgmlType t, const uint8_t* panel, int k, const QuantizedRows& a, float* out, int ldo) {
  switch (t) {
    case GgmlType::kQ4_0: return PanelDotAt<GgmlType::kQ4_0>(vnni, panel, k, a, out, ldo);
    case GgmlType::kIQ4_NL: return PanelDotAt<GgmlType::kIQ4_NL>(vnni, panel, k, a, out, ldo);
    case GgmlType::kQ5_0: return PanelDotAt<GgmlType::kQ5_0>(vnni, panel, k, a, out, ldo);
    case GgmlType::kQ8_0: return PanelDotAt<GgmlType::kQ8_0>(vnni, panel, k, a, out, ldo);
    default: return;
  }
}

}  // namespace qkv
