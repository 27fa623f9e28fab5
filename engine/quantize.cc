#include "engine/quantize.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <thread>

namespace qkv {
namespace {

const QuantPreset kPresets[] = {
    {"F32", GgmlType::kF32, 0},        {"F16", GgmlType::kF16, 1},      {"BF16", GgmlType::kBF16, 32},
    {"Q4_0", GgmlType::kQ4_0, 2},      {"Q4_1", GgmlType::kQ4_1, 3},    {"Q5_0", GgmlType::kQ5_0, 8},
    {"Q5_1", GgmlType::kQ5_1, 9},      {"Q8_0", GgmlType::kQ8_0, 7},    {"Q2_K", GgmlType::kQ2_K, 10},
    {"Q3_K_S", GgmlType::kQ3_K, 11},   {"Q3_K_M", GgmlType::kQ3_K, 12}, {"Q3_K_L", GgmlType::kQ3_K, 13},
    {"Q4_K_S", GgmlType::kQ4_K, 14},   {"Q4_K_M", GgmlType::kQ4_K, 15}, {"Q5_K_S", GgmlType::kQ5_K, 16},
    {"Q5_K_M", GgmlType::kQ5_K, 17},   {"Q6_K", GgmlType::kQ6_K, 18},   {"IQ4_NL", GgmlType::kIQ4_NL, 25},
    {"IQ4_XS", GgmlType::kIQ4_XS, 30},
};

bool EndsWith(const std::string& s, const std::string& t) {
  return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

// llama-quantize's "use more bits" layers: the first and last eighth, and every third one between.
bool UseMoreBits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

int LayerOf(const std::string& name) {
  if (name.rfind("blk.", 0) != 0) return 0;
  return std::atoi(name.c_str() + 4);
}

}  // namespace

std::optional<QuantPreset> FindQuantPreset(const std::string& name) {
  std::string u;
  for (char c : name) u += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const auto& p : kPresets)
    if (p.name == u) return p;
  return std::nullopt;
}

std::string QuantPresetNames() {
  std::string s;
  for (const auto& p : kPresets) s += (s.empty() ? "" : ", ") + p.name;
  return s;
}

QuantTypePlan::QuantTypePlan(QuantPreset p, int n_layers, int n_gqa, bool tied_embeddings)
    : p_(std::move(p)), n_layers_(std::max(1, n_layers)), n_gqa_(n_gqa), tied_(tied_embeddings) {}

GgmlType QuantTypePlan::TypeFor(const std::string& name, const std::vector<uint64_t>& ne, GgmlType current) {
  // What llama-quantize leaves alone: 1-D tensors, norms, anything not a weight.
  if (ne.size() < 2 || !EndsWith(name, "weight") || name.find("_norm.weight") != std::string::npos) return current;
  const GgmlType base = p_.base;
  const std::string& f = p_.name;
  GgmlType t = base;
  if (GgmlIsQuantized(base)) {
    const bool output = name == "output.weight" || (tied_ && name == "token_embd.weight");
    if (output) {
      if (ne[0] % GgmlBlockSize(base) != 0)
        t = GgmlType::kQ8_0;
      else if (base != GgmlType::kQ8_0)
        t = GgmlType::kQ6_K;
    } else if (name == "token_embd.weight") {
      // the preset's type
    } else if (EndsWith(name, "attn_v.weight")) {
      const int i = i_attn_v_++;
      if (f == "Q2_K")
        t = n_gqa_ >= 4 ? GgmlType::kQ4_K : GgmlType::kQ3_K;
      else if (f == "Q3_K_M")
        t = i < 2 ? GgmlType::kQ5_K : GgmlType::kQ4_K;
      else if (f == "Q3_K_L")
        t = GgmlType::kQ5_K;
      else if ((f == "IQ4_NL" || f == "IQ4_XS") && n_gqa_ >= 4)
        t = GgmlType::kQ5_K;
      else if ((f == "Q4_K_M" || f == "Q5_K_M") && UseMoreBits(i, n_layers_))
        t = GgmlType::kQ6_K;
      else if (f == "Q4_K_S" && i < 4)
        t = GgmlType::kQ5_K;
    } else if (EndsWith(name, "ffn_down.weight")) {
      const int i = LayerOf(name), n = n_layers_;
      if (f == "Q2_K")
        t = GgmlType::kQ3_K;
      else if (f == "Q3_K_M")
        t = i < n / 16 ? GgmlType::kQ5_K : GgmlType::kQ4_K;
      else if (f == "Q3_K_L")
        t = GgmlType::kQ5_K;
      else if (f == "Q4_K_M")
        t = UseMoreBits(i, n) ? GgmlType::kQ6_K : t;
      else if (i < n / 8 && (f == "IQ4_NL" || f == "IQ4_XS"))
        t = GgmlType::kQ5_K;
      else if (f == "Q5_K_M" && UseMoreBits(i, n))
        t = GgmlType::kQ6_K;
      else if (f == "Q4_K_S" && i < n / 8)
        t = GgmlType::kQ5_K;
    } else if (EndsWith(name, "attn_output.weight")) {
      if (f == "Q2_K")
        t = GgmlType::kQ3_K;
      else if (f == "Q3_K_M")
        t = GgmlType::kQ4_K;
      else if (f == "Q3_K_L")
        t = GgmlType::kQ5_K;
    } else if (EndsWith(name, "attn_qkv.weight")) {
      if (f == "Q3_K_M" || f == "Q3_K_L")
        t = GgmlType::kQ4_K;
      else if (f == "Q4_K_M")
        t = GgmlType::kQ5_K;
      else if (f == "Q5_K_M")
        t = GgmlType::kQ6_K;
    }
  }
  return GgmlFallbackType(t, ne[0]);
}

Status QuantizeModelFile(const std::string& in, const std::string& out, const QuantPreset& preset, int threads,
                         const std::function<void(uint64_t, uint64_t)>& progress,
                         std::vector<QuantizedTensorReport>* report) {
  QKV_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::Open(in));
  const std::string arch = f->GetStringOr("general.architecture", "llama");
  const int64_t n_layers = f->GetIntOr(arch + ".block_count", 1);
  const int64_t heads = f->GetIntOr(arch + ".attention.head_count", 1);
  const int64_t kv_heads = std::max<int64_t>(1, f->GetIntOr(arch + ".attention.head_count_kv", heads));
  const bool tied = f->FindTensor("output.weight") == nullptr;
  QuantTypePlan plan(preset, static_cast<int>(n_layers), static_cast<int>(heads / kv_heads), tied);

