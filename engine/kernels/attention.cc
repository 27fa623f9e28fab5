#include "engine/kernels/attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/bf16.h"
#include "engine/kernels/cpu.h"
#include "engine/kernels/ops.h"
#include "engine/kernels/weighted_sum.h"

namespace qkv {

// Converts n cache elements to f32 (a plain copy for f32 caches).
void KvToF32(const uint8_t* src, int n, DType dt, float* dst) {
  if (dt == DType::kF32) {
    std::memcpy(dst, src, sizeof(float) * n);
    return;
  }
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (int i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

// int8 KV: one symmetric scale per cached vector, rounded to bf16; the int8 values are then rounded
// against the stored scale (round half to even, as torch.round), so value ≈ q × scale with
// |error| ≤ scale / 2. An all-zero vector has scale 0; a non-finite one gets a NaN scale (and q = 0), so it
// poisons the attention that reads it as a bf16 cache would.
void QuantizeKvI8(const float* x, int n, int8_t* q, size_t stride, uint8_t* scale_out) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    finite &= std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  uint16_t sb = finite ? F32ToBf16(amax / 127.0f) : uint16_t{0x7fc0};
  const float sc = Bf16ToF32(sb);
  for (int i = 0; i < n; ++i) {
    const float r = finite && sc > 0.0f ? std::nearbyint(x[i] / sc) : 0.0f;
    q[i * stride] = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
  }
  std::memcpy(scale_out, &sb, 2);
}

void KvI8Scales(const uint8_t* region, int bs, int width, int n, float mul, float* out) {
  const uint8_t* p = region + static_cast<size_t>(bs) * width;
  for (int j = 0; j < n; ++j) {
    uint16_t h;
    std::memcpy(&h, p + 2 * j, 2);
    out[j] = Bf16ToF32(h) * mul;
  }
}

void StoreKvElement(uint8_t* dst, size_t index, float v, DType dt) {
  if (dt == DType::kF32) {
    std::memcpy(dst + 4 * index, &v, 4);
  } else {
    const uint16_t h = F32ToBf16(v);
    std::memcpy(dst + 2 * index, &h, 2);
  }
}

namespace {

// The K/V asks of decode attention: into L2 or L1, as the core prefers (KvPrefetchL2, cpu.h).
const bool kKvPrefetchL2 = KvPrefetchL2();
inline void PrefetchKv(const char* p) {
  if (kKvPrefetchL2) {
    _mm_prefetch(p, _MM_HINT_T1);
  } else {
    _mm_prefetch(p, _MM_HINT_T0);
  }
}

using kernels::I8x8ToF32;
using kernels::LoadI8x16;
using kernels::LoadI8x8;
using kernels::LoadRow16;
using kernels::LoadRow8;
using kernels::WeightedSumTile16;
using kernels::WeightedSumTile8;

inline void Store(uint8_t* dst, size_t index, float v, DType dt) { StoreKvElement(dst, index, v, dt); }

// Scores of NH heads against one block of 16 transposed keys: per head two 8-lane FMA chains over the dims,
// each key row loaded once for the NH heads (independent chains: one head's chain alone is latency-bound).
template <int NH>
inline void BlockScores16(const float* const* q, const float* kt, int hd, float scale, float* const* sc) {
  __m256 a[NH][2];
  for (int h = 0; h < NH; ++h) a[h][0] = a[h][1] = _mm256_setzero_ps();
  for (int d = 0; d < hd; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * 16), k1 = _mm256_loadu_ps(kt + d * 16 + 8);
    for (int h = 0; h < NH; ++h) {
      const __m256 qd = _mm256_broadcast_ss(q[h] + d);
      a[h][0] = _mm256_fmadd_ps(qd, k0, a[h][0]);
      a[h][1] = _mm256_fmadd_ps(qd, k1, a[h][1]);
    }
  }
  const __m256 s = _mm256_set1_ps(scale);
  for (int h = 0; h < NH; ++h) {
    _mm256_storeu_ps(sc[h], _mm256_mul_ps(a[h][0], s));
    _mm256_storeu_ps(sc[h] + 8, _mm256_mul_ps(a[h][1], s));
  }
}

// o += Σ_j w[j] · v[j] over nj rows of HD values, with the HD accumulators in registers.
template <int HD>
inline void WeightedSum(const float* w, const float* v, int nj, float* o) {
  float acc[HD];
  for (int d = 0; d < HD; ++d) acc[d] = o[d];
  for (int j = 0; j < nj; ++j) {
    const float wj = w[j];
    for (int d = 0; d < HD; ++d) acc[d] += wj * v[j * HD + d];
  }
  for (int d = 0; d < HD; ++d) o[d] = acc[d];
}

inline void QuantizeI8(const float* x, int n, int8_t* q, size_t stride, uint8_t* scale_out) {
  QuantizeKvI8(x, n, q, stride, scale_out);
}

// Scores of NH heads against one block of 16 int8 keys stored transposed ([hd][16]): each key row is
// converted once in registers and shared by the heads; then × the slot's scale × 1/sqrt(hd).
template <int NH>
inline void BlockScoresI8x16(const float* const* q, const int8_t* kt, int hd, const float* slot_mul, float* const* sc) {
  __m256 a[NH][2];
  for (int h = 0; h < NH; ++h) a[h][0] = a[h][1] = _mm256_setzero_ps();
  for (int d = 0; d < hd; ++d) {
    const __m256 k0 = I8x8ToF32(kt + d * 16), k1 = I8x8ToF32(kt + d * 16 + 8);
    for (int h = 0; h < NH; ++h) {
      const __m256 qd = _mm256_broadcast_ss(q[h] + d);
      a[h][0] = _mm256_fmadd_ps(qd, k0, a[h][0]);
      a[h][1] = _mm256_fmadd_ps(qd, k1, a[h][1]);
    }
  }
  const __m256 m0 = _mm256_loadu_ps(slot_mul), m1 = _mm256_loadu_ps(slot_mul + 8);
  for (int h = 0; h < NH; ++h) {
    _mm256_storeu_ps(sc[h], _mm256_mul_ps(a[h][0], m0));
    _mm256_storeu_ps(sc[h] + 8, _mm256_mul_ps(a[h][1], m1));
  }
}

// NH heads with up to 8 accumulators (16 ymm registers); hd is a multiple of 16.
template <int NH, class Load>
inline void WeightedSumHeads8(const float* const* w, const Load& load, int nj, int hd, float* const* o) {
  if constexpr (NH == 1) {
    if (hd % 64 == 0) return WeightedSumTile8<1, 8>(w, load, nj, hd, 0, hd, o);
  }
  if constexpr (NH <= 2) {
    if (hd % 32 == 0) return WeightedSumTile8<NH, 4>(w, load, nj, hd, 0, hd, o);
  }
  WeightedSumTile8<NH, 2>(w, load, nj, hd, 0, hd, o);
}
// Heads [0, n), 4 at a time.
template <class Load>
inline void WeightedSum8(const float* const* w, int n, const Load& load, int nj, int hd, float* const* o) {
  int h = 0;
  for (; h + 4 <= n; h += 4) WeightedSumHeads8<4>(w + h, load, nj, hd, o + h);
  switch (n - h) {
    case 3: WeightedSumHeads8<3>(w + h, load, nj, hd, o + h); break;
    case 2: WeightedSumHeads8<2>(w + h, load, nj, hd, o + h); break;
    case 1: WeightedSumHeads8<1>(w + h, load, nj, hd, o + h); break;
    default: break;
  }
}

// Kernels::ScoresI8x16 for n heads, 1 ≤ n ≤ N.
template <class Kernels, int N>
inline void ScoresI8x16Of(int n, const float* const* q, const int8_t* kt, int hd, const float* slot_mul,
                          float* const* sc) {
  if constexpr (N > 1) {
    if (n < N) return ScoresI8x16Of<Kernels, N - 1>(n, q, kt, hd, slot_mul, sc);
  }
  Kernels::template ScoresI8x16<N>(q, kt, hd, slot_mul, sc);
}

// Pass 1 on an int8 block for the group's heads: scores[hh][j] = (q_hh · k_int_j) × s_j / sqrt(hd).
template <class Kernels>
inline void BlockScoresI8(const float* const* q, int group, const uint8_t* region, int hd, int bs, float scale,
                          float* slot_mul, float* const* sc) {
  KvI8Scales(region, bs, hd, bs, scale, slot_mul);
  const auto* kt = reinterpret_cast<const int8_t*>(region);
  if (bs == 16) {
    constexpr int KH = Kernels::kI8ScoreHeads;
    int h = 0;
    for (; h + KH <= group; h += KH) Kernels::template ScoresI8x16<KH>(q + h, kt, hd, slot_mul, sc + h);
    if (h < group) ScoresI8x16Of<Kernels, KH - 1>(group - h, q + h, kt, hd, slot_mul, sc + h);
    return;
  }
  for (int hh = 0; hh < group; ++hh) {
    for (int j = 0; j < bs; ++j) {
      float a = 0.0f;
      for (int d = 0; d < hd; ++d) a += q[hh][d] * static_cast<float>(kt[static_cast<size_t>(d) * bs + j]);
      sc[hh][j] = a * slot_mul[j];
    }
  }
}

// Pass 2 on an int8 block: w[hh][j] is first multiplied by the value's scale s_j (in place), then
// o_hh += Σ_j w[hh][j] · v_int_j.
template <class Kernels>
inline void WeightedSumI8Block(float* const* w, int group, const uint8_t* region, int hd, int bs, int nj, float* vmul,
                               float* const* o) {
  KvI8Scales(region, bs, hd, nj, 1.0f, vmul);
  for (int hh = 0; hh < group; ++hh)
    for (int j = 0; j < nj; ++j) w[hh][j] *= vmul[j];
  const auto* v = reinterpret_cast<const int8_t*>(region);
  const float* const* wc = w;
  if (hd % 16 != 0) {
    for (int hh = 0; hh < group; ++hh)
      for (int j = 0; j < nj; ++j)
        for (int d = 0; d < hd; ++d) o[hh][d] += wc[hh][j] * static_cast<float>(v[static_cast<size_t>(j) * hd + d]);
    return;
  }
  Kernels::SumI8(wc, group, v, nj, hd, o);
}

// LoadRow8 that also asks for the line at the same offset from pf, once per 64 bytes read (AttendDirect: pf
// is the region kDirectAhead blocks on).
template <bool BF16>
struct LoadRow8Pf {
  LoadRow8<BF16> in;
  const uint8_t* pf;
  __m256 operator()(size_t i) const {
    constexpr size_t kEl = BF16 ? 2 : 4;
    if ((i * kEl) % 64 == 0) PrefetchKv(reinterpret_cast<const char*>(pf + i * kEl));
    return in(i);
  }
};

// The f32/bf16 kernels of AttendBody at each kernel level (kernels/cpu.h). Both give the same bits: every
// lane of a score is one key's FMA chain over the dims in order, then × scale; every output element one FMA
// chain over the positions in order; FastExp16 runs FastExp8's operations lane by lane; bf16 → f32 and max
// are exact. tests/attention_test.cc compares the two levels bit for bit.
struct Avx2Kernels {
  static constexpr int kI8ScoreHeads = 4;  // heads per int8 score tile: 2 ymm accumulators each
  static void ToF32(const uint8_t* src, int n, DType dt, float* dst) { KvToF32(src, n, dt, dst); }
  // Scores of heads [0, n) against a block of 16 transposed f32 keys, 4 heads at a time.
  static void Scores16(const float* const* q, int n, const float* kt, int hd, float scale, float* const* sc) {
    int h = 0;
    for (; h + 4 <= n; h += 4) BlockScores16<4>(q + h, kt, hd, scale, sc + h);
    switch (n - h) {
      case 3: BlockScores16<3>(q + h, kt, hd, scale, sc + h); break;
      case 2: BlockScores16<2>(q + h, kt, hd, scale, sc + h); break;
      case 1: BlockScores16<1>(q + h, kt, hd, scale, sc + h); break;
      default: break;
    }
  }
  // sc[j] = e^(sc[j] - m) for whole 8-lane vectors over [0, n) (the row is padded to them).
  static void ExpShift(float* sc, int n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    for (int j = 0; j < n; j += 8) _mm256_storeu_ps(sc + j, FastExp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv)));
  }
  template <int HD>
  static void WeightedSum(const float* w, const float* v, int nj, float* o) {
    qkv::WeightedSum<HD>(w, v, nj, o);
  }
  // f32/bf16 blocks read in registers (AttendDirect), as Avx512Kernels' with two 8-lane halves per 16 lanes.
  template <int NH, int NB, bool BF16>
  static void ScoresTile(const float* const* q, const uint8_t* const* kt, int hd, float scale, float* const* sc,
                         int sc_off, const uint8_t* const* pf) {
    __m256 a[NB][NH][2];
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < NH; ++h) a[b][h][0] = a[b][h][1] = _mm256_setzero_ps();
    constexpr size_t kRow = BF16 ? 32 : 64;  // bytes of one dim's 16 keys
    for (int d = 0; d < hd; ++d) {
      if (pf != nullptr && (d * kRow) % 64 == 0)
        for (int b = 0; b < NB; ++b) PrefetchKv(reinterpret_cast<const char*>(pf[b] + d * kRow));
      __m256 k[NB][2];
      for (int b = 0; b < NB; ++b) {
        k[b][0] = LoadRow8<BF16>{kt[b]}(static_cast<size_t>(d) * 16);
        k[b][1] = LoadRow8<BF16>{kt[b]}(static_cast<size_t>(d) * 16 + 8);
      }
      for (int h = 0; h < NH; ++h) {
        const __m256 qd = _mm256_broadcast_ss(q[h] + d);
        for (int b = 0; b < NB; ++b) {
          a[b][h][0] = _mm256_fmadd_ps(qd, k[b][0], a[b][h][0]);
          a[b][h][1] = _mm256_fmadd_ps(qd, k[b][1], a[b][h][1]);
        }
      }
    }
    const __m256 s = _mm256_set1_ps(scale);
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < NH; ++h) {
        _mm256_storeu_ps(sc[h] + sc_off + 16 * b, _mm256_mul_ps(a[b][h][0], s));
        _mm256_storeu_ps(sc[h] + sc_off + 16 * b + 8, _mm256_mul_ps(a[b][h][1], s));
      }
  }
  template <int NH, int NB, bool BF16>
  static void ScoresHeads(const float* const* q, const uint8_t* const* kt, int nb, int hd, float scale,
                          float* const* sc, const uint8_t* const* pf) {
    int b = 0;
    for (; b + NB <= nb; b += NB) ScoresTile<NH, NB, BF16>(q, kt + b, hd, scale, sc, 16 * b, pf ? pf + b : nullptr);
    for (; b < nb; ++b) ScoresTile<NH, 1, BF16>(q, kt + b, hd, scale, sc, 16 * b, pf ? pf + b : nullptr);
  }
  // pf: nullptr, or per block the address to prefetch from as its keys are read (the first tile of heads
  // reads the blocks from memory; the others find them in cache).
  template <bool BF16>
  static void ScoresBlocks(const float* const* q, int n, const uint8_t* const* kt, int nb, int hd, float scale,
                           float* const* sc, const uint8_t* const* pf) {
    int h = 0;
    for (; h + 4 <= n; h += 4) ScoresHeads<4, 1, BF16>(q + h, kt, nb, hd, scale, sc + h, h == 0 ? pf : nullptr);
    const uint8_t* const* pf_rest = h == 0 ? pf : nullptr;
    switch (n - h) {
      case 3: ScoresHeads<3, 1, BF16>(q + h, kt, nb, hd, scale, sc + h, pf_rest); break;
      case 2: ScoresHeads<2, 2, BF16>(q + h, kt, nb, hd, scale, sc + h, pf_rest); break;
      case 1: ScoresHeads<1, 4, BF16>(q + h, kt, nb, hd, scale, sc + h, pf_rest); break;
      default: break;
    }
  }
  // hd is a multiple of 16; v: one block's values, [nj][hd]; pf: nullptr, or where to prefetch from as v is read.
  template <bool BF16>
  static void SumBlock(const float* const* w, int n, const uint8_t* v, int nj, int hd, float* const* o,
                       const uint8_t* pf) {
    if (pf != nullptr) return WeightedSum8(w, n, LoadRow8Pf<BF16>{{v}, pf}, nj, hd, o);
    WeightedSum8(w, n, LoadRow8<BF16>{v}, nj, hd, o);
  }
  template <int NH>
  static void ScoresI8x16(const float* const* q, const int8_t* kt, int hd, const float* slot_mul, float* const* sc) {
    BlockScoresI8x16<NH>(q, kt, hd, slot_mul, sc);
  }
  // hd is a multiple of 16.
  static void SumI8(const float* const* w, int group, const int8_t* v, int nj, int hd, float* const* o) {
    WeightedSum8(w, group, LoadI8x8{v}, nj, hd, o);
  }
};

