#include "engine/layers/layer.h"

#include <cmath>

#include "engine/bf16.h"

namespace qkv {
namespace {

std::string ShapeStr(const std::vector<uint64_t>& ne) {
  std::string s = "{";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "}";
}

}  // namespace

StatusOr<std::vector<float>> ReadTensor(const GgufFile& f, const std::string& name, std::vector<uint64_t> ne) {
  const GgufTensor* t = f.FindTensor(name);
  if (!t) return DataLoss("model: missing tensor '" + name + "'");
  if (t->ne != ne) {
    return DataLoss("model: tensor '" + name + "' has shape " + ShapeStr(t->ne) + ", expected " + ShapeStr(ne));
  }
  std::vector<float> out(t->n_elements());
  QKV_RETURN_IF_ERROR(DequantizeToF32(*t, out.data()));
  for (float v : out) {
    if (!std::isfinite(v)) return DataLoss("model: tensor '" + name + "' holds a non-finite value");
  }
  return out;
}

void LayerScratch::Gemm(const Linear& lin, const float* x, int rows, float* y) const {
  const void* in = x;
  if (lin.input_dtype() == DType::kBF16) {
    F32ToBf16Bulk(x, bf16_in, static_cast<int64_t>(rows) * lin.k());
    in = bf16_in;
  }
  lin.Forward(in, rows, y);
}

}  // namespace qkv
