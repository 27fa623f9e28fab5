// Element types of weights, activations and the KV cache.
#pragma once

#include <string>

#include "engine/status.h"

namespace qkv {

// kI8 is a KV-cache type only (symmetric int8 with a bf16 scale per cached vector, kv_cache.h); weights and
// activations are f32 or bf16.
enum class DType { kF32, kBF16, kI8 };
const char* DTypeName(DType d);
// f32 or bf16 (weights, activations).
StatusOr<DType> ParseDType(const std::string& s);
// bf16, f32 or int8 (the KV cache).
StatusOr<DType> ParseKvDType(const std::string& s);
inline int DTypeBytes(DType d) { return d == DType::kF32 ? 4 : d == DType::kBF16 ? 2 : 1; }

// How weights are held: `auto` keeps quantized tensors in their block formats and computes the rest in
// bf16; `bf16` and `f32` expand every tensor to that dtype at load.
struct WeightsMode {
  DType dtype = DType::kBF16;
  bool keep_quantized = true;
  std::string name() const { return keep_quantized ? "auto" : DTypeName(dtype); }
};
StatusOr<WeightsMode> ParseWeightsMode(const std::string& s);

}  // namespace qkv
