#include "engine/kernels/mla_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/bf16.h"
#include "engine/kernels/attention.h"
#include "engine/kernels/cpu.h"
#include "engine/kernels/ops.h"
#include "engine/kernels/weighted_sum.h"

namespace qkv {
namespace {

// Cached rows are read where they lie, in the cache's dtype DT (f32, bf16 or int8), and widened to f32 in
// registers (bf16 → f32 is exact, so reading a bf16 row directly gives the bits of a converted copy).
template <DType DT>
constexpr size_t kBytes = DT == DType::kF32    ? 4
                          : DT == DType::kBF16 ? 2
                                               : 1;  // of one element
template <DType DT>
inline const void* RowAt(const void* rows, size_t stride, int j) {  // row j, stride elements apart
  return static_cast<const uint8_t*>(rows) + static_cast<size_t>(j) * stride * kBytes<DT>;
}
template <DType DT>
inline float At(const void* row, int i) {
  if constexpr (DT == DType::kI8) {
    return static_cast<float>(static_cast<const int8_t*>(row)[i]);
  } else if constexpr (DT == DType::kBF16) {
    return Bf16ToF32(static_cast<const uint16_t*>(row)[i]);
  } else {
    return static_cast<const float*>(row)[i];
  }
}
// The loads of kernels/weighted_sum.h on a block's rows (element i counted from the first row).
template <DType DT>
inline auto RowLoad8(const void* rows) {
  if constexpr (DT == DType::kI8) {
    return kernels::LoadI8x8{static_cast<const int8_t*>(rows)};
  } else {
    return kernels::LoadRow8<DT == DType::kBF16>{static_cast<const uint8_t*>(rows)};
  }
}
template <DType DT>
inline auto RowLoad16(const void* rows) {
  if constexpr (DT == DType::kI8) {
    return kernels::LoadI8x16{static_cast<const int8_t*>(rows)};
  } else {
    return kernels::LoadRow16<DT == DType::kBF16>{static_cast<const uint8_t*>(rows)};
  }
}

// Dims [d0, n) of the weighted sum, one element at a time (the same FMA chain as the vector tiles).
template <int NH, DType DT>
inline void WeightedTail(const float* const* w, const void* rows, size_t stride, int nj, int d0, int n,
                         float* const* o) {
  for (; d0 < n; ++d0) {
    for (int h = 0; h < NH; ++h) {
      float a = o[h][d0];
      for (int j = 0; j < nj; ++j) a = std::fma(w[h][j], At<DT>(RowAt<DT>(rows, stride, j), d0), a);
      o[h][d0] = a;
    }
  }
}

// o_h[0, n) += Σ_j w_h[j] · row_j for NH heads over nj rows (row j at rows + j × stride elements): every
// element one FMA chain in position order; each row chunk is loaded once for all heads.
template <int NH, DType DT>
inline void WeightedRows(const float* const* w, const void* rows, size_t stride, int nj, int n, float* const* o) {
  const int n16 = n / 16 * 16;
  kernels::WeightedSumTile8<NH, 2>(w, RowLoad8<DT>(rows), nj, stride, 0, n16, o);
  WeightedTail<NH, DT>(w, rows, stride, nj, n16, n, o);
}

// Horizontal sums of n ≤ 8 vectors at once in a fixed order: out[i] = ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
// (l6 + l7)) of v[i] (a horizontal add pairs neighbouring lanes): the additions the scalar sum of the lanes
// made before, so the same bits.
inline void HSum8Many(const __m256* v, int n, float* out) {
  __m256 w[8];
  for (int i = 0; i < 8; ++i) w[i] = i < n ? v[i] : _mm256_setzero_ps();
  // [v0 l0+l1, v0 l2+l3, v1 l0+l1, v1 l2+l3 | the same for lanes 4-7], then the sums of 4 lanes.
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(w[0], w[1]), _mm256_hadd_ps(w[2], w[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(w[4], w[5]), _mm256_hadd_ps(w[6], w[7]));
  const __m256 lo = _mm256_permute2f128_ps(g0, g1, 0x20), hi = _mm256_permute2f128_ps(g0, g1, 0x31);
  alignas(32) float s[8];
  _mm256_store_ps(s, _mm256_add_ps(lo, hi));
  std::memcpy(out, s, sizeof(float) * n);
}

// HSum8Many for N ≤ 16 vectors, 8 at a time.
template <int N>
inline void HSums(const __m256* v, float* out) {
  static_assert(N <= 16);
  HSum8Many(v, std::min(8, N), out);
  if constexpr (N > 8) HSum8Many(v + 8, N - 8, out + 8);
}

// dots[t][h] = the tile's horizontal sum s[t × NH + h] plus the values [i, n) past the last whole vector, in
// order.
template <int NT, int NH, DType DT>
inline void FinishDots(const float* s, const float* const* q, const void* const* rows, int i, int n, float (*dots)[4]) {
  for (int t = 0; t < NT; ++t) {
    for (int h = 0; h < NH; ++h) {
      float r = s[t * NH + h];
      for (int u = i; u < n; ++u) r += q[h][u] * At<DT>(rows[t], u);
      dots[t][h] = r;
    }
  }
}

// dots[t][h] = q_h · row_t over n values for NT cached rows and NH heads (NT × NH ≤ 16): per pair one 8-lane
// FMA chain over the values, each row and query chunk loaded once for the tile, NT × NH chains in flight;
// reduced in a fixed order (HSum8Many, then the tail in order), so a pair's value is the same whatever tile
// it is computed in.
template <int NT, int NH, DType DT>
inline void DotsTile(const float* const* q, const void* const* rows, int n, float (*dots)[4]) {
  static_assert(NT * NH <= 16);
  __m256 acc[NT * NH];
  for (auto& a : acc) a = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 k[NT];
    for (int t = 0; t < NT; ++t) k[t] = RowLoad8<DT>(rows[t])(static_cast<size_t>(i));
    for (int h = 0; h < NH; ++h) {
      const __m256 qv = _mm256_loadu_ps(q[h] + i);
      for (int t = 0; t < NT; ++t) acc[t * NH + h] = _mm256_fmadd_ps(qv, k[t], acc[t * NH + h]);
    }
  }
  float s[16];
  HSums<NT * NH>(acc, s);
  FinishDots<NT, NH, DT>(s, q, rows, i, n, dots);
}

// The kernels of the AVX2 level (8-lane chains).
struct Avx2Latent {
  static constexpr int kTokens = 3;  // cached tokens per score tile (3 × 4 heads: 12 of the 16 ymm registers)
  template <int NT, int NH, DType DT>
  static void Dots(const float* const* q, const void* const* rows, int n, float (*dots)[4]) {
    DotsTile<NT, NH, DT>(q, rows, n, dots);
  }
  template <int NH, DType DT>
  static void Weighted(const float* const* w, const void* rows, size_t stride, int nj, int n, float* const* o) {
    WeightedRows<NH, DT>(w, rows, stride, nj, n, o);
  }
};

// The kernels of the AVX-512 levels: dots as 16-lane chains (lanes k and k + 8 added, then the 8-lane
// order), so the scores have other bits than at the AVX2 level but the same at every M, chunk and tile;
// weighted sums in 16-lane vectors, 64 dims × 4 heads per tile, each element the same FMA chain as at the
// AVX2 level (the same bits).
struct Avx512Latent {
  static constexpr int kTokens = 4;  // 4 × 4 heads: 16 accumulators of the 32 zmm registers
  template <int NT, int NH, DType DT>
  QKV_AVX512 static void Dots(const float* const* q, const void* const* rows, int n, float (*dots)[4]) {
    static_assert(NT * NH <= 16);
    __m512 acc[NT * NH];
    for (auto& a : acc) a = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 k[NT];
      for (int t = 0; t < NT; ++t) k[t] = RowLoad16<DT>(rows[t])(static_cast<size_t>(i));
      for (int h = 0; h < NH; ++h) {
        const __m512 qv = _mm512_loadu_ps(q[h] + i);
        for (int t = 0; t < NT; ++t) acc[t * NH + h] = _mm512_fmadd_ps(qv, k[t], acc[t * NH + h]);
      }
    }
    __m256 half[NT * NH];
    for (int a = 0; a < NT * NH; ++a) {
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[a]), 1));
      half[a] = _mm256_add_ps(_mm512_castps512_ps256(acc[a]), hi);
    }
    float s[16];
    HSums<NT * NH>(half, s);
    FinishDots<NT, NH, DT>(s, q, rows, i, n, dots);
  }
  // o_h[0, n) += Σ_j w_h[j] · row_j as WeightedRows: per element one FMA chain in position order.
  template <int NH, DType DT>
  QKV_AVX512 static void Weighted(const float* const* w, const void* rows, size_t stride, int nj, int n,
                                  float* const* o) {
    const int n64 = n / 64 * 64, n16 = n / 16 * 16;
    kernels::WeightedSumTile16<NH, 4>(w, RowLoad16<DT>(rows), nj, stride, 0, n64, o);
    kernels::WeightedSumTile16<NH, 1>(w, RowLoad16<DT>(rows), nj, stride, n64, n16, o);
    WeightedTail<NH, DT>(w, rows, stride, nj, n16, n, o);
  }
};

