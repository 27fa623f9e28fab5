#include "engine/quant.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/bf16.h"

namespace qkv {
namespace {

constexpr int QK = 256;  // values per K-quant super-block

struct TypeInfo {
  GgmlType t;
  const char* name;
  uint64_t block, bytes;
  int f16_at[2];  // byte offsets of a block's f16 scale and minimum (−1: none)
};
constexpr TypeInfo kTypes[] = {
    {GgmlType::kF32, "f32", 1, 4, {-1, -1}},         {GgmlType::kF16, "f16", 1, 2, {-1, -1}},
    {GgmlType::kBF16, "bf16", 1, 2, {-1, -1}},       {GgmlType::kQ4_0, "q4_0", 32, 18, {0, -1}},
    {GgmlType::kQ4_1, "q4_1", 32, 20, {0, 2}},       {GgmlType::kQ5_0, "q5_0", 32, 22, {0, -1}},
    {GgmlType::kQ5_1, "q5_1", 32, 24, {0, 2}},       {GgmlType::kQ8_0, "q8_0", 32, 34, {0, -1}},
    {GgmlType::kQ2_K, "q2_k", QK, 84, {80, 82}},     {GgmlType::kQ3_K, "q3_k", QK, 110, {108, -1}},
    {GgmlType::kQ4_K, "q4_k", QK, 144, {0, 2}},      {GgmlType::kQ5_K, "q5_k", QK, 176, {0, 2}},
    {GgmlType::kQ6_K, "q6_k", QK, 210, {208, -1}},   {GgmlType::kIQ4_NL, "iq4_nl", 32, 18, {0, -1}},
    {GgmlType::kIQ4_XS, "iq4_xs", QK, 136, {0, -1}},
};

const TypeInfo* Info(GgmlType t) {
  for (const auto& i : kTypes)
    if (i.t == t) return &i;
  return nullptr;
}

// IQ4_NL / IQ4_XS code book.
constexpr int8_t kIq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

float H(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
}
void PutH(uint8_t* p, float v) {
  const uint16_t h = F32ToF16(v);
  std::memcpy(p, &h, 2);
}
// f16 round trip (what a stored scale becomes).
float R16(float v) { return F16ToF32(F32ToF16(v)); }

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes.
void ScaleMinK4(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
void PutScaleMinK4(uint8_t* s, const int* sc, const int* m) {
  std::memset(s, 0, 12);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      s[j] |= static_cast<uint8_t>(sc[j] & 63);
      s[j + 4] |= static_cast<uint8_t>(m[j] & 63);
    } else {
      s[j + 4] |= static_cast<uint8_t>((sc[j] & 0x0F) | ((m[j] & 0x0F) << 4));
      s[j - 4] |= static_cast<uint8_t>((sc[j] >> 4) << 6);
      s[j] |= static_cast<uint8_t>((m[j] >> 4) << 6);
    }
  }
}
// Q3_K: the 6-bit scale of sub-block j (0..15), minus 32.
int ScaleK3(const uint8_t* s, int j) {
  const int lo = j < 8 ? (s[j] & 0x0F) : (s[j - 8] >> 4);
  const int hi = (s[8 + (j % 4)] >> (2 * (j / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}
void PutScalesK3(uint8_t* s, const int* sc) {  // sc in [-32, 31]
  std::memset(s, 0, 12);
  for (int j = 0; j < 16; ++j) {
    const int u = sc[j] + 32;
    if (j < 8)
      s[j] |= static_cast<uint8_t>(u & 0x0F);
    else
      s[j - 8] |= static_cast<uint8_t>((u & 0x0F) << 4);
    s[8 + (j % 4)] |= static_cast<uint8_t>(((u >> 4) & 3) << (2 * (j / 4)));
  }
}
int ScaleIq4Xs(const uint8_t* blk, int j) {
  uint16_t sh;
  std::memcpy(&sh, blk + 2, 2);
  const int lo = (blk[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
  const int hi = (sh >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

// ---------------------------------------------------------------------------------------------------
// The integer view of one block: q[block] and per 16 values a scale and an offset. Each function also
// underlies DequantizeRow's index mapping, so the two cannot disagree on which value is which.

// Values of a 32-block whose 16 bytes hold value j in the low nibble of byte j and value j+16 in the high.
inline void Nibbles32(const uint8_t* qs, int8_t* q, int bias) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((qs[j] & 0x0F) - bias);
    q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - bias);
  }
}

// q values (before the scale) of a super-block, per type; sets per-16 scale and offset.
void DecodeBlock(GgmlType t, const uint8_t* b, int8_t* q, float* sc, float* off) {
  switch (t) {
    case GgmlType::kQ8_0: {
      const float d = H(b);
      std::memcpy(q, b + 2, 32);
      sc[0] = sc[1] = d;
      off[0] = off[1] = 0;
      return;
    }
    case GgmlType::kQ4_0:
    case GgmlType::kIQ4_NL: {
      const float d = H(b);
      if (t == GgmlType::kQ4_0) {
        Nibbles32(b + 2, q, 8);
      } else {
        for (int j = 0; j < 16; ++j) {
          q[j] = kIq4[b[2 + j] & 0x0F];
          q[j + 16] = kIq4[b[2 + j] >> 4];
        }
      }
      sc[0] = sc[1] = d;
      off[0] = off[1] = 0;
      return;
    }
    case GgmlType::kQ4_1: {
      const float d = H(b), m = H(b + 2);
      Nibbles32(b + 4, q, 0);
      sc[0] = sc[1] = d;
      off[0] = off[1] = -m;
      return;
    }
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1: {
      const bool one = t == GgmlType::kQ5_1;
      const float d = H(b), m = one ? H(b + 2) : 0.0f;
      const uint8_t* p = b + (one ? 4 : 2);
      uint32_t qh;
      std::memcpy(&qh, p, 4);
      const int bias = one ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<int8_t>(((p[4 + j] & 0x0F) | (((qh >> j) & 1) << 4)) - bias);
        q[j + 16] = static_cast<int8_t>(((p[4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
      }
      sc[0] = sc[1] = d;
      off[0] = off[1] = -m;
      return;
    }
    case GgmlType::kQ2_K: {
      const uint8_t* scales = b;
      const uint8_t* qs = b + 16;
      const float d = H(b + 80), dmin = H(b + 82);
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; ++l) q[h * 128 + s * 32 + l] = static_cast<int8_t>((qs[h * 32 + l] >> (2 * s)) & 3);
      for (int g = 0; g < 16; ++g) {
        sc[g] = d * static_cast<float>(scales[g] & 0x0F);
        off[g] = dmin * static_cast<float>(scales[g] >> 4);
      }
      return;
    }
    case GgmlType::kQ3_K: {
      const uint8_t* hm = b;
      const uint8_t* qs = b + 32;
      const uint8_t* scales = b + 96;
      const float d = H(b + 108);
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; ++l) {
            const int i = h * 128 + s * 32 + l;
            const int lo = (qs[h * 32 + l] >> (2 * s)) & 3;
            const int hb = (hm[l] >> (i / 32)) & 1;
            q[i] = static_cast<int8_t>(lo - (hb ? 0 : 4));
          }
      for (int g = 0; g < 16; ++g) {
        sc[g] = d * static_cast<float>(ScaleK3(scales, g));
        off[g] = 0;
      }
      return;
    }
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: {
      const bool five = t == GgmlType::kQ5_K;
      const float d = H(b), dmin = H(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int g = 0; g < 4; ++g)
        for (int s = 0; s < 2; ++s)
          for (int l = 0; l < 32; ++l) {
            const int i = g * 64 + s * 32 + l;
            int v = (qs[g * 32 + l] >> (4 * s)) & 0x0F;
            if (five) v |= ((qh[l] >> (i / 32)) & 1) << 4;
            q[i] = static_cast<int8_t>(v);
          }
      for (int j = 0; j < 8; ++j) {
        int scj, mj;
        ScaleMinK4(scales, j, &scj, &mj);
        sc[2 * j] = sc[2 * j + 1] = d * static_cast<float>(scj);
        off[2 * j] = off[2 * j + 1] = dmin * static_cast<float>(mj);
      }
      return;
    }
    case GgmlType::kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = H(b + 208);
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; ++l) {
            const int i = h * 128 + s * 32 + l;
            const int j = s * 32 + l;  // 0..127 within the half: ql byte j % 64, nibble j / 64
            const int lo = (ql[h * 64 + (j % 64)] >> (4 * (j / 64))) & 0x0F;
            const int hi = (qh[h * 32 + l] >> (2 * s)) & 3;
            q[i] = static_cast<int8_t>((lo | (hi << 4)) - 32);
          }
      for (int g = 0; g < 16; ++g) {
        sc[g] = d * static_cast<float>(scales[g]);
        off[g] = 0;
      }
      return;
    }
    case GgmlType::kIQ4_XS: {
      const float d = H(b);
      const uint8_t* qs = b + 8;
      for (int g = 0; g < 8; ++g) {
        for (int j = 0; j < 16; ++j) {
          q[g * 32 + j] = kIq4[qs[g * 16 + j] & 0x0F];
          q[g * 32 + 16 + j] = kIq4[qs[g * 16 + j] >> 4];
        }
        sc[2 * g] = sc[2 * g + 1] = d * static_cast<float>(ScaleIq4Xs(b, g));
        off[2 * g] = off[2 * g + 1] = 0;
      }
      return;
    }
    default: return;
  }
}

// ---------------------------------------------------------------------------------------------------
// Encoders. A "level set" is the integers a value may take (lo..hi), or the IQ4 code book.

struct Levels {
  int lo, hi;
  bool book = false;
  // The level nearest to v (v already divided by the scale).
  int Nearest(float v) const {
    if (!book) return std::clamp(static_cast<int>(std::nearbyint(v)), lo, hi);
    int best = 0;
    float bd = std::fabs(v - kIq4[0]);
    for (int i = 1; i < 16; ++i) {
      const float dd = std::fabs(v - kIq4[i]);
      if (dd < bd) bd = dd, best = i;
    }
    return best;  // an index into the book
  }
  float Value(int q) const { return book ? static_cast<float>(kIq4[q]) : static_cast<float>(q); }
  float MinV() const { return book ? kIq4[0] : static_cast<float>(lo); }
  float MaxV() const { return book ? kIq4[15] : static_cast<float>(hi); }
};

double SymErr(const float* x, int n, float d, const Levels& L) {
  if (d == 0) {
    double e = 0;
    for (int i = 0; i < n; ++i) e += double(x[i]) * x[i];
    return e;
  }
  const float id = 1.0f / d;
  double e = 0;
  for (int i = 0; i < n; ++i) {
    const float r = x[i] - d * L.Value(L.Nearest(x[i] * id));
    e += double(r) * r;
  }
  return e;
}

// The scale d minimising Σ (x − d·level(x/d))², among candidates that map the largest-magnitude value
// to either end of the level set at several stretches, each refined once by least squares. `round`
// applies the storage rounding of d (f16, or none for sub-block scales stored later).
float FitSym(const float* x, int n, const Levels& L, bool f16) {
  float xm = 0;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > std::fabs(xm)) xm = x[i];
  if (xm == 0) return 0;
  float best_d = 0;
  double best = SymErr(x, n, 0, L);
  auto consider = [&](float d) {
    if (f16) d = R16(d);
    if (!std::isfinite(d) || d == 0) return;
    const double e = SymErr(x, n, d, L);
    if (e < best) best = e, best_d = d;
  };
  for (float end : {L.MinV(), L.MaxV()}) {
    if (end == 0) continue;
    for (int k = -12; k <= 6; ++k) {
      const float d0 = xm / (end * (1.0f + 0.03f * static_cast<float>(k)));
      consider(d0);
      // least squares for the levels d0 chose
      const float id = 1.0f / d0;
      double sxq = 0, sqq = 0;
      for (int i = 0; i < n; ++i) {
        const float v = L.Value(L.Nearest(x[i] * id));
        sxq += double(x[i]) * v;
        sqq += double(v) * v;
      }
      if (sqq > 0) consider(static_cast<float>(sxq / sqq));
    }
  }
  return best_d;
}

// x ≈ d·q − m with q in [0, qmax] and m ≥ 0 (m = −min, clipped as ggml does); returns the pair with the
// least squared error among a stretch search and least-squares refits.
void FitMin(const float* x, int n, int qmax, float* d_out, float* m_out) {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < n; ++i) mn = std::min(mn, x[i]), mx = std::max(mx, x[i]);
  mn = std::min(mn, 0.0f);
  *d_out = 0, *m_out = -mn;
  if (mx <= mn) return;
  auto err = [&](float d, float m) {
    double e = 0;
    const float id = d > 0 ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; ++i) {
      const int q = std::clamp(static_cast<int>(std::nearbyint((x[i] + m) * id)), 0, qmax);
      const float r = x[i] - (d * static_cast<float>(q) - m);
      e += double(r) * r;
    }
    return e;
  };
  double best = err(0, -mn);
  float bd = 0, bm = -mn;
  for (int k = -8; k <= 8; ++k) {
    float d = (mx - mn) / (static_cast<float>(qmax) + 0.1f * static_cast<float>(k));
    float m = -mn;
    for (int it = 0; it < 2; ++it) {
      const double e = err(d, m);
      if (e < best) best = e, bd = d, bm = m;
      // least squares of x = d q − m over the chosen q
      const float id = 1.0f / d;
      double sq = 0, sqq = 0, sx = 0, sxq = 0;
      for (int i = 0; i < n; ++i) {
        const double q = std::clamp(static_cast<int>(std::nearbyint((x[i] + m) * id)), 0, qmax);
        sq += q, sqq += q * q, sx += x[i], sxq += x[i] * q;
      }
      const double det = n * sqq - sq * sq;
      if (det <= 0) break;
      const double nd = (n * sxq - sq * sx) / det;
      const double nm = -(sx - nd * sq) / n;
      if (nd <= 0) break;
      d = static_cast<float>(nd), m = static_cast<float>(std::max(0.0, nm));
    }
  }
  *d_out = bd, *m_out = bm;
}

// The integer scale for a float one relative to a super-block scale, clamped.
int QScale(float s, float d, int lo, int hi) {
  return d == 0 ? 0 : std::clamp(static_cast<int>(std::nearbyint(s / d)), lo, hi);
}

// A 32-value block's unsigned values at p: with `fifth`, the 32 fifth bits (u32) and then 16 nibble bytes,
// else the 16 nibble bytes (value j in the low nibble of byte j, value j + 16 in the high one).
void PackBlock32(const int* q, bool fifth, uint8_t* p) {
  if (fifth) {
    uint32_t qh = 0;
    for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>((q[j] >> 4) & 1) << j;
    std::memcpy(p, &qh, 4);
    p += 4;
  }
  for (int j = 0; j < 16; ++j) p[j] = static_cast<uint8_t>((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
}

void QuantizeBlock(GgmlType t, const float* x, uint8_t* b) {
  switch (t) {
    case GgmlType::kQ8_0: {
      // As ggml's reference: d = amax / 127, q = round(x / d).
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float d = amax / 127.0f;
      const float id = d != 0 ? 1.0f / d : 0.0f;
      PutH(b, d);
      for (int j = 0; j < 32; ++j) b[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::lround(x[j] * id)));
      return;
    }
    case GgmlType::kQ4_0:
    case GgmlType::kQ5_0:
    case GgmlType::kIQ4_NL: {
      const Levels L = t == GgmlType::kQ4_0   ? Levels{-8, 7}
                       : t == GgmlType::kQ5_0 ? Levels{-16, 15}
                                              : Levels{0, 15, true};
      const float d = FitSym(x, 32, L, true);
      PutH(b, d);
      const float id = d != 0 ? 1.0f / d : 0.0f;
      int q[32];
      for (int j = 0; j < 32; ++j) q[j] = L.Nearest(x[j] * id) - (L.book ? 0 : L.lo);
      PackBlock32(q, t == GgmlType::kQ5_0, b + 2);
      return;
    }
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1: {
      const int qmax = t == GgmlType::kQ4_1 ? 15 : 31;
      // x ≈ d q + m with m the stored min (may be positive here: ggml does not clip it for these types)
      float mn = x[0], mx = x[0];
      for (int j = 1; j < 32; ++j) mn = std::min(mn, x[j]), mx = std::max(mx, x[j]);
      float best_d = R16((mx - mn) / static_cast<float>(qmax)), best_m = R16(mn);
      double best = 1e300;
      auto eval = [&](float d, float m) {
        d = R16(d), m = R16(m);
        const float id = d != 0 ? 1.0f / d : 0.0f;
        double e = 0;
        for (int j = 0; j < 32; ++j) {
          const int q = std::clamp(static_cast<int>(std::nearbyint((x[j] - m) * id)), 0, qmax);
          const float r = x[j] - (d * static_cast<float>(q) + m);
          e += double(r) * r;
        }
        if (e < best) best = e, best_d = d, best_m = m;
      };
      eval((mx - mn) / static_cast<float>(qmax), mn);
      float dd, mm;
      std::array<float, 32> shifted;
      for (int j = 0; j < 32; ++j) shifted[j] = x[j] - mn;
      FitMin(shifted.data(), 32, qmax, &dd, &mm);
      eval(dd, mn - mm);
      const float d = best_d, m = best_m;
      PutH(b, d);
      PutH(b + 2, m);
      const float id = d != 0 ? 1.0f / d : 0.0f;
      int q[32];
      for (int j = 0; j < 32; ++j) q[j] = std::clamp(static_cast<int>(std::nearbyint((x[j] - m) * id)), 0, qmax);
      PackBlock32(q, t == GgmlType::kQ5_1, b + 4);
      return;
    }
    case GgmlType::kQ2_K:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: {
      const bool two = t == GgmlType::kQ2_K;
      const int sub = two ? 16 : 32, nsub = QK / sub, qmax = two ? 3 : t == GgmlType::kQ4_K ? 15 : 31;
      const int smax = two ? 15 : 63;
      float s[16], m[16], smx = 0, mmx = 0;
      for (int j = 0; j < nsub; ++j) {
        FitMin(x + j * sub, sub, qmax, &s[j], &m[j]);
        smx = std::max(smx, s[j]), mmx = std::max(mmx, m[j]);
      }
      const float d = R16(smx / static_cast<float>(smax)), dmin = R16(mmx / static_cast<float>(smax));
      int isc[16], imn[16];
      for (int j = 0; j < nsub; ++j) isc[j] = QScale(s[j], d, 0, smax), imn[j] = QScale(m[j], dmin, 0, smax);
      int q[QK];
      for (int j = 0; j < nsub; ++j) {
        // The integer scale and min nearest the float fit, or a neighbour of each if that fits better.
        const float* xs = x + j * sub;
        auto err = [&](int sc, int mn, int* out) {
          const float S = d * static_cast<float>(sc), M = dmin * static_cast<float>(mn);
          const float iS = S != 0 ? 1.0f / S : 0.0f;
          double e = 0;
          for (int l = 0; l < sub; ++l) {
            const int v = std::clamp(static_cast<int>(std::nearbyint((xs[l] + M) * iS)), 0, qmax);
            if (out) out[l] = v;
            const float r = xs[l] - (S * static_cast<float>(v) - M);
            e += double(r) * r;
          }
          return e;
        };
        int bs = isc[j], bm = imn[j];
        double best = err(bs, bm, nullptr);
        for (int ds = -1; ds <= 1; ++ds)
          for (int dm = -1; dm <= 1; ++dm) {
            const int sc = isc[j] + ds, mn = imn[j] + dm;
            if ((ds == 0 && dm == 0) || sc < 0 || sc > smax || mn < 0 || mn > smax) continue;
            const double e = err(sc, mn, nullptr);
            if (e < best) best = e, bs = sc, bm = mn;
          }
        isc[j] = bs, imn[j] = bm;
        err(bs, bm, q + j * sub);
      }
      if (two) {
        for (int j = 0; j < 16; ++j) b[j] = static_cast<uint8_t>(isc[j] | (imn[j] << 4));
        uint8_t* qs = b + 16;
        std::memset(qs, 0, 64);
        for (int h = 0; h < 2; ++h)
          for (int sft = 0; sft < 4; ++sft)
            for (int l = 0; l < 32; ++l) qs[h * 32 + l] |= static_cast<uint8_t>(q[h * 128 + sft * 32 + l] << (2 * sft));
        PutH(b + 80, d);
        PutH(b + 82, dmin);
      } else {
        PutH(b, d);
        PutH(b + 2, dmin);
        PutScaleMinK4(b + 4, isc, imn);
        const bool five = t == GgmlType::kQ5_K;
        uint8_t* qh = b + 16;
        uint8_t* qs = b + (five ? 48 : 16);
        if (five) std::memset(qh, 0, 32);
        for (int g = 0; g < 4; ++g)
          for (int l = 0; l < 32; ++l) {
            const int a = q[g * 64 + l], c = q[g * 64 + 32 + l];
            qs[g * 32 + l] = static_cast<uint8_t>((a & 0x0F) | ((c & 0x0F) << 4));
            if (five) {
              qh[l] |= static_cast<uint8_t>(((a >> 4) & 1) << (2 * g));
              qh[l] |= static_cast<uint8_t>(((c >> 4) & 1) << (2 * g + 1));
            }
          }
      }
      return;
    }
    case GgmlType::kQ3_K:
    case GgmlType::kQ6_K:
    case GgmlType::kIQ4_XS: {
      const int sub = t == GgmlType::kIQ4_XS ? 32 : 16, nsub = QK / sub;
      const Levels L = t == GgmlType::kQ3_K   ? Levels{-4, 3}
                       : t == GgmlType::kQ6_K ? Levels{-32, 31}
                                              : Levels{0, 15, true};
      const int slo = t == GgmlType::kQ6_K ? -128 : -32, shi = t == GgmlType::kQ6_K ? 127 : 31;
      float s[16], amax = 0, smx = 0;
      for (int j = 0; j < nsub; ++j) {
        s[j] = FitSym(x + j * sub, sub, L, false);
        if (std::fabs(s[j]) > amax) amax = std::fabs(s[j]), smx = s[j];
      }
      // The super-block scale maps the largest sub-scale to the negative end (one more step there).
      const float d = R16(smx / static_cast<float>(slo));
      int isc[16], q[QK];
      for (int j = 0; j < nsub; ++j) {
        isc[j] = QScale(s[j], d, slo, shi);
        const float S = d * static_cast<float>(isc[j]);
        const float iS = S != 0 ? 1.0f / S : 0.0f;
        for (int l = 0; l < sub; ++l) q[j * sub + l] = L.Nearest(x[j * sub + l] * iS);
      }
      if (t == GgmlType::kQ6_K) {
        uint8_t* ql = b;
        uint8_t* qh = b + 128;
        std::memset(b, 0, 192);
        for (int h = 0; h < 2; ++h)
          for (int sft = 0; sft < 4; ++sft)
            for (int l = 0; l < 32; ++l) {
              const int jj = sft * 32 + l;
              const int u = q[h * 128 + jj] + 32;
              ql[h * 64 + (jj % 64)] |= static_cast<uint8_t>((u & 0x0F) << (4 * (jj / 64)));
              qh[h * 32 + l] |= static_cast<uint8_t>((u >> 4) << (2 * sft));
            }
        for (int j = 0; j < 16; ++j) b[192 + j] = static_cast<uint8_t>(static_cast<int8_t>(isc[j]));
        PutH(b + 208, d);
      } else if (t == GgmlType::kQ3_K) {
        uint8_t* hm = b;
        uint8_t* qs = b + 32;
        std::memset(b, 0, 96);
        for (int h = 0; h < 2; ++h)
          for (int sft = 0; sft < 4; ++sft)
            for (int l = 0; l < 32; ++l) {
              const int i = h * 128 + sft * 32 + l;
              const int u = q[i] + 4;  // 0..7: low two bits, and the high bit set when u >= 4
              qs[h * 32 + l] |= static_cast<uint8_t>((u & 3) << (2 * sft));
              if (u >= 4) hm[l] |= static_cast<uint8_t>(1 << (i / 32));
            }
        PutScalesK3(b + 96, isc);
        PutH(b + 108, d);
      } else {
        PutH(b, d);
        uint16_t sh = 0;
        std::memset(b + 4, 0, 4);
        for (int j = 0; j < 8; ++j) {
          const int u = isc[j] + 32;
          b[4 + j / 2] |= static_cast<uint8_t>((u & 0x0F) << (4 * (j % 2)));
          sh |= static_cast<uint16_t>(((u >> 4) & 3) << (2 * j));
        }
        std::memcpy(b + 2, &sh, 2);
        for (int g = 0; g < 8; ++g)
          for (int j = 0; j < 16; ++j)
            b[8 + g * 16 + j] = static_cast<uint8_t>(q[g * 32 + j] | (q[g * 32 + 16 + j] << 4));
      }
      return;
    }
    default: return;
  }
}

}  // namespace

bool GgmlTypeKnown(uint32_t t) {
  for (const auto& i : kTypes)
    if (static_cast<uint32_t>(i.t) == t) return true;
  return false;
}

const char* GgmlTypeName(GgmlType t) {
  const TypeInfo* i = Info(t);
  return i ? i->name : "?";
}

std::optional<GgmlType> GgmlTypeFromName(const std::string& s) {
  std::string l;
  for (char c : s) l += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const auto& i : kTypes)
    if (l == i.name) return i.t;
  return std::nullopt;
}

