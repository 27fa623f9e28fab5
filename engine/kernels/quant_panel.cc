#include "engine/kernels/quant_panel.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "engine/kernels/cpu.h"
#include "engine/kernels/quant_gemm.h"

namespace qkv {
namespace {

// ---- Helpers on 64-byte panel rows: on AVX-512 the whole row (16 panel rows, one per 32-bit lane), on
// AVX2 half h of it (panel rows 8h..8h+7).
QKV_AVX512_VNNI inline __m512i Row512(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m256i Row256(const uint8_t* p, int h) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
}
QKV_AVX512_VNNI inline __m512 F16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256 F16x8(const uint8_t* p, int h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
}
QKV_AVX512_VNNI inline __m512i Lo4x64(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
QKV_AVX512_VNNI inline __m512i Hi4x64(__m512i v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
inline __m256i Lo4x32(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i Hi4x32(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
// The fifth bits of Q5_0, Q5_1, Q5_K and Q3_K's high bits are kept as rows of bytes (bit t of a byte: quad t,
// or sub-block t; see the layouts). AVX-512 tests bit `from` of each byte of the 64-byte row at p and adds `v`
// to the bytes of q where it is set (q has that bit clear): a test into a mask and a masked add, as the 64-bit
// masks by quad they replace took a mask load and a masked move (the same speed). AVX2 moves the bit to bit `to`
// by one 16-bit shift (what it carries across a byte lands outside bit `to`) and an and: two operations where
// the masks took five (hot 2-thread AVX2 GEMV, Zen 4: Q5_0/Q5_1 ~50 → ~70 GB/s, Q5_K ~40 → ~50;
// docs/performance.md).
QKV_AVX512_VNNI inline __m512i AddIfBit512(__m512i q, const uint8_t* p, int from, char v) {
  const __mmask64 k = _mm512_test_epi8_mask(Row512(p), _mm512_set1_epi8(static_cast<char>(1 << from)));
  return _mm512_mask_add_epi8(q, k, q, _mm512_set1_epi8(v));
}
inline __m256i BitOfBytes256(const uint8_t* p, int h, int from, int to) {
  const __m256i v = Row256(p, h);
  const __m256i b = from >= to ? _mm256_srli_epi16(v, from - to) : _mm256_slli_epi16(v, to - from);
  return _mm256_and_si256(b, _mm256_set1_epi8(static_cast<char>(1 << to)));
}
// The IQ4 codebook: plus 128 (unsigned, AVX-512) or as is (signed, AVX2).
QKV_AVX512_VNNI inline __m512i Iq4Book512(__m512i idx) {
  const __m512i book = _mm512_broadcast_i32x4(
      _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, static_cast<char>(129), static_cast<char>(141),
                    static_cast<char>(153), static_cast<char>(166), static_cast<char>(181), static_cast<char>(197),
                    static_cast<char>(217), static_cast<char>(241)));
  return _mm512_shuffle_epi8(book, idx);
}
inline __m256i Iq4Book256(__m256i idx) {
  const __m256i book = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
  return _mm256_shuffle_epi8(book, idx);
}
// Byte `i` (0..3) of each 32-bit lane, as floats.
QKV_AVX512_VNNI inline __m512 Byte512(__m512i v, int i) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * i)), _mm512_set1_epi32(0xFF)));
}
inline __m256 Byte256(__m256i v, int i) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(8 * i)), _mm256_set1_epi32(0xFF)));
}