// The latent and rope dots of NT tokens against NH heads.
template <class K, int NT, int NH, DType DT>
inline void TokenDots(const float* const* qc, const float* const* qr, const void* const* crow, const void* const* rrow,
                      int R, int P, float (*dc)[4], float (*dr)[4]) {
  K::template Dots<NT, NH, DT>(qc, crow, R, dc);
  K::template Dots<NT, NH, DT>(qr, rrow, P, dr);
}

// Scores of heads [0, nh) (queries at stride W, [q_lat | q_pe]) against NT ≤ K::kTokens cached tokens: their
// latent rows (R values) and rope rows (P values), in groups of up to 4 heads that share each load. int8
// rows carry their scales cs, rs. Token t's scores go to scores[h × stride + col + t]. A score is the same
// whichever tokens and heads share its tile.
template <class K, int NT, DType DT>
inline void ScoreTokens(const float* q, int W, int R, int P, int nh, const void* const* crow, const void* const* rrow,
                        const float* cs, const float* rs, float scale, float* scores, size_t stride, size_t col) {
  for (int h = 0; h < nh; h += 4) {
    const int n = std::min(4, nh - h);
    const float* qc[4];
    const float* qr[4];
    for (int i = 0; i < n; ++i) qc[i] = q + static_cast<size_t>(h + i) * W, qr[i] = qc[i] + R;
    float dc[NT][4], dr[NT][4];
    switch (n) {
      case 4: TokenDots<K, NT, 4, DT>(qc, qr, crow, rrow, R, P, dc, dr); break;
      case 3: TokenDots<K, NT, 3, DT>(qc, qr, crow, rrow, R, P, dc, dr); break;
      case 2: TokenDots<K, NT, 2, DT>(qc, qr, crow, rrow, R, P, dc, dr); break;
      default: TokenDots<K, NT, 1, DT>(qc, qr, crow, rrow, R, P, dc, dr); break;
    }
    for (int t = 0; t < NT; ++t) {
      for (int i = 0; i < n; ++i) {
        const float v = DT == DType::kI8 ? dc[t][i] * cs[t] + dr[t][i] * rs[t] : dc[t][i] + dr[t][i];
        scores[static_cast<size_t>(h + i) * stride + col + t] = v * scale;
      }
    }
  }
}