QKV_AVX512 inline __m512 FastExp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // floor
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

template <int NH, class Load>
QKV_AVX512 inline void WeightedSumHeads16(const float* const* w, const Load& load, int nj, int hd, float* const* o) {
  if constexpr (NH <= 4) {
    if (hd % 64 == 0) return WeightedSumTile16<NH, 4>(w, load, nj, hd, 0, hd, o);
  }
  if (hd % 32 == 0) return WeightedSumTile16<NH, 2>(w, load, nj, hd, 0, hd, o);
  WeightedSumTile16<NH, 1>(w, load, nj, hd, 0, hd, o);
}
template <class Load>
QKV_AVX512 inline void WeightedSum16(const float* const* w, int n, const Load& load, int nj, int hd, float* const* o) {
  int h = 0;
  for (; h + 8 <= n; h += 8) WeightedSumHeads16<8>(w + h, load, nj, hd, o + h);
  if (h + 4 <= n) WeightedSumHeads16<4>(w + h, load, nj, hd, o + h), h += 4;
  switch (n - h) {
    case 3: WeightedSumHeads16<3>(w + h, load, nj, hd, o + h); break;
    case 2: WeightedSumHeads16<2>(w + h, load, nj, hd, o + h); break;
    case 1: WeightedSumHeads16<1>(w + h, load, nj, hd, o + h); break;
    default: break;
  }
}