// ---- The formats. Each gives, for panel block `d` (kValues values of 16 rows), sub-block j (32 values) and
// quad t (values 4t..4t+3 of the sub-block): the weights as bytes (W512: unsigned w + kBias; W256: unsigned
// w + kBias, or signed w where kSigned2), the scale of the sub-block (or of its half for kPer16) and, where
// kOff, the offset (value = scale × q − offset, DecodeRowI8's view). Chunks(c, f) lists where the file's
// bytes of row c go: f(file offset, panel offset, bytes); Masks(c, f) the bits that move one by one (fifth
// bits, Q3_K's scales): f(file byte, bit, panel byte, bit in it).
//
// Layouts (offsets in the panel block):
//   Q4_0, IQ4_NL  d[16] f16 @0; 4 quant rows @32 (low nibbles: values 0-15 by quad, high: 16-31)
//   Q5_0          d @0; the fifth bits as a row @32 (byte 4c + i, bit t: value 4t + i of row c); 4 quant rows @96
//   Q8_0          d @0; 8 quant rows @32
//   Q4_1          d @0; m[16] f16 @32; 4 quant rows @64
//   Q5_1          d @0; m @32; the fifth bits' row @64; 4 quant rows @128
//   Q4_K          d @0; dmin @32; the 12 scale bytes as 3 rows of dwords @64; qs: per pair p of sub-blocks
//                 8 rows @256 + 512p (low nibbles sub-block 2p, high 2p + 1)
//   Q5_K          as Q4_K up to 256; then per pair p of sub-blocks @256 + 640p: the fifth bits' row of
//                 sub-block 2p (as Q5_0's), that of 2p + 1 @64, the pair's 8 qs rows @128 (the order in which
//                 the decode tile, Pair512, reads them)
//   Q6_K          d @0; the 16 int8 scales as 16 rows of 16 bytes @32; per half h (sub-blocks 4h + s, s < 4)
//                 @288 + 1536h, per quad t @192t: the ql row of s & 1 = 0, the qh row, the ql row of s & 1 = 1
//                 (low nibbles s < 2, high s ≥ 2): the order in which the decode tile reads them (Q6Half512:
//                 quad by quad, the half's four sub-blocks at once), so that the hardware prefetcher follows it
//   IQ4_XS        d @0; scales_h[16] u16 @32; scales_l as a row of dwords @64; per sub-block 4 rows @128 + 256j
//   Q2_K          d @0; dmin @32; the 16 scale bytes as 16 rows of 16 bytes @64; qs: per half (sub-blocks
//                 4h .. 4h + 3) 8 rows @320 + 512h (bits 2s, 2s + 1: sub-block 4h + s)
//   Q3_K          d @0; the 16 6-bit scales as 3 rows of dwords @32 (see Q3_KP::Masks); hmask as 8 rows by
//                 quad @224 (bit j of a byte: sub-block j); qs as Q2_K's @736 + 512h
// The per-32 scale (d, f16 at 0 in the panel block), with no offset or with a minimum m (f16 at 32, value =
// d × q + m, so the offset is −m).
struct Scale32 {
  static constexpr bool kOff = false;
  QKV_AVX512_VNNI static __m512 Sc512(const uint8_t* d, int, int) { return F16x16(d); }
  static __m256 Sc256(const uint8_t* d, int, int, int h) { return F16x8(d, h); }
  QKV_AVX512_VNNI static __m512 Off512(const uint8_t*, int, int) { return _mm512_setzero_ps(); }
  static __m256 Off256(const uint8_t*, int, int, int) { return _mm256_setzero_ps(); }
};
struct ScaleMin32 : Scale32 {
  static constexpr bool kOff = true;
  QKV_AVX512_VNNI static __m512 Off512(const uint8_t* d, int, int) {
    return _mm512_xor_ps(F16x16(d + 32), _mm512_set1_ps(-0.0f));
  }
  static __m256 Off256(const uint8_t* d, int, int, int h) {
    return _mm256_xor_ps(F16x8(d + 32, h), _mm256_set1_ps(-0.0f));
  }
};
// The 32-value types with 4-bit codes (Q4_0, Q4_1, Q5_0, Q5_1): in the file, d (and m) first, the fifth bits
// as 32 bits at kFileQh (0: none), the nibbles at kFileQs; in the panel block, the fifth bits' row at kMask and
// the 4 quant rows at kQuant.
template <int kBytes, int kBias_, int kFileQh, int kFileQs, int kMask, int kQuant, class S>
struct Block32 : S {
  static constexpr int kValues = 32, kBlockBytes = kBytes, kBias = kBias_, kMaxU = kMask != 0 ? 31 : 15;
  static constexpr int kPrefetchStep = 256;  // see PrefetchAhead
  static constexpr bool kSigned2 = false, kPer16 = false;
  template <class F>
  static void Chunks(int c, F f) {
    f(0, 2 * c, 2);
    if constexpr (S::kOff) f(2, 32 + 2 * c, 2);
    for (int q = 0; q < 4; ++q) f(kFileQs + 4 * q, kQuant + 64 * q + 4 * c, 4);
  }
  template <class F>
  static void Masks(int c, F f) {
    if constexpr (kMask != 0) {
      for (int v = 0; v < 32; ++v) f(kFileQh + v / 8, v % 8, kMask + 4 * c + v % 4, v / 4);
    }
  }
  QKV_AVX512_VNNI static __m512i W512(const uint8_t* d, int, int t) {
    const __m512i v = Row512(d + kQuant + 64 * (t % 4));
    const __m512i q = t < 4 ? Lo4x64(v) : Hi4x64(v);
    if constexpr (kMask != 0) return AddIfBit512(q, d + kMask, t, 0x10);
    return q;
  }
  static __m256i W256(const uint8_t* d, int, int t, int h) {
    const __m256i v = Row256(d + kQuant + 64 * (t % 4), h);
    const __m256i q = t < 4 ? Lo4x32(v) : Hi4x32(v);
    if constexpr (kMask != 0) return _mm256_or_si256(q, BitOfBytes256(d + kMask, h, t, 4));
    return q;
  }
};
using Q4_0P = Block32<18, 8, 0, 2, 0, 32, Scale32>;
using Q5_0P = Block32<22, 16, 2, 6, 32, 96, Scale32>;
using Q4_1P = Block32<20, 0, 0, 4, 0, 64, ScaleMin32>;
using Q5_1P = Block32<24, 0, 4, 8, 64, 128, ScaleMin32>;
struct Iq4NlP : Q4_0P {
  static constexpr int kBias = 128, kMaxU = 127;
  static constexpr bool kSigned2 = true;
  QKV_AVX512_VNNI static __m512i W512(const uint8_t* d, int j, int t) { return Iq4Book512(Q4_0P::W512(d, j, t)); }
  static __m256i W256(const uint8_t* d, int j, int t, int h) { return Iq4Book256(Q4_0P::W256(d, j, t, h)); }
};
struct Q8_0P : Q4_0P {
  static constexpr int kBlockBytes = 34, kBias = 128, kMaxU = 127;
  static constexpr bool kSigned2 = true;
  template <class F>
  static void Chunks(int c, F f) {
    f(0, 2 * c, 2);
    for (int q = 0; q < 8; ++q) f(2 + 4 * q, 32 + 64 * q + 4 * c, 4);
  }
  QKV_AVX512_VNNI static __m512i W512(const uint8_t* d, int, int t) {
    return _mm512_xor_si512(Row512(d + 32 + 64 * t), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static __m256i W256(const uint8_t* d, int, int t, int h) { return Row256(d + 32 + 64 * t, h); }
};
struct Q4_KP {
  static constexpr int kValues = 256, kBlockBytes = 144, kBias = 0, kMaxU = 15, kPrefetchStep = 256;
  static constexpr bool kSigned2 = false, kPer16 = false, kOff = true;
  template <class F>
  static void Chunks(int c, F f) {
    f(0, 2 * c, 2);
    f(2, 32 + 2 * c, 2);
    for (int u = 0; u < 3; ++u) f(4 + 4 * u, 64 + 64 * u + 4 * c, 4);
    for (int p = 0; p < 4; ++p)
      for (int t = 0; t < 8; ++t) f(16 + 32 * p + 4 * t, 256 + 512 * p + 64 * t + 4 * c, 4);
  }
  template <class F>
  static void Masks(int, F) {}
  // On AVX-512 the odd sub-blocks (high nibbles) stay in place, as 16 × w (v & 0xF0: no shift), with their
  // scale over 16 (d / 16, exact): the int32 sum is 16 × Σ w·a exactly (|16 Σ w·a| ≤ 16 × 32 × 15 × 127 <
  // 2^24, so its float is exact too), the scale × activation scale product is the usual one over 16 exactly
  // (powers of two scale without rounding while the product stays above 2^-126, far below any activation
  // scale), and the fma gets the same exact product: the same bits as shifting the nibbles down, one
  // operation less a panel row (hot Q4_K GEMV +4%, Zen 4).
  QKV_AVX512_VNNI static __m512i W512(const uint8_t* d, int j, int t) {
    const __m512i v = Row512(d + 256 + 512 * (j / 2) + 64 * t);
    return j % 2 ? _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(0xF0))) : Lo4x64(v);
  }
  QKV_AVX512_VNNI static __m512 Sc512(const uint8_t* d, int j, int) {
    const __m512 dd = F16x16(d);
    return _mm512_mul_ps(j % 2 ? _mm512_mul_ps(dd, _mm512_set1_ps(0.0625f)) : dd, ScaleByte512(d, j));
  }
  // AVX2 shifts them down: maddubs adds pairs in int16, which 2 × 240 × 127 would overflow.
  static __m256i W256(const uint8_t* d, int j, int t, int h) {
    const __m256i v = Row256(d + 256 + 512 * (j / 2) + 64 * t, h);
    return j % 2 ? Hi4x32(v) : Lo4x32(v);
  }
  static __m256 Sc256(const uint8_t* d, int j, int, int h) { return _mm256_mul_ps(F16x8(d, h), ScaleByte256(d, j, h)); }
  // The 6-bit scales and mins of 4 sub-blocks per dword (ScaleMinK4's layout in quant.cc): u0, u1, u2 are
  // the three dwords of a row's 12 scale bytes.
  QKV_AVX512_VNNI static __m512 ScaleByte512(const uint8_t* d, int j) {
    const __m512i u0 = Row512(d + 64), u2 = Row512(d + 192);
    const __m512i x = j < 4
                          ? _mm512_and_si512(u0, _mm512_set1_epi32(0x3F3F3F3F))
                          : _mm512_or_si512(_mm512_and_si512(u2, _mm512_set1_epi32(0x0F0F0F0F)),
                                            _mm512_and_si512(_mm512_srli_epi32(u0, 2), _mm512_set1_epi32(0x30303030)));
    return Byte512(x, j % 4);
  }
  QKV_AVX512_VNNI static __m512 Off512(const uint8_t* d, int j, int) {
    const __m512i u1 = Row512(d + 128), u2 = Row512(d + 192);
    const __m512i x = j < 4
                          ? _mm512_and_si512(u1, _mm512_set1_epi32(0x3F3F3F3F))
                          : _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), _mm512_set1_epi32(0x0F0F0F0F)),
                                            _mm512_and_si512(_mm512_srli_epi32(u1, 2), _mm512_set1_epi32(0x30303030)));
    return _mm512_mul_ps(F16x16(d + 32), Byte512(x, j % 4));
  }
  static __m256 ScaleByte256(const uint8_t* d, int j, int h) {
    const __m256i u0 = Row256(d + 64, h), u2 = Row256(d + 192, h);
    const __m256i x = j < 4
                          ? _mm256_and_si256(u0, _mm256_set1_epi32(0x3F3F3F3F))
                          : _mm256_or_si256(_mm256_and_si256(u2, _mm256_set1_epi32(0x0F0F0F0F)),
                                            _mm256_and_si256(_mm256_srli_epi32(u0, 2), _mm256_set1_epi32(0x30303030)));
    return Byte256(x, j % 4);
  }
  static __m256 Off256(const uint8_t* d, int j, int, int h) {
    const __m256i u1 = Row256(d + 128, h), u2 = Row256(d + 192, h);
    const __m256i x = j < 4
                          ? _mm256_and_si256(u1, _mm256_set1_epi32(0x3F3F3F3F))
                          : _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), _mm256_set1_epi32(0x0F0F0F0F)),
                                            _mm256_and_si256(_mm256_srli_epi32(u1, 2), _mm256_set1_epi32(0x30303030)));
    return _mm256_mul_ps(F16x8(d + 32, h), Byte256(x, j % 4));
  }
};
struct Q5_KP : Q4_KP {
  static constexpr int kBlockBytes = 176, kMaxU = 31;
  static constexpr int kPrefetchStep = kPanelRows * kBlockBytes;  // one ask a panel block (see PrefetchAhead)
  // Panel offsets of qs row t of pair p and of the fifth bits' row of sub-block j (the layout above).
  static constexpr int Qs(int p, int t) { return 256 + 640 * p + 128 + 64 * t; }
  static constexpr int Mask(int j) { return 256 + 640 * (j / 2) + 64 * (j % 2); }
  template <class F>
  static void Chunks(int c, F f) {
    f(0, 2 * c, 2);
    f(2, 32 + 2 * c, 2);
    for (int u = 0; u < 3; ++u) f(4 + 4 * u, 64 + 64 * u + 4 * c, 4);
    for (int p = 0; p < 4; ++p)
      for (int t = 0; t < 8; ++t) f(48 + 32 * p + 4 * t, Qs(p, t) + 4 * c, 4);
  }
  // Bit j of qh[l] is the fifth bit of value l of sub-block j.
  template <class F>
  static void Masks(int c, F f) {
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) f(16 + l, j, Mask(j) + 4 * c + l % 4, l / 4);
  }
  // The fifth bit goes above the nibble (0x10), so the high nibbles are shifted down here, with the plain scale.
  QKV_AVX512_VNNI static __m512i W512(const uint8_t* d, int j, int t) {
    const __m512i v = Row512(d + Qs(j / 2, t));
    return AddIfBit512(j % 2 ? Hi4x64(v) : Lo4x64(v), d + Mask(j), t, 0x10);
  }
  static __m256i W256(const uint8_t* d, int j, int t, int h) {
    const __m256i v = Row256(d + Qs(j / 2, t), h);
    return _mm256_or_si256(j % 2 ? Hi4x32(v) : Lo4x32(v), BitOfBytes256(d + Mask(j), h, t, 4));
  }
  QKV_AVX512_VNNI static __m512 Sc512(const uint8_t* d, int j, int) {
    return _mm512_mul_ps(F16x16(d), ScaleByte512(d, j));
  }
};
struct Q6_KP {
  static constexpr int kValues = 256, kBlockBytes = 210, kBias = 32, kMaxU = 63;
  static constexpr int kPrefetchStep = kPanelRows * kBlockBytes;  // one ask a panel block (see PrefetchAhead)
  static constexpr bool kSigned2 = false, kPer16 = true, kOff = false;
  // Panel offsets of ql row t of half h and s & 1 = s1, and of qh row t of half h (the layout above).
  static constexpr int Ql(int h, int s1, int t) { return 288 + 1536 * h + 192 * t + 128 * s1; }
  static constexpr int Qh(int h, int t) { return 288 + 1536 * h + 192 * t + 64; }
  template <class F>
  static void Chunks(int c, F f) {
    f(208, 2 * c, 2);
    for (int g = 0; g < 16; ++g) f(192 + g, 32 + 16 * g + c, 1);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 2; ++s)
        for (int t = 0; t < 8; ++t) f(64 * h + 32 * s + 4 * t, Ql(h, s, t) + 4 * c, 4);
      for (int t = 0; t < 8; ++t) f(128 + 32 * h + 4 * t, Qh(h, t) + 4 * c, 4);
    }
  }
  template <class F>
  static void Masks(int, F) {}
  // The values of sub-block 4h + s from its ql row l and the qh row: nibble | (bits 2s, 2s + 1 of the qh
  // byte) << 4. The qh bits go straight to bits 4-5 by one 16-bit shift (none for s = 2) and are masked there
  // (what the shift carries across a byte lands outside 0x30): one operation a quad fewer than shifting down,
  // masking and shifting up; a hot 2-thread Q6_K GEMV went from 77 to 90 GB/s (Zen 4). W256 does the same
  // since Tile256 unrolls its sub-blocks (while it did not, s was no constant there and the shifts chosen at
  // run time read 41 GB/s against 50 for a shift by a count).
  QKV_AVX512_VNNI static __m512i Value512(__m512i l, __m512i qh, int s) {
    const __m512i q = s == 0   ? _mm512_slli_epi16(qh, 4)
                      : s == 1 ? _mm512_slli_epi16(qh, 2)
                      : s == 2 ? qh
                               : _mm512_srli_epi16(qh, 2);
    return _mm512_or_si512(s >> 1 ? Hi4x64(l) : Lo4x64(l), _mm512_and_si512(q, _mm512_set1_epi8(0x30)));
  }
  QKV_AVX512_VNNI static __m512i W512(const uint8_t* d, int j, int t) {
    const int h = j / 4, s = j % 4;
    return Value512(Row512(d + Ql(h, s & 1, t)), Row512(d + Qh(h, t)), s);
  }
  static __m256i W256(const uint8_t* d, int j, int t, int h) {
    const int hh = j / 4, s = j % 4;
    const __m256i l = Row256(d + Ql(hh, s & 1, t), h);
    const __m256i qh = Row256(d + Qh(hh, t), h);
    const __m256i q = s == 0   ? _mm256_slli_epi16(qh, 4)
                      : s == 1 ? _mm256_slli_epi16(qh, 2)
                      : s == 2 ? qh
                               : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(s >> 1 ? Hi4x32(l) : Lo4x32(l), _mm256_and_si256(q, _mm256_set1_epi8(0x30)));
  }
  // Scale of the half (16 values) `half` of sub-block j: d × the int8 scale of group 2j + half.
  QKV_AVX512_VNNI static __m512 Sc512(const uint8_t* d, int j, int half) {
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 32 + 16 * (2 * j + half)));
    return _mm512_mul_ps(F16x16(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s)));
  }
  static __m256 Sc256(const uint8_t* d, int j, int half, int h) {
    const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(d + 32 + 16 * (2 * j + half) + 8 * h));
    return _mm256_mul_ps(F16x8(d, h), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)));
  }
  QKV_AVX512_VNNI static __m512 Off512(const uint8_t*, int, int) { return _mm512_setzero_ps(); }
  static __m256 Off256(const uint8_t*, int, int, int) { return _mm256_setzero_ps(); }
};
struct Iq4XsP {
  static constexpr int kValues = 256, kBlockBytes = 136, kBias = 128, kMaxU = 127, kPrefetchStep = 256;
  static constexpr bool kSigned2 = true, kPer16 = false, kOff = false;
  template <class F>
  static void Chunks(int c, F f) {
    f(0, 2 * c, 2);
    f(2, 32 + 2 * c, 2);
    f(4, 64 + 4 * c, 4);
    for (int j = 0; j < 8; ++j)
      for (int t = 0; t < 4; ++t) f(8 + 16 * j + 4 * t, 128 + 256 * j + 64 * t + 4 * c, 4);
  }
  template <class F>
  static void Masks(int, F) {}
  QKV_AVX512_VNNI static __m512i W512(const uint8_t* d, int j, int t) {
    const __m512i v = Row512(d + 128 + 256 * j + 64 * (t % 4));
    return Iq4Book512(t < 4 ? Lo4x64(v) : Hi4x64(v));
  }
  static __m256i W256(const uint8_t* d, int j, int t, int h) {
    const __m256i v = Row256(d + 128 + 256 * j + 64 * (t % 4), h);
    return Iq4Book256(t < 4 ? Lo4x32(v) : Hi4x32(v));
  }
  // d × (6-bit scale − 32): low 4 bits from scales_l (bits 4j.. of the dword), high 2 from scales_h.
  QKV_AVX512_VNNI static __m512 Sc512(const uint8_t* d, int j, int) {
    const __m512i lo =
        _mm512_and_si512(_mm512_srl_epi32(Row512(d + 64), _mm_cvtsi32_si128(4 * j)), _mm512_set1_epi32(0x0F));
    const __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + 32)));
    const __m512i hi = _mm512_and_si512(_mm512_srl_epi32(sh, _mm_cvtsi32_si128(2 * j)), _mm512_set1_epi32(3));
    const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
    return _mm512_mul_ps(F16x16(d), _mm512_cvtepi32_ps(ls));
  }
  static __m256 Sc256(const uint8_t* d, int j, int, int h) {
    const __m256i lo =
        _mm256_and_si256(_mm256_srl_epi32(Row256(d + 64, h), _mm_cvtsi32_si128(4 * j)), _mm256_set1_epi32(0x0F));
    const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 32 + 16 * h)));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(sh, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    return _mm256_mul_ps(F16x8(d, h), _mm256_cvtepi32_ps(ls));
  }
  QKV_AVX512_VNNI static __m512 Off512(const uint8_t*, int, int) { return _mm512_setzero_ps(); }
  static __m256 Off256(const uint8_t*, int, int, int) { return _mm256_setzero_ps(); }
};