  GgufWriter w;
  for (const auto& [key, v] : f->metadata()) w.SetValue(key, v);
  GgufValue ft;
  ft.type = GgufType::kU32;
  ft.u = preset.file_type;
  ft.i = preset.file_type;
  w.SetValue("general.file_type", ft);
  GgufValue qv = ft;
  qv.u = qv.i = 2;
  w.SetValue("general.quantization_version", qv);

  // Each tensor is converted when the writer streams it (one tensor in memory at a time, whatever the model's
  // size); the report and the progress follow the file's order.
  uint64_t total = 0;
  for (const GgufTensor& t : f->tensors()) total += t.n_elements();
  auto done = std::make_shared<uint64_t>(0);
  threads = std::max(1, threads);
  if (report) report->clear();
  for (const GgufTensor& tensor : f->tensors()) {
    const GgufTensor* tp = &tensor;
    const GgmlType to = plan.TypeFor(tensor.name, tensor.ne, tensor.type);
    w.AddTensor(tensor.name, to, tensor.ne, [tp, to, threads, total, done, &progress, report](std::span<uint8_t> dst) {
      const GgufTensor& t = *tp;
      if (to == t.type) {
        if (dst.size() != t.nbytes) return DataLoss("gguf: tensor '" + t.name + "' has the wrong size");
        std::memcpy(dst.data(), t.data, t.nbytes);
        if (report) report->push_back({t.name, t.type, to, 0});
      } else {
        const uint64_t cols = t.ne[0], rows = t.n_elements() / cols;
        std::vector<float> src(t.n_elements());
        QKV_RETURN_IF_ERROR(DequantizeToF32(t, src.data()));
        const uint64_t rb = GgmlRowBytes(to, cols);
        std::vector<double> err(threads, 0.0);
        std::vector<std::thread> pool;
        for (int th = 0; th < threads; ++th) {
          pool.emplace_back([&, th] {
            std::vector<float> back(cols);
            for (uint64_t r = rows * th / threads; r < rows * (th + 1) / threads; ++r) {
              QuantizeRow(to, &src[r * cols], static_cast<int64_t>(cols), &dst[r * rb]);
              DequantizeRow(to, &dst[r * rb], static_cast<int64_t>(cols), back.data());
              for (uint64_t c = 0; c < cols; ++c) {
                const double d = double(back[c]) - src[r * cols + c];
                err[th] += d * d;
              }
            }
          });
        }
        for (auto& th : pool) th.join();
        double e = 0;
        for (double x : err) e += x;
        if (report) report->push_back({t.name, t.type, to, std::sqrt(e / static_cast<double>(t.n_elements()))});
      }
      *done += t.n_elements();
      if (progress) progress(*done, total);
      return Status{};
    });
  }
  return w.WriteFile(out);
}

}  // namespace qkv