// LoadRow8Pf with 16 lanes.
template <bool BF16>
struct LoadRow16Pf {
  LoadRow16<BF16> in;
  const uint8_t* pf;
  QKV_AVX512 __m512 operator()(size_t i) const {
    constexpr size_t kEl = BF16 ? 2 : 4;
    if ((i * kEl) % 64 == 0) PrefetchKv(reinterpret_cast<const char*>(pf + i * kEl));
    return in(i);
  }
};

struct Avx512Kernels {
  static constexpr int kI8ScoreHeads = 8;  // one zmm accumulator each: 8 chains in flight
  QKV_AVX512 static void ToF32(const uint8_t* src, int n, DType dt, float* dst) {
    if (dt == DType::kF32) {
      std::memcpy(dst, src, sizeof(float) * n);
      return;
    }
    const auto* s = reinterpret_cast<const uint16_t*>(src);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    for (; i < n; ++i) dst[i] = Bf16ToF32(s[i]);
  }
  // One 16-lane FMA chain per head over the dims, 8 heads at a time sharing each key row load.
  template <int NH>
  QKV_AVX512 static void Scores16Tile(const float* const* q, const float* kt, int hd, float scale, float* const* sc) {
    __m512 a[NH];
    for (int h = 0; h < NH; ++h) a[h] = _mm512_setzero_ps();
    for (int d = 0; d < hd; ++d) {
      const __m512 k = _mm512_loadu_ps(kt + d * 16);
      for (int h = 0; h < NH; ++h) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h][d]), k, a[h]);
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int h = 0; h < NH; ++h) _mm512_storeu_ps(sc[h], _mm512_mul_ps(a[h], s));
  }
  QKV_AVX512 static void Scores16(const float* const* q, int n, const float* kt, int hd, float scale,
                                  float* const* sc) {
    int h = 0;
    for (; h + 8 <= n; h += 8) Scores16Tile<8>(q + h, kt, hd, scale, sc + h);
    if (h + 4 <= n) Scores16Tile<4>(q + h, kt, hd, scale, sc + h), h += 4;
    switch (n - h) {
      case 3: Scores16Tile<3>(q + h, kt, hd, scale, sc + h); break;
      case 2: Scores16Tile<2>(q + h, kt, hd, scale, sc + h); break;
      case 1: Scores16Tile<1>(q + h, kt, hd, scale, sc + h); break;
      default: break;
    }
  }
  QKV_AVX512 static void ExpShift(float* sc, int n, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    int j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(sc + j, FastExp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mv)));
    if (j < n) {  // the row is padded to whole 8-lane vectors only
      const __m256 m8 = _mm256_set1_ps(m);
      for (; j < n; j += 8) _mm256_storeu_ps(sc + j, FastExp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m8)));
    }
  }
  template <int HD>
  QKV_AVX512 static void WeightedSum(const float* w, const float* v, int nj, float* o) {
    constexpr int V = HD / 16;
    __m512 acc[V];
    for (int i = 0; i < V; ++i) acc[i] = _mm512_loadu_ps(o + 16 * i);
    for (int j = 0; j < nj; ++j) {
      const __m512 wj = _mm512_set1_ps(w[j]);
      for (int i = 0; i < V; ++i) acc[i] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(v + j * HD + 16 * i), acc[i]);
    }
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(o + 16 * i, acc[i]);
  }
  // f32/bf16 blocks read in registers (bf16 → f32 is exact), several blocks and heads per tile so that
  // enough independent FMA chains are in flight: one head's chain over the dims, or one block's, is
  // latency-bound (decode attention ran at ~15 GB/s with K/V already in cache). Each lane is still the
  // same chain in the same order as Scores16Tile / WeightedSum, so the bits do not change.
  // Scores of NH heads against NB blocks of 16 transposed keys: sc[h] + 16 * b receives block b's.
  template <int NH, int NB, bool BF16>
  QKV_AVX512 static void ScoresTile(const float* const* q, const uint8_t* const* kt, int hd, float scale,
                                    float* const* sc, int sc_off, const uint8_t* const* pf) {
    __m512 a[NB][NH];
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < NH; ++h) a[b][h] = _mm512_setzero_ps();
    constexpr size_t kRow = BF16 ? 32 : 64;
    for (int d = 0; d < hd; ++d) {
      if (pf != nullptr && (d * kRow) % 64 == 0)
        for (int b = 0; b < NB; ++b) PrefetchKv(reinterpret_cast<const char*>(pf[b] + d * kRow));
      __m512 k[NB];
      for (int b = 0; b < NB; ++b) k[b] = LoadRow16<BF16>{kt[b]}(static_cast<size_t>(d) * 16);
      for (int h = 0; h < NH; ++h) {
        const __m512 qd = _mm512_set1_ps(q[h][d]);
        for (int b = 0; b < NB; ++b) a[b][h] = _mm512_fmadd_ps(qd, k[b], a[b][h]);
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < NH; ++h) _mm512_storeu_ps(sc[h] + sc_off + 16 * b, _mm512_mul_ps(a[b][h], s));
  }
  // NH heads against nb blocks, NB at a time.
  template <int NH, int NB, bool BF16>
  QKV_AVX512 static void ScoresHeads(const float* const* q, const uint8_t* const* kt, int nb, int hd, float scale,
                                     float* const* sc, const uint8_t* const* pf) {
    int b = 0;
    for (; b + NB <= nb; b += NB) ScoresTile<NH, NB, BF16>(q, kt + b, hd, scale, sc, 16 * b, pf ? pf + b : nullptr);
    for (; b < nb; ++b) ScoresTile<NH, 1, BF16>(q, kt + b, hd, scale, sc, 16 * b, pf ? pf + b : nullptr);
  }
  // Scores of heads [0, n) against nb consecutive 16-slot blocks (kt[i]: block i's keys, [hd][16]); sc[h]
  // is head h's score row at the first block.
  template <bool BF16>
  QKV_AVX512 static void ScoresBlocks(const float* const* q, int n, const uint8_t* const* kt, int nb, int hd,
                                      float scale, float* const* sc, const uint8_t* const* pf) {
    int h = 0;
    for (; h + 8 <= n; h += 8) ScoresHeads<8, 2, BF16>(q + h, kt, nb, hd, scale, sc + h, h == 0 ? pf : nullptr);
    if (h + 4 <= n) ScoresHeads<4, 4, BF16>(q + h, kt, nb, hd, scale, sc + h, h == 0 ? pf : nullptr), h += 4;
    const uint8_t* const* pf_rest = h == 0 ? pf : nullptr;
    switch (n - h) {
      case 3: ScoresHeads<3, 4, BF16>(q + h, kt, nb, hd, scale, sc + h, pf_rest); break;
      case 2: ScoresHeads<2, 8, BF16>(q + h, kt, nb, hd, scale, sc + h, pf_rest); break;
      case 1: ScoresHeads<1, 8, BF16>(q + h, kt, nb, hd, scale, sc + h, pf_rest); break;
      default: break;
    }
  }
  // hd is a multiple of 16; v: one block's values, [nj][hd].
  template <bool BF16>
  QKV_AVX512 static void SumBlock(const float* const* w, int n, const uint8_t* v, int nj, int hd, float* const* o,
                                  const uint8_t* pf) {
    if (pf != nullptr) return WeightedSum16(w, n, LoadRow16Pf<BF16>{{v}, pf}, nj, hd, o);
    WeightedSum16(w, n, LoadRow16<BF16>{v}, nj, hd, o);
  }
  // The int8 kernels with 16 lanes: a block's 16 keys in one zmm, 16 value dims per zmm. Each lane runs
  // the AVX2 kernel's chain (over the dims for a score, over the positions for an output element).
  template <int NH>
  QKV_AVX512 static void ScoresI8x16(const float* const* q, const int8_t* kt, int hd, const float* slot_mul,
                                     float* const* sc) {
    __m512 a[NH];
    for (int h = 0; h < NH; ++h) a[h] = _mm512_setzero_ps();
    for (int d = 0; d < hd; ++d) {
      const __m512 k = LoadI8x16{kt}(static_cast<size_t>(d) * 16);
      for (int h = 0; h < NH; ++h) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h][d]), k, a[h]);
    }
    const __m512 m = _mm512_loadu_ps(slot_mul);
    for (int h = 0; h < NH; ++h) _mm512_storeu_ps(sc[h], _mm512_mul_ps(a[h], m));
  }
  QKV_AVX512 static void SumI8(const float* const* w, int group, const int8_t* v, int nj, int hd, float* const* o) {
    WeightedSum16(w, group, LoadI8x16{v}, nj, hd, o);
  }
};
}  // namespace