// Q2_K and Q3_K: 2-bit values per 16 with their own scale (Q2_K also a minimum per 16).
struct Q2_KP {
  static constexpr int kValues = 256, kBlockBytes = 84, kBias = 0, kMaxU = 3, kPrefetchStep = 64;
  static constexpr bool kSigned2 = false, kPer16 = true, kOff = true;
  template <class F>
  static void Chunks(int c, F f) {
    f(80, 2 * c, 2);
    f(82, 32 + 2 * c, 2);
    for (int g = 0; g < 16; ++g) f(g, 64 + 16 * g + c, 1);
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 8; ++t) f(16 + 32 * h + 4 * t, 320 + 512 * h + 64 * t + 4 * c, 4);
  }
  template <class F>
  static void Masks(int, F) {}
  // Bits (2s, 2s + 1), s = j % 4, of row t of the half j / 4 (rows at p + 512 × half).
  QKV_AVX512_VNNI static __m512i Crumbs512(const uint8_t* p, int j, int t) {
    const __m512i v = Row512(p + 512 * (j / 4) + 64 * t);
    return _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(2 * (j % 4))), _mm512_set1_epi8(3));
  }
  static __m256i Crumbs256(const uint8_t* p, int j, int t, int h) {
    const __m256i v = Row256(p + 512 * (j / 4) + 64 * t, h);
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (j % 4))), _mm256_set1_epi8(3));
  }
  QKV_AVX512_VNNI static __m512i W512(const uint8_t* d, int j, int t) { return Crumbs512(d + 320, j, t); }
  static __m256i W256(const uint8_t* d, int j, int t, int h) { return Crumbs256(d + 320, j, t, h); }
  // The scale byte of group 2j + half: d × its low nibble is the scale, dmin × its high nibble the offset.
  QKV_AVX512_VNNI static __m512i Group512(const uint8_t* d, int j, int half) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 64 + 16 * (2 * j + half))));
  }
  static __m256i Group256(const uint8_t* d, int j, int half, int h) {
    return _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(d + 64 + 16 * (2 * j + half) + 8 * h)));
  }
  QKV_AVX512_VNNI static __m512 Sc512(const uint8_t* d, int j, int half) {
    const __m512i g = _mm512_and_si512(Group512(d, j, half), _mm512_set1_epi32(0x0F));
    return _mm512_mul_ps(F16x16(d), _mm512_cvtepi32_ps(g));
  }
  QKV_AVX512_VNNI static __m512 Off512(const uint8_t* d, int j, int half) {
    return _mm512_mul_ps(F16x16(d + 32), _mm512_cvtepi32_ps(_mm512_srli_epi32(Group512(d, j, half), 4)));
  }
  static __m256 Sc256(const uint8_t* d, int j, int half, int h) {
    const __m256i g = _mm256_and_si256(Group256(d, j, half, h), _mm256_set1_epi32(0x0F));
    return _mm256_mul_ps(F16x8(d, h), _mm256_cvtepi32_ps(g));
  }
  static __m256 Off256(const uint8_t* d, int j, int half, int h) {
    return _mm256_mul_ps(F16x8(d + 32, h), _mm256_cvtepi32_ps(_mm256_srli_epi32(Group256(d, j, half, h), 4)));
  }
};
// Q3_K: value = lo − 4 + 4 × (hmask bit), so unsigned lo + 4 × bit with kBias 4; the 6-bit signed scales of
// ScaleK3 (quant.cc) decoded for 16 rows at once from 3 rows of dwords.
struct Q3_KP {
  static constexpr int kValues = 256, kBlockBytes = 110, kBias = 4, kMaxU = 7, kPrefetchStep = 64;
  static constexpr bool kSigned2 = false, kPer16 = true, kOff = false;
  template <class F>
  static void Chunks(int c, F f) {
    f(108, 2 * c, 2);
    for (int t = 0; t < 8; ++t) f(4 * t, 224 + 64 * t + 4 * c, 4);
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 8; ++t) f(32 + 32 * h + 4 * t, 736 + 512 * h + 64 * t + 4 * c, 4);
  }
  // The 6-bit scale u of group g (ScaleK3: the low 4 bits in byte g % 8 of the file's scales, its high nibble
  // when g >= 8, the high 2 in byte 8 + g % 4, bits 2 (g / 4)) goes whole into the row's dword g / 5, bits
  // 6 (g % 5) (g < 15), and group 15 two bits a dword, bits 30-31 of dwords 0, 1, 2: a group then takes two
  // shifts, not two loads and seven operations.
  template <class F>
  static void Masks(int c, F f) {
    for (int g = 0; g < 16; ++g)
      for (int i = 0; i < 6; ++i) {
        const int byte = i < 4 ? 96 + g % 8 : 104 + g % 4, bit = i < 4 ? i + 4 * (g / 8) : i - 4 + 2 * (g / 4);
        const int u = g < 15 ? g / 5 : i / 2, to_bit = g < 15 ? 6 * (g % 5) + i : 30 + i % 2;
        f(byte, bit, 32 + 64 * u + 4 * c, to_bit);
      }
  }
  // The high bits: hmask[4t .. 4t + 3] of the 16 rows as the row of quad t (@224 + 64t), the file's bytes;
  // bit j of each byte (sub-block j) adds 4 (AddIfBit512, BitOfBytes256). Against 64-bit masks by sub-block and quad:
  // the same speed on AVX-512, and on AVX2 with the sub-blocks unrolled 24 → 30 GB/s where the masks fell to
  // 13-17 (docs/performance.md).
  QKV_AVX512_VNNI static __m512i W512(const uint8_t* d, int j, int t) {
    return AddIfBit512(Q2_KP::Crumbs512(d + 736, j, t), d + 224 + 64 * t, j, 4);
  }
  static __m256i W256(const uint8_t* d, int j, int t, int h) {
    return _mm256_or_si256(Q2_KP::Crumbs256(d + 736, j, t, h), BitOfBytes256(d + 224 + 64 * t, h, j, 2));
  }
  // Group g = 2j + half, u − 32 as the signed 6-bit field: the fields' top bits flipped (u ^ 32), then shifted
  // up to bit 31 and arithmetically down; group 15 from its three 2-bit pieces (the top one signed).
  static constexpr int kScaleFlip[3] = {0x20820820, 0x20820820, static_cast<int>(0xA0820820u)};
  QKV_AVX512_VNNI static __m512i ScaleRow512(const uint8_t* d, int u) {
    return _mm512_xor_si512(Row512(d + 32 + 64 * u), _mm512_set1_epi32(kScaleFlip[u]));
  }
  QKV_AVX512_VNNI static __m512 Sc512(const uint8_t* d, int j, int half) {
    const int g = 2 * j + half;
    __m512i v;
    if (g < 15) {
      v = _mm512_srai_epi32(_mm512_sll_epi32(ScaleRow512(d, g / 5), _mm_cvtsi32_si128(26 - 6 * (g % 5))), 26);
    } else {
      const __m512i lo = _mm512_srli_epi32(ScaleRow512(d, 0), 30);
      const __m512i mid = _mm512_and_si512(_mm512_srli_epi32(ScaleRow512(d, 1), 28), _mm512_set1_epi32(0x0C));
      const __m512i top = _mm512_slli_epi32(_mm512_srai_epi32(ScaleRow512(d, 2), 30), 4);
      v = _mm512_or_si512(_mm512_or_si512(lo, mid), top);
    }
    return _mm512_mul_ps(F16x16(d), _mm512_cvtepi32_ps(v));
  }
  static __m256i ScaleRow256(const uint8_t* d, int u, int h) {
    return _mm256_xor_si256(Row256(d + 32 + 64 * u, h), _mm256_set1_epi32(kScaleFlip[u]));
  }
  static __m256 Sc256(const uint8_t* d, int j, int half, int h) {
    const int g = 2 * j + half;
    __m256i v;
    if (g < 15) {
      v = _mm256_srai_epi32(_mm256_sll_epi32(ScaleRow256(d, g / 5, h), _mm_cvtsi32_si128(26 - 6 * (g % 5))), 26);
    } else {
      const __m256i lo = _mm256_srli_epi32(ScaleRow256(d, 0, h), 30);
      const __m256i mid = _mm256_and_si256(_mm256_srli_epi32(ScaleRow256(d, 1, h), 28), _mm256_set1_epi32(0x0C));
      const __m256i top = _mm256_slli_epi32(_mm256_srai_epi32(ScaleRow256(d, 2, h), 30), 4);
      v = _mm256_or_si256(_mm256_or_si256(lo, mid), top);
    }
    return _mm256_mul_ps(F16x8(d, h), _mm256_cvtepi32_ps(v));
  }
  QKV_AVX512_VNNI static __m512 Off512(const uint8_t*, int, int) { return _mm512_setzero_ps(); }
  static __m256 Off256(const uint8_t*, int, int, int) { return _mm256_setzero_ps(); }
};

