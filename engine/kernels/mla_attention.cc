#include "engine/kernels/mla_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/bf16.h"
#include "engine/kernels/attention.h"
#include "engine/kernels/ops.h"

namespace qkv {
namespace {

// Horizontal sum of 8 lanes in a fixed order.
inline float HSum8(__m256 v) {
  alignas(32) float l[8];
  _mm256_store_ps(l, v);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

inline __m256 I8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The bf16 scale of vector j of an int8 region (its bs × width values come first).
inline float ScaleAt(const uint8_t* region, int bs, int width, int j) {
  uint16_t h;
  std::memcpy(&h, region + static_cast<size_t>(bs) * width + 2 * j, 2);
  return Bf16ToF32(h);
}

// 8 values of a cached row, as f32: an f32 row (bf16 blocks are converted to f32 first) or an int8 one.
template <bool I8>
inline __m256 Load8(const void* row, int i) {
  if constexpr (I8) {
    return I8x8(static_cast<const int8_t*>(row) + i);
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(row) + i);
  }
}
template <bool I8>
inline float At(const void* row, int i) {
  if constexpr (I8) {
    return static_cast<float>(static_cast<const int8_t*>(row)[i]);
  } else {
    return static_cast<const float*>(row)[i];
  }
}

// dots[h] = q_h · row over n values for NH heads: per head one 8-lane FMA chain over the row (loaded once
// for all heads), reduced in a fixed order, then the tail in order. A head's value is the same whatever NH.
template <int NH, bool I8>
inline void Dots(const float* const* q, const void* row, int n, float* dots) {
  __m256 acc[NH];
  for (int h = 0; h < NH; ++h) acc[h] = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 k = Load8<I8>(row, i);
    for (int h = 0; h < NH; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + i), k, acc[h]);
  }
  for (int h = 0; h < NH; ++h) {
    float r = HSum8(acc[h]);
    for (int t = i; t < n; ++t) r += q[h][t] * At<I8>(row, t);
    dots[h] = r;
  }
}

