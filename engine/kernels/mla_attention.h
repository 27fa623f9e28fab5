// Causal attention of multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged cache, in the
// absorbed form: every head attends over the same per-token vectors, so MLA is MQA with wide heads.
//
// Per token and layer the cache holds c_j, the normalized latent (kv_lora_rank = R values, the K plane of
// the arena), and k_pe_j, the rotated rope key shared by all heads (qk_rope_dim = P values, the V plane);
// nothing per head. A head's query comes already taken into latent space (q_lat = W_UKᵀ q_nope, R values)
// and followed by its rotated rope part (P values). Then
//   score_j = (q_lat · c_j + q_pe · k_pe_j) × scale   for j = 0..p (the future is never visited),
//   w = softmax(score),  out = Σ_j w_j c_j             (R values; the layer applies W_UV per head).
// Both planes are stored row-major ([slot][width]). int8 (kv_cache.h): c_j and k_pe_j are quantized each
// with its own bf16 scale, and read in registers: q_lat · c_int_j × s_c + q_pe · k_pe_int_j × s_pe, and
// the weighted sum runs on w_j × s_c and c_int_j. Each score is a fixed-lane dot product and each output
// element one FMA chain in position order, so a head's result depends only on its query, its position and
// the cache: not on chunking, batching, or which other heads and tokens share a tile (scores run up to 4 heads
// × 2 cached tokens per tile at the AVX2 level, × 4 at the AVX-512 levels). Cached rows are read in place in
// the cache's dtype and widened in registers. The kernels are chosen per level (kernels/cpu.h): 8-lane dot products
// at the AVX2 level, 16-lane ones at the AVX-512 levels (other bits between levels, the same within one);
// the weighted sums have the same bits at every level.
#pragma once

#include <cstddef>

#include "engine/kv_cache.h"

namespace qkv {

// Writes one token's latent (R = the cache's head_dim) and rotated rope key (P = its value_dim) at pos.
void StoreLatent(KvCache& kv, int layer, const int* blocks, int pos, const float* latent, const float* rope_key);

// Floats of scratch AttendLatent needs for n_heads heads over up to n_ctx positions.
size_t LatentAttentionScratchFloats(int n_heads, int n_ctx, int block_size);

// Attention of one query token for heads [h0, h0 + nh) over positions [0, n_ctx).
// q: per head R + P values [q_lat | q_pe], heads at stride R + P; out: per head R values, heads at stride R
// (only heads h0.. are read and written). scale: the softmax scale (llama.cpp's kq_scale).
void AttendLatent(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out, int h0,
                  int nh, float scale, float* scratch);

}  // namespace qkv