inline int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Decode tiles (few activation rows) are bound by reading the weights: each super-block asks for the
// bytes 8 KiB ahead (the next super-blocks of the panel, then the next panel, which follows it), into L2.
// The hardware prefetcher alone left 2-thread GEMVs at 54 (Q6_K) to 82 (Q4_K) GB/s where asking 4 KiB ahead
// read 76-90, and a decoded token's experts (short streams of 0.15-0.3 MB per thread) gained 10-25% (Zen 5
// EPYC). Into L1 (T0) the asks took the L1 miss buffers the tile's own loads wait on: on a Zen 4 EPYC a
// cold Q6_K GEMV read 14-15 GB/s that way and 27-28 into L2 (T1), and MoE Q4_K_M decode rose ~25%; on the
// Zen 5, T1 and T0 at 4-16 KiB were within 5% of each other (docs/performance.md).
//
// How many asks (kStep, the format's kPrefetchStep) depends on whether the hardware prefetcher follows the
// tile. It does when a panel block is read front to back: an ask per line then only took its place (Zen 4,
// a cold 2-thread GEMV beside a stream read: 0.91 of the stream's rate with an ask per line, 1.00-1.03 with one
// every 256 bytes of a panel block; in that CPU's high-bandwidth state, ~58 GB/s, 0.72 against 0.94-1.01), so
// the 32-value types, Q4_K and IQ4_XS ask every 256 bytes (one line in four for the 256-value types; two or
// three a panel block of 288-544 bytes for the 32-value ones). Q6_K and Q5_K are laid out in the order their
// tiles read them (see the layouts above) and ask once a panel block (no asks and one every 1 KiB are within
// ±0.03; in Q6_K's first layout, with qh rows 2 KiB past their ql rows, no asks gave 0.45 and one per line 0.84). Q2_K
// and Q3_K, which still jump back to scale and mask rows, ask for every line (docs/performance.md).
template <size_t kBytes, size_t kStep>
inline void PrefetchAhead(const uint8_t* d) {
  constexpr size_t kAhead = 8192;
  for (size_t o = 0; o < kBytes; o += kStep) _mm_prefetch(reinterpret_cast<const char*>(d + kAhead + o), _MM_HINT_T1);
}

