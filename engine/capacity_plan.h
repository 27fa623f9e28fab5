// KV-cache capacity planning from a Hugging Face config.json: bytes per token and how many tokens and
// sessions fit in a memory budget. Understands GQA/MQA (num_key_value_heads), head_dim, MLA
// (kv_lora_rank + qk_rope_head_dim values cached per layer per token, no separate K and V), hybrid models
// (layer_types with full_attention / sliding_attention / linear_attention entries, or
// full_attention_interval: only attention layers hold KV, linear-attention layers hold a fixed state)
// and sliding windows (sliding layers hold at most sliding_window tokens).
#pragma once

#include <cstdint>
#include <string>

#include "engine/linear_attn.h"
#include "engine/status.h"

namespace qkv {

struct CapacityPlan {
  int64_t kv_bytes_per_token = 0;       // full-attention (or MLA) layers, per token
  int64_t sliding_bytes_per_token = 0;  // sliding layers, per token up to the window
  int64_t sliding_window = 0;
  int full_layers = 0, sliding_layers = 0, linear_layers = 0;
  bool mla = false;
  int64_t linear_state_bytes = 0;  // per sequence, when the config describes the state (else 0)
  int64_t memory_bytes = 0;
  int64_t context = 0;
  int64_t bytes_per_session = 0;  // one sequence of `context` tokens
  int64_t tokens_fit = 0;         // tokens of KV that fit in memory_bytes (full layers' figure)
  int64_t sessions_fit = 0;       // sequences of `context` tokens that fit
  std::string ToJson() const;
  std::string ToText() const;
};

// The size of a cached element: bytes per K/V (or MLA) value, and bytes of scale per cached vector (one
// token's K, or V, of one kv head; an MLA latent; an MLA rope key): 2 for qkvserve's int8 cache (a bf16
// scale), else 0. A linear (Gated DeltaNet) layer's state is f32 whatever the KV dtype: the conv window, the
// matrix and the open chunk (model_config.h LinearAttnConfig::state_bytes, what the engine allocates).
struct KvElement {
  int bytes = 2;
  int scale_bytes = 0;
};
// bf16, f16, f32 or int8 (qkvserve's --kv-dtype int8).
StatusOr<KvElement> ParseKvElement(const std::string& dtype);

StatusOr<CapacityPlan> PlanCapacity(const std::string& config_json, int64_t memory_bytes, int64_t context,
                                    KvElement element);

// "16GiB", "512MiB", "1e9": bytes.
StatusOr<int64_t> ParseByteSize(const std::string& s);

}  // namespace qkv