// Within a block, keys are stored transposed ([head_dim][block_size]) so that the scores of a whole
// block are block_size independent FMA chains over the dimensions (no horizontal sums); values are
// stored row-major ([block_size][head_dim]) for the weighted sum.
void StoreKvHead(KvCache& kv, int layer, const int* blocks, int pos, int h, const float* k, const float* v) {
  const KvCacheShape& s = kv.shape();
  const int block = blocks[pos / s.block_size];
  const int slot = pos % s.block_size;
  uint8_t* kb = kv.K(layer, block, h);
  uint8_t* vb = kv.V(layer, block, h);
  if (s.dtype == DType::kI8) {  // values, then the block's scales (kv_cache.h)
    const size_t scales = static_cast<size_t>(s.block_size) * s.head_dim;
    QuantizeI8(k, s.head_dim, reinterpret_cast<int8_t*>(kb) + slot, s.block_size, kb + scales + 2 * slot);
    QuantizeI8(v, s.head_dim, reinterpret_cast<int8_t*>(vb) + static_cast<size_t>(slot) * s.head_dim, 1,
               vb + scales + 2 * slot);
    return;
  }
  for (int d = 0; d < s.head_dim; ++d) {
    Store(kb, static_cast<size_t>(d) * s.block_size + slot, k[d], s.dtype);
    Store(vb, static_cast<size_t>(slot) * s.head_dim + d, v[d], s.dtype);
  }
}