// Bytes of a row and 32-block in PanelRows (quant_panel.h): its values, scale and sums, then apart from them
// its scaled sums.
constexpr int kRowBlock = 48, kScaledBlock = 12;

inline float LoadF(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Block b of a PanelRows group of R rows: values, scales, block and half-block sums of row r (at p), and those
// sums times the scale (float(Σ a) × a_scale, the minimum's factor; at s).
template <int R>
struct PackedBlock {
  const uint8_t* p;
  const uint8_t* s;
  int32_t Quad(int r, int t) const { return Load32(p + 32 * r + 4 * t); }
  float Scale(int r) const { return LoadF(p + 32 * R + 4 * r); }
  int32_t Sum32(int r) const { return Load32(p + 36 * R + 4 * r); }
  int32_t Sum16(int r, int half) const { return Load32(p + 40 * R + 8 * r + 4 * half); }
  float ScaledSum32(int r) const { return LoadF(s + 4 * r); }
  float ScaledSum16(int r, int half) const { return LoadF(s + 4 * R + 8 * r + 4 * half); }
};

// Q6_K at decode (R ≤ 2): half h of panel block d (sub-blocks j0 + 4h .. j0 + 4h + 3 of the rows), quad by quad:
// each quad's two ql rows and qh row are loaded once and give the four sub-blocks' values, so the half's
// bytes are read front to back, 192 at a time, with four dot products each, instead of the first two
// sub-blocks reading all of them and the last two none (cold 32000 × 1024 GEMV 0.98 → 1.05 of the stream, Zen
// 4, docs/performance.md). The integer sums are the same; the float steps run in Tile512's order (sub-block,
// then its halves), so the bits are Tile512's.
template <int R>
QKV_AVX512_VNNI inline __attribute__((always_inline)) void Q6Half512(const uint8_t* d, int h, const uint8_t* rows,
                                                                     const uint8_t* scaled, int j0, __m512* acc) {
  using P = Q6_KP;
  const auto block = [&](int s) {
    const size_t blk = static_cast<size_t>(j0 + 4 * h + s) * R;
    return PackedBlock<R>{rows + blk * kRowBlock, scaled + blk * kScaledBlock};
  };
  __m512i sum[4][2][R];  // sub-block s, its half (quads 0-3, 4-7), row
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half)
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) sum[s][half][r] = _mm512_set1_epi32(-P::kBias * block(s).Sum16(r, half));
  }
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    const __m512i l0 = Row512(d + P::Ql(h, 0, t)), qh = Row512(d + P::Qh(h, t)), l1 = Row512(d + P::Ql(h, 1, t));
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const __m512i w = P::Value512(s & 1 ? l1 : l0, qh, s);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r)
        sum[s][t / 4][r] = _mm512_dpbusd_epi32(sum[s][t / 4][r], w, _mm512_set1_epi32(block(s).Quad(r, t)));
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const __m512 sc = P::Sc512(d, 4 * h + s, half);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m512 rs = _mm512_mul_ps(sc, _mm512_set1_ps(block(s).Scale(r)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[s][half][r]), rs, acc[r]);
      }
    }
  }
}