uint64_t GgmlBlockSize(GgmlType t) {
  const TypeInfo* i = Info(t);
  return i ? i->block : 1;
}
uint64_t GgmlBlockBytes(GgmlType t) {
  const TypeInfo* i = Info(t);
  return i ? i->bytes : 0;
}

bool GgmlValuesFinite(GgmlType t, const uint8_t* src, int64_t n) {
  // An f16 or bf16 is not finite when its exponent bits are all ones.
  auto all_finite16 = [&](uint16_t exp_mask, int64_t count, int64_t stride, int at) {
    for (int64_t i = 0; i < count; ++i) {
      uint16_t h;
      std::memcpy(&h, src + i * stride + at, 2);
      if ((h & exp_mask) == exp_mask) return false;
    }
    return true;
  };
  switch (t) {
    case GgmlType::kF32: {
      for (int64_t i = 0; i < n; ++i) {
        float v;
        std::memcpy(&v, src + 4 * i, 4);
        if (!std::isfinite(v)) return false;
      }
      return true;
    }
    case GgmlType::kF16: return all_finite16(0x7c00, n, 2, 0);
    case GgmlType::kBF16: return all_finite16(0x7f80, n, 2, 0);
    default: break;
  }
  const TypeInfo* info = Info(t);
  if (!info) return false;
  const auto blocks = n / static_cast<int64_t>(info->block), bb = static_cast<int64_t>(info->bytes);
  for (int at : info->f16_at) {
    if (at >= 0 && !all_finite16(0x7c00, blocks, bb, at)) return false;
  }
  return true;
}