// Scores of heads [0, nh) against the nj tokens of one block (row j of the latents at c + j × R elements, of
// the rope keys at r + j × P; int8: their scales in cs[j], rs[j]), K::kTokens tokens at a time, then 2, then 1.
template <class K, DType DT>
inline void ScoreBlock(const float* q, int W, int R, int P, int nh, const void* c, const void* r, int nj,
                       const float* cs, const float* rs, float scale, float* scores, size_t stride, size_t col) {
  // Tokens [j, j + NT) in one tile.
  const auto tile = [&]<int NT>(int j) {
    const void* cr[NT];
    const void* rr[NT];
    for (int t = 0; t < NT; ++t) cr[t] = RowAt<DT>(c, R, j + t), rr[t] = RowAt<DT>(r, P, j + t);
    ScoreTokens<K, NT, DT>(q, W, R, P, nh, cr, rr, cs + j, rs + j, scale, scores, stride, col + j);
  };
  int j = 0;
  if constexpr (K::kTokens > 2) {
    for (; j + K::kTokens <= nj; j += K::kTokens) tile.template operator()<K::kTokens>(j);
  }
  for (; j + 2 <= nj; j += 2) tile.template operator()<2>(j);
  if (j < nj) tile.template operator()<1>(j);
}

// out_h += Σ_j w_h[j] · c_j over one block's nj latent rows for heads [0, nh) (weights at w + h × stride,
// outputs at out + h × R), in groups of up to 4 heads.
template <class K, DType DT>
inline void WeightBlock(const float* w, size_t stride, int nh, const void* rows, int nj, int R, float* out) {
  for (int h = 0; h < nh; h += 4) {
    const int n = std::min(4, nh - h);
    const float* wp[4];
    float* op[4];
    for (int i = 0; i < n; ++i)
      wp[i] = w + static_cast<size_t>(h + i) * stride, op[i] = out + static_cast<size_t>(h + i) * R;
    switch (n) {
      case 4: K::template Weighted<4, DT>(wp, rows, R, nj, R, op); break;
      case 3: K::template Weighted<3, DT>(wp, rows, R, nj, R, op); break;
      case 2: K::template Weighted<2, DT>(wp, rows, R, nj, R, op); break;
      default: K::template Weighted<1, DT>(wp, rows, R, nj, R, op); break;
    }
  }
}

}  // namespace

