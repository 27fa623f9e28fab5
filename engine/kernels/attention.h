// Causal scaled-dot-product attention over the paged KV cache.
//
// For a query at position p, the scores are q·k_j / sqrt(head_dim) for j = 0..p only (a future position
// gets exactly zero weight because it is never visited), softmax, then Σ_j w_j v_j. With sinks, the
// head's learnable sink logit joins the softmax denominator and takes no value (gpt-oss). GQA: the
// n_heads / n_kv_heads query heads of a group share one pass over their kv head's K and V.
// Keys are walked in position order, whatever the chunking of the sequence, so results do not depend
// on how a prompt was split into steps.
//
// Cache dtypes: f32 and bf16 blocks of 16 slots (head_dim a multiple of 16) are read in registers, up to 8
// blocks and 8 heads per tile so that enough independent FMA chains are in flight; other shapes are converted
// to f32 one block at a time. Either way a score is one FMA chain over the dims in order and an output
// element one chain over the positions in order, so the bits are the same. int8 (kv_cache.h: a bf16
// scale per token and kv head, for K and for V) is read in registers: score_j = (q · k_int_j) × s_j /
// sqrt(d_head), and the weighted sum uses w_j × s_j on v_int_j. Each element's sum is one chain in
// position order, so the same-bits guarantees hold for int8 as for the others.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/kv_cache.h"

namespace qkv {

// Cache element helpers shared by the attention kernels (this one and mla_attention.h).
// n elements of a cache region in dtype dt (f32 or bf16) as f32.
void KvToF32(const uint8_t* src, int n, DType dt, float* dst);
// Element `index` of an f32 or bf16 region.
void StoreKvElement(uint8_t* dst, size_t index, float v, DType dt);
// One int8 cached vector of n values (element i at q[i * stride]) and its bf16 scale: scale =
// bf16(max|x| / 127), q = clamp(round half to even(x / scale), -127, 127).
void QuantizeKvI8(const float* x, int n, int8_t* q, size_t stride, uint8_t* scale_out);
// The bf16 scales of the first n vectors of an int8 region (its bs × width values come first, then one bf16
// scale per vector), each × mul, as f32 in out[0, n).
void KvI8Scales(const uint8_t* region, int bs, int width, int n, float mul, float* out);

struct AttentionShape {
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  const float* sinks = nullptr;  // n_heads logits, or nullptr
};

// Writes one token's rotated K row and its V row (each n_kv_heads * head_dim f32) at position pos, in the
// cache's dtype (int8: quantized per kv head, K and V each with its own scale).
void StoreKv(KvCache& kv, int layer, const int* blocks, int pos, const float* k, const float* v);
// The same for kv head h alone (k, v: that head's head_dim values).
void StoreKvHead(KvCache& kv, int layer, const int* blocks, int pos, int h, const float* k, const float* v);

size_t AttentionScratchFloats(int group, int n_ctx, int head_dim, int block_size);

// Attention of one query token (all heads of kv head `g`) over positions [0, n_ctx).
// q: n_heads * head_dim; out: n_heads * head_dim (only group g's heads are written).
// scratch: AttentionScratchFloats(n_heads / n_kv_heads, n_ctx, head_dim, block_size) floats.
void AttendGroup(const KvCache& kv, int layer, const int* blocks, int n_ctx, const float* q, float* out,
                 const AttentionShape& shape, int g, float* scratch);

}  // namespace qkv
