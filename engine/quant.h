// ggml's element types and block formats, as GGUF files store them: f32/f16/bf16 and the quantized
// block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 values per block), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256
// per super-block), IQ4_NL (32) and IQ4_XS (256). The byte layouts are ggml's (ggml-common.h in
// llama.cpp); what each function computes is written next to it.
//
// Three views of a quantized row:
//   * DequantizeRow: the f32 values, computed with the same operations in the same order as the numpy
//     dequantization in llama.cpp's gguf-py (gguf/quants.py), so the two agree bit for bit (this file is
//     compiled with -ffp-contract=off so that no multiply-add is fused);
//   * DecodeRowI8: what the integer GEMM reads: one int8 per value plus, per group of 16 values, a
//     scale and an offset with value = scale × q − offset (the offset is 0 for types without a minimum);
//   * QuantizeRow: our own encoder for each type (qkv-model quantize and random models).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace qkv {

enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ4_NL = 20,
  kIQ4_XS = 23,
  kBF16 = 30,
};

// Whether the numeric value is a type this build reads.
bool GgmlTypeKnown(uint32_t t);
// Lower-case name as llama.cpp prints it ("q4_k", "iq4_xs", "bf16").
const char* GgmlTypeName(GgmlType t);
// Parses a name, case-insensitive ("Q4_K", "q8_0", "f16").
std::optional<GgmlType> GgmlTypeFromName(const std::string& s);
// Elements per block (1 for f32/f16/bf16) and bytes per block.
uint64_t GgmlBlockSize(GgmlType t);
uint64_t GgmlBlockBytes(GgmlType t);
// Bytes for `n` elements (n must be a multiple of the block size).
inline uint64_t GgmlRowBytes(GgmlType t, uint64_t n) { return n / GgmlBlockSize(t) * GgmlBlockBytes(t); }
inline bool GgmlIsQuantized(GgmlType t) { return t != GgmlType::kF32 && t != GgmlType::kF16 && t != GgmlType::kBF16; }

// The type llama-quantize falls back to when a row of `ncols` values is not a whole number of t's
// blocks: IQ4_XS → IQ4_NL; Q2_K, Q3_K → Q4_0; Q4_K → Q5_0; Q5_K → Q5_1; Q6_K → Q8_0; and f16 when even
// that does not fit. t itself when it fits.
GgmlType GgmlFallbackType(GgmlType t, uint64_t ncols);
// llama.cpp's general.file_type for a file whose 2-D weights are all of type t (the _S variant for K types).
uint32_t GgmlFileType(GgmlType t);

// n values (a multiple of the block size) from `src` in type t to f32.
void DequantizeRow(GgmlType t, const uint8_t* src, int64_t n, float* dst);
// Whether the n values (a multiple of the block size) at `src` in type t are all finite, without expanding
// them: for the block types, whether every block's f16 scales (and minimums) are; the rest of a block is
// small integers, so a value is finite exactly when they are.
bool GgmlValuesFinite(GgmlType t, const uint8_t* src, int64_t n);
// n values to type t (our own encoders: for each block, the scales that minimise the squared error
// among a search of candidates that includes ggml's reference choice).
void QuantizeRow(GgmlType t, const float* src, int64_t n, uint8_t* dst);

// The integer view of a quantized row of n values: q[n] int8, and per group of 16 values scale[n/16]
// and offset[n/16] (value ≈ scale × q − offset; equal up to rounding to DequantizeRow). Returns whether
// any offset is nonzero (types with a minimum: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K).
bool DecodeRowI8(GgmlType t, const uint8_t* src, int64_t n, int8_t* q, float* scale, float* offset);

}  // namespace qkv