// o_h[0, n) += Σ_j w_h[j] · row_j for NH heads over nj rows (row j at rows + j × stride elements): every
// element one FMA chain in position order; each row chunk is loaded once for all heads.
template <int NH, bool I8>
inline void WeightedRows(const float* const* w, const void* rows, size_t stride, int nj, int n, float* const* o) {
  const auto row = [&](int j) {
    if constexpr (I8) {
      return static_cast<const void*>(static_cast<const int8_t*>(rows) + static_cast<size_t>(j) * stride);
    } else {
      return static_cast<const void*>(static_cast<const float*>(rows) + static_cast<size_t>(j) * stride);
    }
  };
  int d0 = 0;
  for (; d0 + 16 <= n; d0 += 16) {
    __m256 acc[NH][2];
    for (int h = 0; h < NH; ++h) acc[h][0] = _mm256_loadu_ps(o[h] + d0), acc[h][1] = _mm256_loadu_ps(o[h] + d0 + 8);
    for (int j = 0; j < nj; ++j) {
      const void* r = row(j);
      const __m256 v0 = Load8<I8>(r, d0), v1 = Load8<I8>(r, d0 + 8);
      for (int h = 0; h < NH; ++h) {
        const __m256 wb = _mm256_broadcast_ss(w[h] + j);
        acc[h][0] = _mm256_fmadd_ps(wb, v0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(wb, v1, acc[h][1]);
      }
    }
    for (int h = 0; h < NH; ++h) _mm256_storeu_ps(o[h] + d0, acc[h][0]), _mm256_storeu_ps(o[h] + d0 + 8, acc[h][1]);
  }
  for (; d0 < n; ++d0) {
    for (int h = 0; h < NH; ++h) {
      float a = o[h][d0];
      for (int j = 0; j < nj; ++j) a = std::fma(w[h][j], At<I8>(row(j), d0), a);
      o[h][d0] = a;
    }
  }
}

// Scores of heads [0, nh) (queries at stride W, [q_lat | q_pe]) against one cached token: its latent row
// (R values) and rope row (P values), in groups of up to 4 heads that share each load. int8 rows carry
// their scales cs, rs. Written to scores[h × stride + col].
template <bool I8>
void ScoreToken(const float* q, int W, int R, int P, int nh, const void* crow, const void* rrow, float cs, float rs,
                float scale, float* scores, size_t stride, size_t col) {
  for (int h = 0; h < nh; h += 4) {
    const int n = std::min(4, nh - h);
    const float* qc[4];
    const float* qr[4];
    for (int i = 0; i < n; ++i) qc[i] = q + static_cast<size_t>(h + i) * W, qr[i] = qc[i] + R;
    float dc[4], dr[4];
    switch (n) {
      case 4: Dots<4, I8>(qc, crow, R, dc), Dots<4, I8>(qr, rrow, P, dr); break;
      case 3: Dots<3, I8>(qc, crow, R, dc), Dots<3, I8>(qr, rrow, P, dr); break;
      case 2: Dots<2, I8>(qc, crow, R, dc), Dots<2, I8>(qr, rrow, P, dr); break;
      default: Dots<1, I8>(qc, crow, R, dc), Dots<1, I8>(qr, rrow, P, dr); break;
    }
    for (int i = 0; i < n; ++i) {
      const float v = I8 ? dc[i] * cs + dr[i] * rs : dc[i] + dr[i];
      scores[static_cast<size_t>(h + i) * stride + col] = v * scale;
    }
  }
}

// out_h += Σ_j w_h[j] · c_j over one block's nj latent rows for heads [0, nh) (weights at w + h × stride,
// outputs at out + h × R), in groups of up to 4 heads.
template <bool I8>
void WeightBlock(const float* w, size_t stride, int nh, const void* rows, int nj, int R, float* out) {
  for (int h = 0; h < nh; h += 4) {
    const int n = std::min(4, nh - h);
    const float* wp[4];
    float* op[4];
    for (int i = 0; i < n; ++i)
      wp[i] = w + static_cast<size_t>(h + i) * stride, op[i] = out + static_cast<size_t>(h + i) * R;
    switch (n) {
      case 4: WeightedRows<4, I8>(wp, rows, R, nj, R, op); break;
      case 3: WeightedRows<3, I8>(wp, rows, R, nj, R, op); break;
      case 2: WeightedRows<2, I8>(wp, rows, R, nj, R, op); break;
      default: WeightedRows<1, I8>(wp, rows, R, nj, R, op); break;
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

size_t LatentAttentionScratchFloats(int n_heads, int n_ctx, int latent_dim, int rope_dim, int block_size) {
  const size_t row = (static_cast<size_t>(n_ctx) + block_size + 7) / 8 * 8;
  return static_cast<size_t>(n_heads) * row + static_cast<size_t>(block_size) * (latent_dim + rope_dim) + 16;
}

void AttendLatent(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out, int h0,
                  int nh, float scale, float* scratch) {
  const KvCacheShape& s = kv.shape();
  const int R = s.head_dim, P = s.value_dim(), bs = s.block_size, W = R + P;
  const int n_blocks = (n_ctx + bs - 1) / bs;
  const size_t stride = (static_cast<size_t>(n_blocks) * bs + 7) / 8 * 8;
  float* scores = scratch;                                    // [nh][stride]
  float* blk_c = scratch + static_cast<size_t>(nh) * stride;  // one block's latents as f32 [bs][R]
  float* blk_r = blk_c + static_cast<size_t>(bs) * R;         // and rope keys [bs][P]
  const bool i8 = s.dtype == DType::kI8;

  // Pass 1: scores, block by block in position order.
  const float* qh0 = q + static_cast<size_t>(h0) * W;
  for (int b = 0; b < n_blocks; ++b) {
    const int nj = std::min(bs, n_ctx - b * bs);
    const uint8_t* c = kv.K(layer, blocks[b], 0);
    const uint8_t* r = kv.V(layer, blocks[b], 0);
    const size_t col = static_cast<size_t>(b) * bs;
    if (i8) {
      const auto* ci = reinterpret_cast<const int8_t*>(c);
      const auto* ri = reinterpret_cast<const int8_t*>(r);
      for (int j = 0; j < nj; ++j) {
        ScoreToken<true>(qh0, W, R, P, nh, ci + static_cast<size_t>(j) * R, ri + static_cast<size_t>(j) * P,
                         ScaleAt(c, bs, R, j), ScaleAt(r, bs, P, j), scale, scores, stride, col + j);
      }
      continue;
    }
    KvToF32(c, nj * R, s.dtype, blk_c);
    KvToF32(r, nj * P, s.dtype, blk_r);
    for (int j = 0; j < nj; ++j) {
      ScoreToken<false>(qh0, W, R, P, nh, blk_c + static_cast<size_t>(j) * R, blk_r + static_cast<size_t>(j) * P, 1.0f,
                        1.0f, scale, scores, stride, col + j);
    }
  }
  // Softmax per head over [0, n_ctx); lanes past n_ctx up to the vector end are set to -inf (weight 0).
  for (int hh = 0; hh < nh; ++hh) {
    float* sc = scores + hh * stride;
    const int padded = (n_ctx + 7) / 8 * 8;
    for (int j = n_ctx; j < padded; ++j) sc[j] = -INFINITY;
    float m = -INFINITY;
    for (int j = 0; j < n_ctx; ++j) m = std::max(m, sc[j]);
    const __m256 mv = _mm256_set1_ps(m);
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
    if (i8) {
      for (int hh = 0; hh < nh; ++hh)
        for (int j = 0; j < nj; ++j) w[hh * stride + j] *= ScaleAt(c, bs, R, j);
      WeightBlock<true>(w, stride, nh, c, nj, R, oh0);
      continue;
    }
    KvToF32(c, nj * R, s.dtype, blk_c);
    WeightBlock<false>(w, stride, nh, blk_c, nj, R, oh0);
  }
}

}  // namespace qkv
