#include "engine/dtype.h"

namespace qkv {

const char* DTypeName(DType d) { return d == DType::kF32 ? "f32" : d == DType::kBF16 ? "bf16" : "int8"; }

StatusOr<DType> ParseDType(const std::string& s) {
  if (s == "f32") return DType::kF32;
  if (s == "bf16") return DType::kBF16;
  return InvalidArgument("dtype must be bf16 or f32, got '" + s + "'");
}

StatusOr<DType> ParseKvDType(const std::string& s) {
  if (s == "int8") return DType::kI8;
  if (s == "f32" || s == "bf16") return ParseDType(s);
  return InvalidArgument("kv dtype must be bf16, f32 or int8, got '" + s + "'");
}

StatusOr<WeightsMode> ParseWeightsMode(const std::string& s) {
  if (s == "auto") return WeightsMode{DType::kBF16, true};
  if (s == "f32") return WeightsMode{DType::kF32, false};
  if (s == "bf16") return WeightsMode{DType::kBF16, false};
  return InvalidArgument("weights dtype must be auto, bf16 or f32, got '" + s + "'");
}

}  // namespace qkv
