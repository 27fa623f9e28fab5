#include "engine/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/bf16.h"
#include "engine/kernels/ops.h"

namespace qkv {
namespace {

// Converts n cache elements to f32 (a plain copy for f32 caches).
inline void ToF32(const uint8_t* src, int n, DType dt, float* dst) {
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

inline void Store(uint8_t* dst, size_t index, float v, DType dt) {
  if (dt == DType::kF32) {
    std::memcpy(dst + 4 * index, &v, 4);
  } else {
    const uint16_t h = F32ToBf16(v);
    std::memcpy(dst + 2 * index, &h, 2);
  }
}

// Scores of one head against one block of 16 transposed keys: two 8-lane FMA chains over the dims.
inline void BlockScores16(const float* q, const float* kt, int hd, float scale, float* sc) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int d = 0; d < hd; ++d) {
    const __m256 qd = _mm256_broadcast_ss(q + d);
    a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt + d * 16), a0);
    a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt + d * 16 + 8), a1);
  }
  const __m256 s = _mm256_set1_ps(scale);
  _mm256_storeu_ps(sc, _mm256_mul_ps(a0, s));
  _mm256_storeu_ps(sc + 8, _mm256_mul_ps(a1, s));
}

// max over x[0, n) (exact in any order).
inline float Max(const float* x, int n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float r = -INFINITY;
  for (float v : lanes) r = std::max(r, v);
  for (; j < n; ++j) r = std::max(r, x[j]);
  return r;
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

}  // namespace

// Within a block, keys are stored transposed ([head_dim][block_size]) so that the scores of a whole
// block are block_size independent FMA chains over the dimensions (no horizontal sums); values are
// stored row-major ([block_size][head_dim]) for the weighted sum.
void StoreKv(KvCache& kv, int layer, const int* blocks, int pos, const float* k, const float* v) {
  const KvCacheShape& s = kv.shape();
  const int block = blocks[pos / s.block_size];
  const int slot = pos % s.block_size;
  for (int h = 0; h < s.n_kv_heads; ++h) {
    uint8_t* kb = kv.K(layer, block, h);
    uint8_t* vb = kv.V(layer, block, h);
    for (int d = 0; d < s.head_dim; ++d) {
      Store(kb, static_cast<size_t>(d) * s.block_size + slot, k[h * s.head_dim + d], s.dtype);
      Store(vb, static_cast<size_t>(slot) * s.head_dim + d, v[h * s.head_dim + d], s.dtype);
    }
  }
}

size_t AttentionScratchFloats(int group, int n_ctx, int head_dim, int block_size) {
  return static_cast<size_t>(group) * (n_ctx + block_size + 8) + static_cast<size_t>(head_dim) * block_size;
}

void AttendGroup(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out,
                 const AttentionShape& shape, int g, float* scratch) {
  const KvCacheShape& s = kv.shape();
  const int hd = shape.head_dim;
  const int bs = s.block_size;
  const int group = shape.n_heads / shape.n_kv_heads;
  const int h0 = g * group;
  const int n_blocks = (n_ctx + bs - 1) / bs;
  // Per-head score row, padded to whole blocks and to whole 8-lane vectors.
  const size_t stride = (static_cast<size_t>(n_blocks) * bs + 7) / 8 * 8;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));  // scores = q·k / sqrt(d_head)
  float* scores = scratch;                                       // [group][stride]
  float* blk = scratch + static_cast<size_t>(group) * stride;    // one block of K or V as f32

  // Pass 1: scores, block by block in position order. Slots past n_ctx in the last block are computed
  // from stale data and then ignored (never read into the softmax).
  for (int b = 0; b < n_blocks; ++b) {
    ToF32(kv.K(layer, blocks[b], g), hd * bs, s.dtype, blk);  // [hd][bs]
    for (int hh = 0; hh < group; ++hh) {
      const float* qh = q + (h0 + hh) * hd;
      float* sc = scores + hh * stride + static_cast<size_t>(b) * bs;
      if (bs == 16) {
        BlockScores16(qh, blk, hd, scale, sc);
      } else {
        for (int j = 0; j < bs; ++j) sc[j] = 0.0f;
        for (int d = 0; d < hd; ++d) {
          const float qd = qh[d];
          const float* kd = blk + static_cast<size_t>(d) * bs;
          for (int j = 0; j < bs; ++j) sc[j] += qd * kd[j];
        }
        for (int j = 0; j < bs; ++j) sc[j] *= scale;
      }
    }
  }
  // Softmax per head over [0, n_ctx), with the optional sink in the denominator.
  for (int hh = 0; hh < group; ++hh) {
    float* sc = scores + hh * stride;
    float m = Max(sc, n_ctx);
    const float sink = shape.sinks ? shape.sinks[h0 + hh] : -INFINITY;
    m = std::max(m, sink);
    // Exponentials 8 at a time over whole vectors (the row is padded to whole blocks; lanes past n_ctx
    // are never read), so a position's weight does not depend on where n_ctx ends.
    const __m256 mv = _mm256_set1_ps(m);
    for (int j = 0; j < n_ctx; j += 8) _mm256_storeu_ps(sc + j, FastExp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv)));
    float sum = Sum(sc, n_ctx);
    if (shape.sinks) sum += FastExp(sink - m);
    const float inv = 1.0f / sum;
    for (int j = 0; j < n_ctx; ++j) sc[j] *= inv;
    std::memset(out + (h0 + hh) * hd, 0, sizeof(float) * hd);
  }
  // Pass 2: Σ_j w_j v_j in position order.
  for (int b = 0; b < n_blocks; ++b) {
    const int nj = std::min(bs, n_ctx - b * bs);
    ToF32(kv.V(layer, blocks[b], g), hd * nj, s.dtype, blk);  // [nj][hd]
    for (int hh = 0; hh < group; ++hh) {
      const float* w = scores + hh * stride + static_cast<size_t>(b) * bs;
      float* o = out + (h0 + hh) * hd;
      if (hd == 64) {
        WeightedSum<64>(w, blk, nj, o);
      } else if (hd == 128) {
        WeightedSum<128>(w, blk, nj, o);
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

}  // namespace qkv