// Q5_K at decode (R ≤ 2): sub-blocks 2p and 2p + 1 of panel block d (their values come from the same qs rows)
// quad by quad, each row loaded once for both, the integer sums as Tile512's (two chains, quads 0-3 and 4-7),
// the float steps in its order, so the bits are Tile512's. With Q5_K's fifth bits of both sub-blocks ahead of the rows,
// the pair's bytes are read front to back at an even pace, not 576 bytes by sub-block 2p and 64 by 2p + 1: a cold 32000
// × 1024 Q5_K GEMV read 0.83 → 0.94 of the stream in the Zen 4's high-bandwidth state (0.98 → 0.99 in the usual one).
// Q4_K gained nothing from the same loop (docs/performance.md), so it keeps Tile512's.
template <class P, int R>
QKV_AVX512_VNNI inline __attribute__((always_inline)) void Pair512(const uint8_t* d, int p, const uint8_t* rows,
                                                                   const uint8_t* scaled, int j0, __m512* acc) {
  const auto block = [&](int i) {
    const size_t blk = static_cast<size_t>(j0 + 2 * p + i) * R;
    return PackedBlock<R>{rows + blk * kRowBlock, scaled + blk * kScaledBlock};
  };
  __m512i lo[2][R], hi[2][R];
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      lo[i][r] = _mm512_set1_epi32(-P::kBias * block(i).Sum32(r));
      hi[i][r] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const __m512i w = P::W512(d, 2 * p + i, t);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m512i av = _mm512_set1_epi32(block(i).Quad(r, t));
        if (t >= 4) {
          hi[i][r] = _mm512_dpbusd_epi32(hi[i][r], w, av);
        } else {
          lo[i][r] = _mm512_dpbusd_epi32(lo[i][r], w, av);
        }
      }
    }
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    const __m512 sc = P::Sc512(d, 2 * p + i, 0);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const __m512i sum = _mm512_add_epi32(lo[i][r], hi[i][r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc, _mm512_set1_ps(block(i).Scale(r))), acc[r]);
    }
    if constexpr (P::kOff) {
      const __m512 off = P::Off512(d, 2 * p + i, 0);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fnmadd_ps(off, _mm512_set1_ps(block(i).ScaledSum32(r)), acc[r]);
    }
  }
}