void StoreLatent(KvCache& kv, int layer, const int* blocks, int pos, const float* latent, const float* rope_key) {
  const KvCacheShape& s = kv.shape();
  const int R = s.head_dim, P = s.value_dim(), bs = s.block_size;
  const int block = blocks[pos / bs], slot = pos % bs;
  uint8_t* c = kv.K(layer, block, 0);
  uint8_t* r = kv.V(layer, block, 0);
  if (s.dtype == DType::kI8) {  // values [slot][width], then the block's scales
    QuantizeKvI8(latent, R, reinterpret_cast<int8_t*>(c) + static_cast<size_t>(slot) * R, 1,
                 c + static_cast<size_t>(bs) * R + 2 * slot);
    QuantizeKvI8(rope_key, P, reinterpret_cast<int8_t*>(r) + static_cast<size_t>(slot) * P, 1,
                 r + static_cast<size_t>(bs) * P + 2 * slot);
    return;
  }
  for (int d = 0; d < R; ++d) StoreKvElement(c, static_cast<size_t>(slot) * R + d, latent[d], s.dtype);
  for (int d = 0; d < P; ++d) StoreKvElement(r, static_cast<size_t>(slot) * P + d, rope_key[d], s.dtype);
}

size_t LatentAttentionScratchFloats(int n_heads, int n_ctx, int block_size) {
  const size_t row = (static_cast<size_t>(n_ctx) + block_size + 7) / 8 * 8;
  return static_cast<size_t>(n_heads) * row + 2 * static_cast<size_t>(block_size) + 16;
}

