// Element types of weights, activations and the KV cache.
#pragma once

#include <string>

#include "engine/status.h"

namespace qkv {

enum class DType { kF32, kBF16 };
const char* DTypeName(DType d);
StatusOr<DType> ParseDType(const std::string& s);
inline int DTypeBytes(DType d) { return d == DType::kF32 ? 4 : 2; }

}  // namespace qkv