GgmlType GgmlFallbackType(GgmlType t, uint64_t ncols) {
  if (ncols % GgmlBlockSize(t) == 0) return t;
  GgmlType f = GgmlType::kF16;
  switch (t) {
    case GgmlType::kIQ4_XS: f = GgmlType::kIQ4_NL; break;
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K: f = GgmlType::kQ4_0; break;
    case GgmlType::kQ4_K: f = GgmlType::kQ5_0; break;
    case GgmlType::kQ5_K: f = GgmlType::kQ5_1; break;
    case GgmlType::kQ6_K: f = GgmlType::kQ8_0; break;
    default: break;
  }
  return ncols % GgmlBlockSize(f) == 0 ? f : GgmlType::kF16;
}

uint32_t GgmlFileType(GgmlType t) {
  switch (t) {
    case GgmlType::kF32: return 0;
    case GgmlType::kF16: return 1;
    case GgmlType::kQ4_0: return 2;
    case GgmlType::kQ4_1: return 3;
    case GgmlType::kQ8_0: return 7;
    case GgmlType::kQ5_0: return 8;
    case GgmlType::kQ5_1: return 9;
    case GgmlType::kQ2_K: return 10;
    case GgmlType::kQ3_K: return 11;
    case GgmlType::kQ4_K: return 14;
    case GgmlType::kQ5_K: return 16;
    case GgmlType::kQ6_K: return 18;
    case GgmlType::kIQ4_NL: return 25;
    case GgmlType::kIQ4_XS: return 30;
    case GgmlType::kBF16: return 32;
  }
  return 0;
}

