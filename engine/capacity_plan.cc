#include "engine/capacity_plan.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

namespace qkv {

StatusOr<int64_t> ParseByteSize(const std::string& s) {
  static const std::regex re(R"(^\s*(\d+(?:\.\d+)?(?:[eE]\d+)?)\s*([KMGT]i?B?|B)?\s*$)", std::regex::icase);
  std::smatch m;
  if (!std::regex_match(s, m, re)) return InvalidArgument("cannot parse size '" + s + "' (e.g. 512MiB, 16GiB)");
  double v = std::stod(m[1]);
  std::string unit = m[2];
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (!unit.empty() && unit != "B") {
    const double base = unit.find('I') != std::string::npos ? 1024.0 : 1000.0;
    const size_t power = std::string("KMGT").find(unit[0]) + 1;
    for (size_t i = 0; i < power; ++i) v *= base;
  }
  return static_cast<int64_t>(v);
}

StatusOr<KvElement> ParseKvElement(const std::string& d) {
  if (d == "bf16" || d == "f16") return KvElement{2, 0};
  if (d == "f32") return KvElement{4, 0};
  if (d == "int8") return KvElement{1, 2};
  return InvalidArgument("--dtype must be bf16, f16, f32 or int8, got '" + d + "'");
}

StatusOr<CapacityPlan> PlanCapacity(const std::string& config_json, int64_t memory_bytes, int64_t context,
                                    KvElement element) {
  const int bytes_per_element = element.bytes, scale_bytes = element.scale_bytes;
  const auto j = nlohmann::json::parse(config_json, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgument("config: not a JSON object");
  auto geti = [&](const char* k, int64_t dflt) -> int64_t {
    return j.contains(k) && j[k].is_number_integer() ? j[k].get<int64_t>() : dflt;
  };
  const int64_t layers = geti("num_hidden_layers", 0);
  const int64_t heads = geti("num_attention_heads", 0);
  if (layers <= 0) return InvalidArgument("config: num_hidden_layers is required");
  if (heads <= 0 && !j.contains("kv_lora_rank")) return InvalidArgument("config: num_attention_heads is required");
  const int64_t kv_heads = geti("num_key_value_heads", heads);
  const int64_t hidden = geti("hidden_size", 0);
  const int64_t head_dim = geti("head_dim", heads > 0 && hidden > 0 ? hidden / heads : 0);
  if (context <= 0) return InvalidArgument("context must be positive");
  if (memory_bytes <= 0) return InvalidArgument("memory must be positive");
  CapacityPlan p;
  p.memory_bytes = memory_bytes;
  p.context = context;
  // Which layers hold KV.
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    for (const auto& t : j["layer_types"]) {
      const std::string s = t.is_string() ? t.get<std::string>() : "";
      if (s == "sliding_attention")
        ++p.sliding_layers;
      else if (s == "linear_attention")
        ++p.linear_layers;
      else
        ++p.full_layers;
    }
  } else if (geti("full_attention_interval", 0) > 0) {
    const int64_t k = geti("full_attention_interval", 1);
    for (int64_t l = 0; l < layers; ++l) ((l + 1) % k == 0 ? p.full_layers : p.linear_layers)++;
  } else {
    p.full_layers = static_cast<int>(layers);
  }
  p.sliding_window = geti("sliding_window", 0);
  if (p.sliding_layers > 0 && p.sliding_window <= 0)
    return InvalidArgument("config: sliding layers need sliding_window");
  if (j.contains("kv_lora_rank") && j["kv_lora_rank"].is_number_integer()) {
    p.mla = true;
    const int64_t per_layer =
        (geti("kv_lora_rank", 0) + geti("qk_rope_head_dim", 0)) * bytes_per_element + 2 * scale_bytes;
    p.kv_bytes_per_token = p.full_layers * per_layer;
  } else {
    if (head_dim <= 0) return InvalidArgument("config: head_dim (or hidden_size / num_attention_heads) is required");
    const int64_t per_layer = 2 * kv_heads * (head_dim * bytes_per_element + scale_bytes);
    p.kv_bytes_per_token = p.full_layers * per_layer;
    p.sliding_bytes_per_token = p.sliding_layers * per_layer;
  }
  if (p.linear_layers > 0) {  // Gated DeltaNet state (Qwen3-Next, Qwen3.5), when described
    // What the engine keeps per sequence and layer (model_config.h LinearAttnConfig, always f32 whatever
    // the KV dtype): the conv window, the d_k × d_v matrix per value head, and the open chunk's keys/values.
    LinearAttnConfig la;
    la.conv_kernel = static_cast<int>(geti("linear_conv_kernel_dim", 4));
    la.n_k_heads = static_cast<int>(geti("linear_num_key_heads", 0));
    la.n_v_heads = static_cast<int>(geti("linear_num_value_heads", 0));
    la.k_dim = static_cast<int>(geti("linear_key_head_dim", 0));
    la.v_dim = static_cast<int>(geti("linear_value_head_dim", 0));
    if (la.conv_kernel < 1 || la.n_k_heads < 0 || la.n_v_heads < 0 || la.k_dim < 0 || la.v_dim < 0 ||
        la.n_k_heads > 4096 || la.n_v_heads > 4096 || la.k_dim > 4096 || la.v_dim > 4096 || la.conv_kernel > 64) {
      return InvalidArgument("config: linear attention dimensions out of range");
    }
    p.linear_state_bytes = p.linear_layers * la.state_bytes();
  }
  p.bytes_per_session = p.kv_bytes_per_token * context +
                        p.sliding_bytes_per_token * std::min(context, p.sliding_window) + p.linear_state_bytes;
  p.tokens_fit = p.kv_bytes_per_token > 0 ? memory_bytes / p.kv_bytes_per_token : 0;
  p.sessions_fit = p.bytes_per_session > 0 ? memory_bytes / p.bytes_per_session : 0;
  return p;
}

std::string CapacityPlan::ToJson() const {
  return nlohmann::json{{"kv_bytes_per_token", kv_bytes_per_token},
                        {"sliding_bytes_per_token", sliding_bytes_per_token},
                        {"sliding_window", sliding_window},
                        {"full_attention_layers", full_layers},
                        {"sliding_attention_layers", sliding_layers},
                        {"linear_attention_layers", linear_layers},
                        {"mla", mla},
                        {"linear_state_bytes_per_session", linear_state_bytes},
                        {"memory_bytes", memory_bytes},
                        {"context", context},
                        {"bytes_per_session", bytes_per_session},
                        {"tokens_fit", tokens_fit},
                        {"sessions_fit", sessions_fit}}
      .dump();
}

std::string CapacityPlan::ToText() const {
  std::ostringstream o;
  o << "KV bytes per token:  " << kv_bytes_per_token << (mla ? " (MLA latent)" : "") << " over " << full_layers
    << " attention layers\n";
  if (sliding_layers) {
    o << "sliding layers:      " << sliding_layers << " x window " << sliding_window << " (" << sliding_bytes_per_token
      << " B per token up to the window)\n";
  }
  if (linear_layers)
    o << "linear layers:       " << linear_layers << " (fixed state " << linear_state_bytes << " B per sequence)\n";
  o << "memory:              " << memory_bytes << " B\n"
    << "tokens that fit:     " << tokens_fit << "\n"
    << "sessions of " << context << ": " << sessions_fit << " (" << bytes_per_session << " B each)\n";
  return o.str();
}

}  // namespace qkv