// ---- AVX-512 VNNI: a group of R activation rows (PanelRows) against a panel. Per sub-block (or half, for
// kPer16) the int32 starts at −kBias × Σ a and takes one vpdpbusd per quad; with R < 4 a sub-block's sum runs
// as two chains (quads 0-3 and 4-7, added exactly) so that decode is not bound by the dot product's latency.
template <class P, int R>
QKV_AVX512_VNNI void Tile512(const uint8_t* panel, int k, const uint8_t* rows, const uint8_t* scaled, float* out,
                             int ldo) {
  constexpr int G = P::kValues / 32;
  constexpr size_t PB = static_cast<size_t>(kPanelRows) * P::kBlockBytes;
  constexpr bool kTwo = R < 4 && !P::kPer16;
  __m512 acc[R];  // unrolled loops only, so that acc stays in registers (a rolled one put it on the stack)
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int sb = 0; sb < k / P::kValues; ++sb) {
    const uint8_t* d = panel + sb * PB;
    if constexpr (R <= 2) PrefetchAhead<PB, P::kPrefetchStep>(d);
    if constexpr (std::is_same_v<P, Q6_KP> && R <= 2) {
      Q6Half512<R>(d, 0, rows, scaled, sb * G, acc);
      Q6Half512<R>(d, 1, rows, scaled, sb * G, acc);
      continue;
    }
    if constexpr (std::is_same_v<P, Q5_KP> && R <= 2) {
#pragma GCC unroll 4
      for (int p = 0; p < G / 2; ++p) Pair512<P, R>(d, p, rows, scaled, sb * G, acc);
      continue;
    }
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      const size_t blk = static_cast<size_t>(sb * G + j) * R;
      const PackedBlock<R> x{rows + blk * kRowBlock, scaled + blk * kScaledBlock};
      if constexpr (P::kPer16) {
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          __m512i sum[R];
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) sum[r] = _mm512_set1_epi32(-P::kBias * x.Sum16(r, half));
#pragma GCC unroll 4
          for (int t = 4 * half; t < 4 * half + 4; ++t) {
            const __m512i w = P::W512(d, j, t);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) sum[r] = _mm512_dpbusd_epi32(sum[r], w, _mm512_set1_epi32(x.Quad(r, t)));
          }
          const __m512 sc = P::Sc512(d, j, half);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(sc, _mm512_set1_ps(x.Scale(r))), acc[r]);
          if constexpr (P::kOff) {
            const __m512 off = P::Off512(d, j, half);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[r] = _mm512_fnmadd_ps(off, _mm512_set1_ps(x.ScaledSum16(r, half)), acc[r]);
          }
        }
      } else {
        __m512i lo[R], hi[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          lo[r] = _mm512_set1_epi32(-P::kBias * x.Sum32(r));
          if constexpr (kTwo) hi[r] = _mm512_setzero_si512();
        }
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m512i w = P::W512(d, j, t);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512i av = _mm512_set1_epi32(x.Quad(r, t));
            if (kTwo && t >= 4) {
              hi[r] = _mm512_dpbusd_epi32(hi[r], w, av);
            } else {
              lo[r] = _mm512_dpbusd_epi32(lo[r], w, av);
            }
          }
        }
        const __m512 sc = P::Sc512(d, j, 0);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i sum = kTwo ? _mm512_add_epi32(lo[r], hi[r]) : lo[r];
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc, _mm512_set1_ps(x.Scale(r))), acc[r]);
        }
        if constexpr (P::kOff) {
          const __m512 off = P::Off512(d, j, 0);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fnmadd_ps(off, _mm512_set1_ps(x.ScaledSum32(r)), acc[r]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + static_cast<size_t>(r) * ldo, acc[r]);
}

template <class P>
QKV_AVX512_VNNI void Dot512(const uint8_t* panel, int k, const PanelRows& a, float* out, int ldo) {
  int r = 0;
  for (; r + 8 <= a.m(); r += 8)
    Tile512<P, 8>(panel, k, a.group(r), a.scaled(r), out + static_cast<size_t>(r) * ldo, ldo);
  if (r + 4 <= a.m()) Tile512<P, 4>(panel, k, a.group(r), a.scaled(r), out + static_cast<size_t>(r) * ldo, ldo), r += 4;
  if (r + 2 <= a.m()) Tile512<P, 2>(panel, k, a.group(r), a.scaled(r), out + static_cast<size_t>(r) * ldo, ldo), r += 2;
  if (r < a.m()) Tile512<P, 1>(panel, k, a.group(r), a.scaled(r), out + static_cast<size_t>(r) * ldo, ldo);
}

// ---- AVX2: a group of R activation rows against halves [h0, h0 + H) of a panel, the same int32 sums through
// maddubs + madd (unsigned w + kBias, or |w| against a × sign(w) for the signed formats: no saturation,
// since |a| ≤ 127) and the same float operations.
template <class P, int R, int H>
void Tile256(const uint8_t* panel, int h0, int k, const uint8_t* rows, const uint8_t* scaled, float* out, int ldo) {
  constexpr int G = P::kValues / 32;
  constexpr size_t PB = static_cast<size_t>(kPanelRows) * P::kBlockBytes;
  constexpr int kBias = P::kSigned2 ? 0 : P::kBias;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int sb = 0; sb < k / P::kValues; ++sb) {
    const uint8_t* d = panel + sb * PB;
    // The sub-blocks unrolled, as on AVX-512: the shift counts and offsets become constants (hot 2-thread GEMV
    // at AVX2, Zen 4: Q3_K 24 → 30 GB/s, Q6_K 49-51 → 57-58, Q5_K 33.5 → 38, Q2_K 29 → 31-32, Q4_K ~58 both).
    if constexpr (R == 1) PrefetchAhead<PB, P::kPrefetchStep>(d);
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      const size_t blk = static_cast<size_t>(sb * G + j) * R;
      const PackedBlock<R> x{rows + blk * kRowBlock, scaled + blk * kScaledBlock};
      constexpr int kParts = P::kPer16 ? 2 : 1;  // integer sums per sub-block
#pragma GCC unroll 2
      for (int part = 0; part < kParts; ++part) {
        __m256i sum[R][H];
        for (int r = 0; r < R; ++r) {
          const int32_t s = P::kPer16 ? x.Sum16(r, part) : x.Sum32(r);
          for (int h = 0; h < H; ++h) sum[r][h] = _mm256_set1_epi32(-kBias * s);
        }
        constexpr int kQuads = 8 / kParts;
        // A pair of products is at most 2 × kMaxU × 127 (no saturation in maddubs); kRun quads of pairs still
        // fit in int16, so they are added there and widened once (the same exact integer sum).
        constexpr int kRun = std::min(kQuads, 32767 / (2 * 127 * P::kMaxU));
        static_assert(kQuads % kRun == 0);
        __m256i run[R][H];
#pragma GCC unroll 8
        for (int t = part * kQuads; t < (part + 1) * kQuads; ++t) {
#pragma GCC unroll 2
          for (int h = 0; h < H; ++h) {
            const __m256i w = P::W256(d, j, t, h0 + h);
            const __m256i wu = P::kSigned2 ? _mm256_sign_epi8(w, w) : w;
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const __m256i av = _mm256_set1_epi32(x.Quad(r, t));
              const __m256i p16 = _mm256_maddubs_epi16(wu, P::kSigned2 ? _mm256_sign_epi8(av, w) : av);
              run[r][h] = t % kRun == 0 ? p16 : _mm256_add_epi16(run[r][h], p16);
              if (t % kRun == kRun - 1) sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(run[r][h], ones));
            }
          }
        }
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) {
          const __m256 sc = P::Sc256(d, j, part, h0 + h);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r)
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), _mm256_mul_ps(sc, _mm256_set1_ps(x.Scale(r))),
                                        acc[r][h]);
          if constexpr (P::kOff) {
            // The minimum's term right after the sum it belongs to (per 16 values for kPer16, else per 32).
            const __m256 off = P::Off256(d, j, part, h0 + h);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const float sa = P::kPer16 ? x.ScaledSum16(r, part) : x.ScaledSum32(r);
              acc[r][h] = _mm256_fnmadd_ps(off, _mm256_set1_ps(sa), acc[r][h]);
            }
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(out + static_cast<size_t>(r) * ldo + 8 * (h0 + h), acc[r][h]);
}

