#include "engine/layers/layer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "engine/bf16.h"

namespace qkv {
namespace {

std::string ShapeStr(const std::vector<uint64_t>& ne) {
  std::string s = "{";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "}";
}

// The tensor `name` after checking that its shape (ggml order) is exactly `ne`.
StatusOr<const GgufTensor*> FindShaped(const GgufFile& f, const std::string& name, const std::vector<uint64_t>& ne) {
  const GgufTensor* t = f.UseTensor(name);
  if (!t) return DataLoss("model: missing tensor '" + name + "'");
  if (t->ne != ne) {
    return DataLoss("model: tensor '" + name + "' has shape " + ShapeStr(t->ne) + ", expected " + ShapeStr(ne));
  }
  return t;
}

// Every value of rows [r0, r1) (all of them by default) of a quantized tensor of rows of k values is
// finite (checked row by row, in place).
Status CheckQuantizedFinite(const GgufTensor& t, uint64_t k, uint64_t r0 = 0, uint64_t r1 = UINT64_MAX) {
  const uint64_t rb = GgmlRowBytes(t.type, k);
  const auto end = static_cast<int64_t>(std::min(r1, t.n_elements() / k));
  bool finite = true;
  // (the blocks' f16 scales only, on every thread: the file's pages are touched here first)
#pragma omp parallel for schedule(static) reduction(&& : finite)
  for (int64_t r = static_cast<int64_t>(r0); r < end; ++r) {
    finite = finite && GgmlValuesFinite(t.type, t.data + static_cast<uint64_t>(r) * rb, static_cast<int64_t>(k));
  }
  if (!finite) return DataLoss("model: tensor '" + t.name + "' holds a non-finite value");
  return {};
}

// Rows [r0, r0 + n) of tensor t (rows of k values) expanded to f32 into dst, which must all be finite.
Status ReadRows(const GgufTensor& t, uint64_t k, uint64_t r0, uint64_t n, const std::string& name, float* dst) {
  if (!GgmlTypeKnown(static_cast<uint32_t>(t.type))) {
    return DataLoss("gguf: tensor '" + t.name + "' has an unsupported type");
  }
  const uint64_t count = n * k;
  DequantizeRow(t.type, t.data + r0 * GgmlRowBytes(t.type, k), static_cast<int64_t>(count), dst);
  for (uint64_t j = 0; j < count; ++j) {
    if (!std::isfinite(dst[j])) return DataLoss("model: tensor '" + name + "' holds a non-finite value");
  }
  return {};
}

}  // namespace

StatusOr<std::vector<float>> ReadTensor(const GgufFile& f, const std::string& name, std::vector<uint64_t> ne) {
  QKV_ASSIGN_OR_RETURN(const GgufTensor* t, FindShaped(f, name, ne));
  std::vector<float> out(t->n_elements());
  QKV_RETURN_IF_ERROR(ReadRows(*t, t->n_elements(), 0, 1, name, out.data()));
  return out;
}

StatusOr<std::shared_ptr<const QuantWeights>> ReadQuantized(const GgufFile& f, const std::string& name, uint64_t rows,
                                                            uint64_t k, std::shared_ptr<WeightsArena> arena) {
  QKV_ASSIGN_OR_RETURN(const GgufTensor* t, FindShaped(f, name, {k, rows}));
  if (!GgmlIsQuantized(t->type)) return std::shared_ptr<const QuantWeights>();
  if (k % 32 != 0) return DataLoss("model: quantized tensor '" + name + "' has rows that are not whole 32-blocks");
  QKV_RETURN_IF_ERROR(CheckQuantizedFinite(*t, k));
  return std::make_shared<const QuantWeights>(
      std::vector<QuantWeights::Part>{{t->type, static_cast<int>(rows), t->data}}, static_cast<int>(k), nullptr,
      std::move(arena));
}

StatusOr<std::unique_ptr<Linear>> MakeLinear(const GgufFile& f, GemmRuntime& gemm, DType dtype, bool keep_quantized,
                                             const std::vector<WeightRows>& rows, int k, const float* bias) {
  const auto K = static_cast<uint64_t>(k);
  int n = 0;
  bool quant = keep_quantized && k % 32 == 0;
  std::vector<const GgufTensor*> tensors;
  for (const WeightRows& r : rows) {
    QKV_ASSIGN_OR_RETURN(const GgufTensor* t, FindShaped(f, r.tensor, r.ne(K)));
    quant = quant && GgmlIsQuantized(t->type);
    tensors.push_back(t);
    n += r.n;
  }
  if (quant) {
    std::vector<QuantWeights::Part> parts;
    for (size_t i = 0; i < rows.size(); ++i) {
      const GgufTensor* t = tensors[i];
      // Only the rows this GEMM takes (one expert's slice of a stacked tensor is checked once, not E times).
      const auto r0 = static_cast<uint64_t>(rows[i].r0);
      QKV_RETURN_IF_ERROR(CheckQuantizedFinite(*t, K, r0, r0 + static_cast<uint64_t>(rows[i].n)));
      parts.push_back({t->type, rows[i].n, t->data + static_cast<uint64_t>(rows[i].r0) * GgmlRowBytes(t->type, K)});
    }
    return Linear::CreateQuantized(gemm, std::make_shared<const QuantWeights>(parts, k, bias, gemm.weights_arena()));
  }
  // Only the rows this GEMM takes, expanded to f32 (one expert of a stacked tensor reads its slice alone).
  std::vector<float> w(static_cast<size_t>(n) * k);
  float* at = w.data();
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto r0 = static_cast<uint64_t>(rows[i].r0), n_i = static_cast<uint64_t>(rows[i].n);
    QKV_RETURN_IF_ERROR(ReadRows(*tensors[i], K, r0, n_i, rows[i].tensor, at));
    at += n_i * K;
  }
  return Linear::Create(gemm, w.data(), bias, n, k, dtype);
}

float* LayerScratch::TeamNormShare(const float* x, const std::vector<float>& norm, float eps, const Linear& lin,
                                   float* y) const {
  const int me = omp_get_thread_num();
  float* own = TeamRows(me);
  RmsNorm(x, norm.data(), own, static_cast<int>(norm.size()), eps);
  if (me == 0) timer->Mark(profile->norms);
  lin.ForwardShare(own, 1, y, [](int, int) {});
  return own;
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
