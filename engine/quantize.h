// Quantizing a model file the way llama.cpp's llama-quantize does: its presets (file types) and, for each
// tensor, the type its rules pick (dense models without an importance matrix), with its fallbacks for rows
// that are not whole blocks. The values are encoded by our own encoders (quant.h).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/gguf.h"
#include "engine/status.h"

namespace qkv {

struct QuantPreset {
  std::string name;    // as llama-quantize spells it: "Q4_K_M", "Q8_0", "IQ4_XS", "F16"
  GgmlType base;       // the type most tensors get
  uint32_t file_type;  // general.file_type (llama_ftype)
};
std::optional<QuantPreset> FindQuantPreset(const std::string& name);  // case-insensitive
std::string QuantPresetNames();

// The type of each tensor under a preset. Call TypeFor in file order (llama-quantize counts attn_v
// tensors as it goes).
class QuantTypePlan {
 public:
  QuantTypePlan(QuantPreset p, int n_layers, int n_gqa, bool tied_embeddings);
  // ne in ggml order; tensors that stay as they are (1-D, norms) get `current`.
  GgmlType TypeFor(const std::string& name, const std::vector<uint64_t>& ne, GgmlType current);

 private:
  QuantPreset p_;
  int n_layers_, n_gqa_;
  bool tied_;
  int i_attn_v_ = 0;
};

struct QuantizedTensorReport {
  std::string name;
  GgmlType from, to;
  double rmse = 0;  // against the source values
};

// Reads `in`, writes `out` with every tensor's type chosen by the preset's plan and the metadata copied
// (general.file_type set). `threads` encoders; progress(done, total) is called after each tensor.
Status QuantizeModelFile(const std::string& in, const std::string& out, const QuantPreset& preset, int threads,
                         const std::function<void(uint64_t, uint64_t)>& progress,
                         std::vector<QuantizedTensorReport>* report);

}  // namespace qkv
