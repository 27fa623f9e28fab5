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

// a · b over n values: 8 lanes, reduced in a fixed order, then the tail in order.
inline float DotF(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float r = HSum8(acc);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

inline __m256 I8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// a · q over n int8 values (the same lane structure as DotF).
inline float DotI8(const float* a, const int8_t* q, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), I8x8(q + i), acc);
  float r = HSum8(acc);
  for (; i < n; ++i) r += a[i] * static_cast<float>(q[i]);
  return r;
}

inline float ScaleAt(const uint8_t* region, int bs, int width, int j) {
  uint16_t h;
  std::memcpy(&h, region + static_cast<size_t>(bs) * width + 2 * j, 2);
  return Bf16ToF32(h);
}

// o[0, n) += w · v[0, n) (one FMA per element, in the caller's position order).
inline void Axpy(float w, const float* v, float* o, int n) {
  const __m256 wb = _mm256_set1_ps(w);
  int d = 0;
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(o + d, _mm256_fmadd_ps(wb, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
  for (; d < n; ++d) o[d] = std::fma(w, v[d], o[d]);
}

inline void AxpyI8(float w, const int8_t* v, float* o, int n) {
  const __m256 wb = _mm256_set1_ps(w);
  int d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(wb, I8x8(v + d), _mm256_loadu_ps(o + d)));
  for (; d < n; ++d) o[d] = std::fma(w, static_cast<float>(v[d]), o[d]);
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
  for (int b = 0; b < n_blocks; ++b) {
    const int nj = std::min(bs, n_ctx - b * bs);
    const uint8_t* c = kv.K(layer, blocks[b], 0);
    const uint8_t* r = kv.V(layer, blocks[b], 0);
    if (!i8) {
      KvToF32(c, nj * R, s.dtype, blk_c);
      KvToF32(r, nj * P, s.dtype, blk_r);
    }
    for (int j = 0; j < nj; ++j) {
      for (int hh = 0; hh < nh; ++hh) {
        const float* qh = q + static_cast<size_t>(h0 + hh) * W;
        float sc;
        if (i8) {
          sc = DotI8(qh, reinterpret_cast<const int8_t*>(c) + static_cast<size_t>(j) * R, R) * ScaleAt(c, bs, R, j) +
               DotI8(qh + R, reinterpret_cast<const int8_t*>(r) + static_cast<size_t>(j) * P, P) * ScaleAt(r, bs, P, j);
        } else {
          sc = DotF(qh, blk_c + static_cast<size_t>(j) * R, R) + DotF(qh + R, blk_r + static_cast<size_t>(j) * P, P);
        }
        scores[hh * stride + static_cast<size_t>(b) * bs + j] = sc * scale;
      }
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
  // Pass 2: out_h = Σ_j w_hj c_j in position order.
  for (int b = 0; b < n_blocks; ++b) {
    const int nj = std::min(bs, n_ctx - b * bs);
    const uint8_t* c = kv.K(layer, blocks[b], 0);
    if (!i8) KvToF32(c, nj * R, s.dtype, blk_c);
    for (int hh = 0; hh < nh; ++hh) {
      const float* w = scores + hh * stride + static_cast<size_t>(b) * bs;
      float* o = out + static_cast<size_t>(h0 + hh) * R;
      for (int j = 0; j < nj; ++j) {
        if (i8) {
          AxpyI8(w[j] * ScaleAt(c, bs, R, j), reinterpret_cast<const int8_t*>(c) + static_cast<size_t>(j) * R, o, R);
        } else {
          Axpy(w[j], blk_c + static_cast<size_t>(j) * R, o, R);
        }
      }
    }
  }
}

}  // namespace qkv