template <class P>
void Dot256(const uint8_t* panel, int k, const PanelRows& a, float* out, int ldo) {
  int r = 0;
  for (; r + 4 <= a.m(); r += 4)
    for (int h = 0; h < 2; ++h)
      Tile256<P, 4, 1>(panel, h, k, a.group(r), a.scaled(r), out + static_cast<size_t>(r) * ldo, ldo);
  if (r + 2 <= a.m()) {
    for (int h = 0; h < 2; ++h)
      Tile256<P, 2, 1>(panel, h, k, a.group(r), a.scaled(r), out + static_cast<size_t>(r) * ldo, ldo);
    r += 2;
  }
  if (r < a.m()) Tile256<P, 1, 2>(panel, 0, k, a.group(r), a.scaled(r), out + static_cast<size_t>(r) * ldo, ldo);
}

// Calls f with the format of t (a value of its struct); false when t has no panel kernel.
template <class F>
bool WithFormat(GgmlType t, F&& f) {
  switch (t) {
    case GgmlType::kQ4_0: f(Q4_0P{}); return true;
    case GgmlType::kIQ4_NL: f(Iq4NlP{}); return true;
    case GgmlType::kQ5_0: f(Q5_0P{}); return true;
    case GgmlType::kQ8_0: f(Q8_0P{}); return true;
    case GgmlType::kQ4_1: f(Q4_1P{}); return true;
    case GgmlType::kQ5_1: f(Q5_1P{}); return true;
    case GgmlType::kQ4_K: f(Q4_KP{}); return true;
    case GgmlType::kQ5_K: f(Q5_KP{}); return true;
    case GgmlType::kQ6_K: f(Q6_KP{}); return true;
    case GgmlType::kIQ4_XS: f(Iq4XsP{}); return true;
    case GgmlType::kQ2_K: f(Q2_KP{}); return true;
    case GgmlType::kQ3_K: f(Q3_KP{}); return true;
    default: return false;
  }
}

}  // namespace

bool HasPanelKernel(GgmlType t) {
  return WithFormat(t, [](auto) {});
}

bool PanelHasMinimum(GgmlType t) {
  bool off = false;
  WithFormat(t, [&](auto p) { off = decltype(p)::kOff; });
  return off;
}

void RepackPanel(GgmlType t, const uint8_t* src, size_t row_bytes, int k, uint8_t* dst) {
  WithFormat(t, [&](auto p) {
    using P = decltype(p);
    const size_t pb = static_cast<size_t>(kPanelRows) * P::kBlockBytes;
    std::memset(dst, 0, pb * (k / P::kValues));
    for (int b = 0; b < k / P::kValues; ++b) {
      uint8_t* d = dst + b * pb;
      for (int c = 0; c < kPanelRows; ++c) {
        const uint8_t* blk = src + c * row_bytes + static_cast<size_t>(b) * P::kBlockBytes;
        P::Chunks(c, [&](int from, int to, int n) { std::memcpy(d + to, blk + from, n); });
        P::Masks(c, [&](int byte, int bit, int to, int to_bit) {
          d[to + to_bit / 8] |= static_cast<uint8_t>(((blk[byte] >> bit) & 1) << (to_bit % 8));
        });
      }
    }
  });
}

void PanelBlock(GgmlType t, const uint8_t* panel, int b, int c, uint8_t* dst) {
  WithFormat(t, [&](auto p) {
    using P = decltype(p);
    const uint8_t* d = panel + static_cast<size_t>(b) * kPanelRows * P::kBlockBytes;
    std::memset(dst, 0, P::kBlockBytes);
    P::Chunks(c, [&](int from, int to, int n) { std::memcpy(dst + from, d + to, n); });
    P::Masks(c, [&](int byte, int bit, int to, int to_bit) {
      dst[byte] |= static_cast<uint8_t>(((d[to + to_bit / 8] >> (to_bit % 8)) & 1) << bit);
    });
  });
}

void PanelRows::Pack(const QuantizedRowSet& a, int top, bool scaled) {
  const int k = a.src->k, nb = k / 32;
  m_ = a.m;
  row_bytes_ = static_cast<size_t>(nb) * kRowBlock;
  scaled_row_bytes_ = scaled ? static_cast<size_t>(nb) * kScaledBlock : 0;
  data_.resize(static_cast<size_t>(m_) * (row_bytes_ + scaled_row_bytes_));
  const auto pack = [&](int r0, int R) {
    uint8_t* g = data_.data() + static_cast<size_t>(r0) * row_bytes_;
    uint8_t* gs = data_.data() + static_cast<size_t>(m_) * row_bytes_ + static_cast<size_t>(r0) * scaled_row_bytes_;
    for (int r = 0; r < R; ++r) {
      const size_t row = a.row(r0 + r);
      const int8_t* q = a.src->q.data() + row * k;
      const float* s = a.src->scale.data() + row * nb;
      const int32_t* s16 = a.src->sum16.data() + row * (k / 16);
      const int32_t* s32 = a.src->sum32.data() + row * nb;
      for (int b = 0; b < nb; ++b) {
        uint8_t* x = g + static_cast<size_t>(b) * kRowBlock * R;
        std::memcpy(x + 32 * r, q + 32 * b, 32);
        std::memcpy(x + 32 * R + 4 * r, s + b, 4);
        std::memcpy(x + 36 * R + 4 * r, s32 + b, 4);
        std::memcpy(x + 40 * R + 8 * r, s16 + 2 * b, 8);
        if (scaled) {
          const float f[3] = {static_cast<float>(s32[b]) * s[b], static_cast<float>(s16[2 * b]) * s[b],
                              static_cast<float>(s16[2 * b + 1]) * s[b]};
          uint8_t* xs = gs + static_cast<size_t>(b) * kScaledBlock * R;
          std::memcpy(xs + 4 * r, &f[0], 4);
          std::memcpy(xs + 4 * R + 8 * r, &f[1], 8);
        }
      }
    }
  };
  // The groups Dot512 (top 8) and Dot256 (top 4) walk.
  int r0 = 0;
  for (; r0 + top <= m_; r0 += top) pack(r0, top);
  for (int R = top / 2; R >= 1; R /= 2)
    if (r0 + R <= m_) pack(r0, R), r0 += R;
}

void PanelDot(bool vnni, GgmlType t, const uint8_t* panel, int k, const PanelRows& a, float* out, int ldo) {
  WithFormat(t, [&](auto p) {
    using P = decltype(p);
    if (vnni) {
      Dot512<P>(panel, k, a, out, ldo);
    } else {
      Dot256<P>(panel, k, a, out, ldo);
    }
  });
}

}  // namespace qkv