void DequantizeRow(GgmlType t, const uint8_t* src, int64_t n, float* dst) {
  switch (t) {
    case GgmlType::kF32: std::memcpy(dst, src, n * 4); return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = H(src + 2 * i);
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = Bf16ToF32(h);
      }
      return;
    default: break;
  }
  const int64_t bs = static_cast<int64_t>(GgmlBlockSize(t)), bb = static_cast<int64_t>(GgmlBlockBytes(t));
  int8_t q[QK];
  float sc[16], off[16];
  for (int64_t blk = 0; blk < n / bs; ++blk) {
    const uint8_t* b = src + blk * bb;
    float* y = dst + blk * bs;
    DecodeBlock(t, b, q, sc, off);
    // The operations of gguf-py's numpy code, in its order and without fused multiply-adds.
    switch (t) {
      case GgmlType::kQ4_1:
      case GgmlType::kQ5_1: {  // d * q + m, q unsigned
        const float d = H(b), m = H(b + 2);
        for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j]) + m;
        break;
      }
      case GgmlType::kQ2_K:
      case GgmlType::kQ4_K:
      case GgmlType::kQ5_K:  // (d * sc) * q - (dmin * m)
        for (int j = 0; j < bs; ++j) y[j] = sc[j / 16] * static_cast<float>(q[j]) - off[j / 16];
        break;
      default:  // (d [* sc]) * q
        for (int j = 0; j < bs; ++j) y[j] = sc[j / 16] * static_cast<float>(q[j]);
        break;
    }
  }
}

