#include "engine/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/kernels/bf16.h"
#include "engine/kernels/ops.h"

namespace qkv {
namespace {

inline void StoreRow(uint8_t* dst, const float* src, int n, DType dt) {
  if (dt == DType::kF32) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else {
    auto* d = reinterpret_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = F32ToBf16(src[i]);
  }
}

// Returns the row as f32: a pointer into the cache for f32, or `tmp` filled from bf16.
inline const float* LoadRow(const uint8_t* src, int n, DType dt, float* tmp) {
  if (dt == DType::kF32) return reinterpret_cast<const float*>(src);
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (int i = 0; i < n; ++i) tmp[i] = Bf16ToF32(s[i]);
  return tmp;
}

}  // namespace

void StoreKv(KvCache& kv, int layer, const int* blocks, int pos, const float* k, const float* v) {
  const KvCacheShape& s = kv.shape();
  const int block = blocks[pos / s.block_size];
  const size_t slot = static_cast<size_t>(pos % s.block_size) * s.head_dim * DTypeBytes(s.dtype);
  for (int h = 0; h < s.n_kv_heads; ++h) {
    StoreRow(kv.K(layer, block, h) + slot, k + h * s.head_dim, s.head_dim, s.dtype);
    StoreRow(kv.V(layer, block, h) + slot, v + h * s.head_dim, s.head_dim, s.dtype);
  }
}

void AttendGroup(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out,
                 const AttentionShape& shape, int g, float* scratch) {
  const KvCacheShape& s = kv.shape();
  const int hd = shape.head_dim;
  const int group = shape.n_heads / shape.n_kv_heads;
  const int h0 = g * group;
  const size_t row_bytes = static_cast<size_t>(hd) * DTypeBytes(s.dtype);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));  // scores = q·k / sqrt(d_head)
  float* scores = scratch;                // [group][n_ctx]
  float* tmp = scratch + static_cast<size_t>(group) * n_ctx;  // one converted row

  // Pass 1: scores, walking positions in order.
  for (int j = 0; j < n_ctx; ++j) {
    const int block = blocks[j / s.block_size];
    const float* k = LoadRow(kv.K(layer, block, g) + (j % s.block_size) * row_bytes, hd, s.dtype, tmp);
    for (int hh = 0; hh < group; ++hh) scores[static_cast<size_t>(hh) * n_ctx + j] = Dot(q + (h0 + hh) * hd, k, hd) * scale;
  }
  // Softmax per head (with the optional sink in the denominator); weights overwrite the scores.
  for (int hh = 0; hh < group; ++hh) {
    float* sc = scores + static_cast<size_t>(hh) * n_ctx;
    float m = -INFINITY;
    for (int j = 0; j < n_ctx; ++j) m = std::max(m, sc[j]);
    const float sink = shape.sinks ? shape.sinks[h0 + hh] : -INFINITY;
    m = std::max(m, sink);
    float sum = 0;
    for (int j = 0; j < n_ctx; ++j) {
      sc[j] = std::exp(sc[j] - m);
      sum += sc[j];
    }
    if (shape.sinks) sum += std::exp(sink - m);
    const float inv = 1.0f / sum;
    for (int j = 0; j < n_ctx; ++j) sc[j] *= inv;
    std::memset(out + (h0 + hh) * hd, 0, sizeof(float) * hd);
  }
  // Pass 2: weighted sum of V, in position order.
  for (int j = 0; j < n_ctx; ++j) {
    const int block = blocks[j / s.block_size];
    const float* v = LoadRow(kv.V(layer, block, g) + (j % s.block_size) * row_bytes, hd, s.dtype, tmp);
    for (int hh = 0; hh < group; ++hh) {
      const float w = scores[static_cast<size_t>(hh) * n_ctx + j];
      float* o = out + (h0 + hh) * hd;
      for (int d = 0; d < hd; ++d) o[d] += w * v[d];
    }
  }
}

}  // namespace qkv