void StoreKv(KvCache& kv, int layer, const int* blocks, int pos, const float* k, const float* v) {
  const int hd = kv.shape().head_dim;
  for (int h = 0; h < kv.shape().n_kv_heads; ++h) StoreKvHead(kv, layer, blocks, pos, h, k + h * hd, v + h * hd);
}

size_t AttentionScratchFloats(int group, int n_ctx, int head_dim, int block_size) {
  return static_cast<size_t>(group) * (n_ctx + block_size + 8) + static_cast<size_t>(head_dim) * block_size +
         block_size;
}

namespace {

// A sequence's blocks need not be consecutive (a kv head's regions of consecutive blocks are adjacent,
// kv_cache.h, and then the hardware prefetcher follows them), and a kv head's share of one block is 2 KiB at
// bf16 / head_dim 64, too short for the prefetcher to find a new stream: decode read K/V at ~9 GB/s, stalled
// on the loads. Each block's K (pass 1) and V (pass 2) are asked for kKvAhead blocks before they are used.
constexpr int kKvAhead = 2;
inline void PrefetchBytes(const uint8_t* p, size_t n) {
  for (size_t o = 0; o < n; o += 64) PrefetchKv(reinterpret_cast<const char*>(p + o));
}

// The group's heads go through the kernels in chunks of up to kChunk, by pointers: Set(c0, b) points at heads
// [c0, c0 + n) of the group (their queries, outputs, and score rows at block b) and returns n.
struct HeadChunk {
  static constexpr int kChunk = 32;
  const float* q;
  float* out;
  float* scores;
  size_t stride;
  int hd, bs, group, h0;
  const float* qp[kChunk] = {};
  float* rows[kChunk] = {};
  float* outs[kChunk] = {};
  int Set(int c0, int b) {
    const int n = std::min(kChunk, group - c0);
    for (int i = 0; i < n; ++i) {
      qp[i] = q + (h0 + c0 + i) * hd;
      outs[i] = out + (h0 + c0 + i) * hd;
      rows[i] = scores + (c0 + i) * stride + static_cast<size_t>(b) * bs;
    }
    return n;
  }
};

// f32/bf16 blocks per tile in AttendDirect, and how many blocks ahead it asks for K/V. The asking is
// spread over the reading: one prefetch per 64 bytes read, for the line kDirectAhead blocks on. Asking
// for 8 blocks (256 lines) at once every 8 blocks, as before, stalled the thread once the core's miss
// buffers were full; spread, decode attention took ~22% less time at 512 and 1536 positions (docs/performance.md,
// "Decode attention: prefetch spread over the reads").
constexpr int kDirectBlocks = 8;
constexpr int kDirectAhead = 8;

// Softmax per head of group g over [0, n_ctx) of its score rows (stride apart), with the optional sink in
// the denominator; zeroes the heads' outputs for pass 2.
template <class Kernels>
inline void Softmax(float* scores, size_t stride, int n_ctx, float* out, const AttentionShape& shape, int g) {
  const int hd = shape.head_dim;
  const int group = shape.n_heads / shape.n_kv_heads;
  const int h0 = g * group;
  for (int hh = 0; hh < group; ++hh) {
    float* sc = scores + hh * stride;
    float m = Max(sc, n_ctx);
    const float sink = shape.sinks ? shape.sinks[h0 + hh] : -INFINITY;
    m = std::max(m, sink);
    // Exponentials 8 at a time over whole vectors (the row is padded to whole blocks; lanes past n_ctx
    // are never read), so a position's weight does not depend on where n_ctx ends.
    Kernels::ExpShift(sc, n_ctx, m);
    float sum = Sum(sc, n_ctx);
    if (shape.sinks) sum += FastExp(sink - m);
    const float inv = 1.0f / sum;
    for (int j = 0; j < n_ctx; ++j) sc[j] *= inv;
    std::memset(out + (h0 + hh) * hd, 0, sizeof(float) * hd);
  }
}

// AttendBody's pass 1, softmax and pass 2 on f32/bf16 blocks of 16 slots, read in registers by the kernels.
template <class Kernels>
inline void AttendDirect(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out,
                         const AttentionShape& shape, int g, float* scores, size_t stride) {
  const KvCacheShape& s = kv.shape();
  const int hd = shape.head_dim;
  const int bs = s.block_size;
  const int group = shape.n_heads / shape.n_kv_heads;
  const int h0 = g * group;
  const int n_blocks = (n_ctx + bs - 1) / bs;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const size_t kv_bytes = static_cast<size_t>(bs) * KvVectorBytes(s.dtype, hd);
  HeadChunk hc{q, out, scores, stride, hd, bs, group, h0};
  const float* const* qp = hc.qp;
  float* const* rows = hc.rows;
  float* const* outs = hc.outs;
  auto chunk = [&](int c0, int b) { return hc.Set(c0, b); };
  const bool bf16 = s.dtype == DType::kBF16;
  // Pass 1 reads K, pass 2 V, in position order: 2 n_blocks regions of kv_bytes, region i being K of block i,
  // then V of block i − n_blocks. The first kDirectAhead are asked for up front; after that the kernels ask
  // for region i + kDirectAhead line by line as they read region i (ScoresTile, LoadRow16Pf).
  auto next = [&](int i) -> const uint8_t* {
    if (i < n_blocks) return kv.K(layer, blocks[i], g);
    if (i < 2 * n_blocks) return kv.V(layer, blocks[i - n_blocks], g);
    return nullptr;
  };
  auto prefetch = [&](int i) {
    if (const uint8_t* p = next(i)) PrefetchBytes(p, kv_bytes);
  };
  for (int i = 0; i < std::min(kDirectAhead, 2 * n_blocks); ++i) prefetch(i);
  const uint8_t* kt[kDirectBlocks];
  const uint8_t* ahead[kDirectBlocks];  // what to ask for while block i is read: kDirectAhead blocks on
  for (int b = 0; b < n_blocks; b += kDirectBlocks) {
    const int nb = std::min(kDirectBlocks, n_blocks - b);
    for (int i = 0; i < nb; ++i) {
      kt[i] = kv.K(layer, blocks[b + i], g);
      const uint8_t* a = next(b + i + kDirectAhead);
      ahead[i] = a != nullptr ? a : kt[i];
    }
    for (int c0 = 0; c0 < group; c0 += HeadChunk::kChunk) {
      const int n = chunk(c0, b);
      const uint8_t* const* pf = c0 == 0 ? ahead : nullptr;  // later chunks read the same keys, in cache
      if (bf16) {
        Kernels::template ScoresBlocks<true>(qp, n, kt, nb, hd, scale, rows, pf);
      } else {
        Kernels::template ScoresBlocks<false>(qp, n, kt, nb, hd, scale, rows, pf);
      }
    }
  }
  Softmax<Kernels>(scores, stride, n_ctx, out, shape, g);
  for (int b = 0; b < n_blocks; ++b) {
    const int nj = std::min(bs, n_ctx - b * bs);
    const uint8_t* v = kv.V(layer, blocks[b], g);
    const uint8_t* a = next(n_blocks + b + kDirectAhead);
    const uint8_t* vpf = a != nullptr ? a : v;
    for (int c0 = 0; c0 < group; c0 += HeadChunk::kChunk) {
      const int n = chunk(c0, b);
      if (bf16) {
        Kernels::template SumBlock<true>(rows, n, v, nj, hd, outs, c0 == 0 ? vpf : nullptr);
      } else {
        Kernels::template SumBlock<false>(rows, n, v, nj, hd, outs, c0 == 0 ? vpf : nullptr);
      }
    }
  }
}

// AttendGroup with the kernels of one level.
template <class Kernels>
inline void AttendBody(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out,
                       const AttentionShape& shape, int g, float* scratch) {
  const KvCacheShape& s = kv.shape();
  const int hd = shape.head_dim;
  const int bs = s.block_size;
  const int group = shape.n_heads / shape.n_kv_heads;
  const int h0 = g * group;
  const int n_blocks = (n_ctx + bs - 1) / bs;
  // Per-head score row, padded to whole blocks and to whole 8-lane vectors.
  const size_t stride = (static_cast<size_t>(n_blocks) * bs + 7) / 8 * 8;
  float* scores = scratch;  // [group][stride]
  const bool i8 = s.dtype == DType::kI8;
  // f32/bf16 blocks of 16 slots read in registers, several blocks per tile.
  if (!i8 && bs == 16 && hd % 16 == 0)
    return AttendDirect<Kernels>(kv, layer, blocks, n_ctx, q, out, shape, g, scores, stride);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));  // scores = q·k / sqrt(d_head)
  float* blk = scratch + static_cast<size_t>(group) * stride;    // one block of K or V as f32
  float* slot_mul = blk + static_cast<size_t>(hd) * bs;          // int8: one block's scales ([bs])
  HeadChunk hc{q, out, scores, stride, hd, bs, group, h0};
  const float* const* qp = hc.qp;
  float* const* rows = hc.rows;
  float* const* outs = hc.outs;
  auto chunk = [&](int c0, int b) { return hc.Set(c0, b); };

  const size_t kv_bytes = static_cast<size_t>(bs) * KvVectorBytes(s.dtype, hd);
  for (int b = 0; b < std::min(kKvAhead, n_blocks); ++b) PrefetchBytes(kv.K(layer, blocks[b], g), kv_bytes);
  // Pass 1: scores, block by block in position order. Slots past n_ctx in the last block are computed
  // from stale data and then ignored (never read into the softmax).
  for (int b = 0; b < n_blocks; ++b) {
    if (b + kKvAhead < n_blocks) {
      PrefetchBytes(kv.K(layer, blocks[b + kKvAhead], g), kv_bytes);
    } else if (b + kKvAhead - n_blocks < n_blocks) {  // pass 2's first blocks
      PrefetchBytes(kv.V(layer, blocks[b + kKvAhead - n_blocks], g), kv_bytes);
    }
    if (i8) {  // int8 keys are read in registers, with no f32 copy of the block
      for (int c0 = 0; c0 < group; c0 += HeadChunk::kChunk) {
        const int n = chunk(c0, b);
        BlockScoresI8<Kernels>(qp, n, kv.K(layer, blocks[b], g), hd, bs, scale, slot_mul, rows);
      }
      continue;
    }
    Kernels::ToF32(kv.K(layer, blocks[b], g), hd * bs, s.dtype, blk);  // [hd][bs]
    if (bs == 16) {
      for (int c0 = 0; c0 < group; c0 += HeadChunk::kChunk) {
        const int n = chunk(c0, b);
        Kernels::Scores16(qp, n, blk, hd, scale, rows);
      }
      continue;
    }
    for (int hh = 0; hh < group; ++hh) {
      const float* qh = q + (h0 + hh) * hd;
      float* sc = scores + hh * stride + static_cast<size_t>(b) * bs;
      for (int j = 0; j < bs; ++j) sc[j] = 0.0f;
      for (int d = 0; d < hd; ++d) {
        const float qd = qh[d];
        const float* kd = blk + static_cast<size_t>(d) * bs;
        for (int j = 0; j < bs; ++j) sc[j] += qd * kd[j];
      }
      for (int j = 0; j < bs; ++j) sc[j] *= scale;
    }
  }
  Softmax<Kernels>(scores, stride, n_ctx, out, shape, g);
  // Pass 2: Σ_j w_j v_j in position order.
  for (int b = 0; b < n_blocks; ++b) {
    if (b + kKvAhead < n_blocks) PrefetchBytes(kv.V(layer, blocks[b + kKvAhead], g), kv_bytes);
    const int nj = std::min(bs, n_ctx - b * bs);
    if (i8) {
      for (int c0 = 0; c0 < group; c0 += HeadChunk::kChunk) {
        const int n = chunk(c0, b);
        WeightedSumI8Block<Kernels>(rows, n, kv.V(layer, blocks[b], g), hd, bs, nj, slot_mul, outs);
      }
      continue;
    }
    Kernels::ToF32(kv.V(layer, blocks[b], g), hd * nj, s.dtype, blk);  // [nj][hd]
    for (int hh = 0; hh < group; ++hh) {
      const float* w = scores + hh * stride + static_cast<size_t>(b) * bs;
      float* o = out + (h0 + hh) * hd;
      if (hd == 64) {
        Kernels::template WeightedSum<64>(w, blk, nj, o);
      } else if (hd == 128) {
        Kernels::template WeightedSum<128>(w, blk, nj, o);
      } else {
        for (int j = 0; j < nj; ++j) {
          const float wj = w[j];
          const float* v = blk + static_cast<size_t>(j) * hd;
          for (int d = 0; d < hd; ++d) o[d] += wj * v[d];
        }
      }
    }
  }
}

// flatten: every kernel is inlined here, compiled for AVX-512.
QKV_AVX512 __attribute__((flatten)) void AttendGroup512(const KvCache& kv, int layer, const int* blocks, int n_ctx,
                                                        const float* q, float* out, const AttentionShape& shape, int g,
                                                        float* scratch) {
  AttendBody<Avx512Kernels>(kv, layer, blocks, n_ctx, q, out, shape, g, scratch);
}

}  // namespace

void AttendGroup(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out,
                 const AttentionShape& shape, int g, float* scratch) {
  if (ActiveKernelIsa() >= KernelIsa::kAvx512)
    return AttendGroup512(kv, layer, blocks, n_ctx, q, out, shape, g, scratch);
  AttendBody<Avx2Kernels>(kv, layer, blocks, n_ctx, q, out, shape, g, scratch);
}

}  // namespace qkv