namespace {

// AttendLatent with the kernels K of one level on a cache of dtype DT.
template <class K, DType DT>
inline void LatentBody(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out, int h0,
                       int nh, float scale, float* scratch) {
  const KvCacheShape& s = kv.shape();
  const int R = s.head_dim, P = s.value_dim(), bs = s.block_size, W = R + P;
  const int n_blocks = (n_ctx + bs - 1) / bs;
  const size_t stride = (static_cast<size_t>(n_blocks) * bs + 7) / 8 * 8;
  float* scores = scratch;                                 // [nh][stride]
  float* cs = scratch + static_cast<size_t>(nh) * stride;  // int8: one block's latent scales
  float* rs = cs + bs;                                     // and rope-key scales

  // Pass 1: scores, block by block in position order.
  const float* qh0 = q + static_cast<size_t>(h0) * W;
  for (int b = 0; b < n_blocks; ++b) {
    const int nj = std::min(bs, n_ctx - b * bs);
    const uint8_t* c = kv.K(layer, blocks[b], 0);
    const uint8_t* r = kv.V(layer, blocks[b], 0);
    if constexpr (DT == DType::kI8) {
      KvI8Scales(c, bs, R, nj, 1.0f, cs);
      KvI8Scales(r, bs, P, nj, 1.0f, rs);
    }
    ScoreBlock<K, DT>(qh0, W, R, P, nh, c, r, nj, cs, rs, scale, scores, stride, static_cast<size_t>(b) * bs);
  }
  // Softmax per head over [0, n_ctx); lanes past n_ctx up to the vector end are set to -inf (weight 0).
  for (int hh = 0; hh < nh; ++hh) {
    float* sc = scores + hh * stride;
    const int padded = (n_ctx + 7) / 8 * 8;
    for (int j = n_ctx; j < padded; ++j) sc[j] = -INFINITY;
    const __m256 mv = _mm256_set1_ps(Max(sc, n_ctx));
    for (int j = 0; j < padded; j += 8) _mm256_storeu_ps(sc + j, FastExp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv)));
    const float inv = 1.0f / Sum(sc, n_ctx);
    for (int j = 0; j < n_ctx; ++j) sc[j] *= inv;
    std::memset(out + static_cast<size_t>(h0 + hh) * R, 0, sizeof(float) * R);
  }
  // Pass 2: out_h = Σ_j w_hj c_j in position order (int8: w_hj × s_j on the int8 rows).
  float* oh0 = out + static_cast<size_t>(h0) * R;
  for (int b = 0; b < n_blocks; ++b) {
    const int nj = std::min(bs, n_ctx - b * bs);
    const uint8_t* c = kv.K(layer, blocks[b], 0);
    float* w = scores + static_cast<size_t>(b) * bs;
    if constexpr (DT == DType::kI8) {
      KvI8Scales(c, bs, R, nj, 1.0f, cs);
      for (int hh = 0; hh < nh; ++hh)
        for (int j = 0; j < nj; ++j) w[hh * stride + j] *= cs[j];
    }
    WeightBlock<K, DT>(w, stride, nh, c, nj, R, oh0);
  }
}

template <class K>
inline void LatentAnyDType(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out,
                           int h0, int nh, float scale, float* scratch) {
  switch (kv.shape().dtype) {
    case DType::kF32: return LatentBody<K, DType::kF32>(kv, layer, blocks, n_ctx, q, out, h0, nh, scale, scratch);
    case DType::kBF16: return LatentBody<K, DType::kBF16>(kv, layer, blocks, n_ctx, q, out, h0, nh, scale, scratch);
    case DType::kI8: return LatentBody<K, DType::kI8>(kv, layer, blocks, n_ctx, q, out, h0, nh, scale, scratch);
  }
}

// flatten: every kernel is inlined here, compiled for AVX-512.
QKV_AVX512 __attribute__((flatten)) void AttendLatent512(const KvCache& kv, int layer, const int* blocks, int n_ctx,
                                                         const float* q, float* out, int h0, int nh, float scale,
                                                         float* scratch) {
  LatentAnyDType<Avx512Latent>(kv, layer, blocks, n_ctx, q, out, h0, nh, scale, scratch);
}

}  // namespace

void AttendLatent(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out, int h0,
                  int nh, float scale, float* scratch) {
  if (ActiveKernelIsa() >= KernelIsa::kAvx512)
    return AttendLatent512(kv, layer, blocks, n_ctx, q, out, h0, nh, scale, scratch);
  LatentAnyDType<Avx2Latent>(kv, layer, blocks, n_ctx, q, out, h0, nh, scale, scratch);
}

}  // namespace qkv