void QuantizeRow(GgmlType t, const float* src, int64_t n, uint8_t* dst) {
  switch (t) {
    case GgmlType::kF32: std::memcpy(dst, src, n * 4); return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) PutH(dst + 2 * i, src[i]);
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = F32ToBf16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    default: break;
  }
  const int64_t bs = static_cast<int64_t>(GgmlBlockSize(t)), bb = static_cast<int64_t>(GgmlBlockBytes(t));
  for (int64_t blk = 0; blk < n / bs; ++blk) QuantizeBlock(t, src + blk * bs, dst + blk * bb);
}

bool DecodeRowI8(GgmlType t, const uint8_t* src, int64_t n, int8_t* q, float* scale, float* offset) {
  const int64_t bs = static_cast<int64_t>(GgmlBlockSize(t)), bb = static_cast<int64_t>(GgmlBlockBytes(t));
  for (int64_t blk = 0; blk < n / bs; ++blk) {
    DecodeBlock(t, src + blk * bb, q + blk * bs, scale + blk * bs / 16, offset + blk * bs / 16);
  }
  return t == GgmlType::kQ4_1 || t == GgmlType::kQ5_1 || t == GgmlType::kQ2_K || t == GgmlType::kQ4_K ||
         t == GgmlType::kQ5_K;
}

}  // namespace qkv
