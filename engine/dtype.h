// Element types of weights, activations and the KV cache.
#pragma once

#include <string>

#include "engine/status.h"

namespace qkv {

enum class DType { kF32, kBF16 };
const char* DTypeName(DType d);
StatusOr<DType> ParseDType(const std::string& s);
inline int DTypeBytes(DType d) { return d == DType::kF32 ? 4 : 2; }

// How weights are held: `auto` keeps quantized tensors in their block formats and computes the rest in
// bf16; `bf16` and `f32` expand every tensor to that dtype at load.
struct WeightsMode {
  DType dtype = DType::kBF16;
  bool keep_quantized = true;
  std::string name() const { return keep_quantized ? "auto" : DTypeName(dtype); }
};
StatusOr<WeightsMode> ParseWeightsMode(const std::string& s);

}  // namespace qkv
