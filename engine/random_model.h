// Writes a GGUF model with random weights and a synthetic byte-level BPE tokenizer: the models tests,
// benchmarks and demos use, since no pretrained weights can be fetched here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/gguf.h"
#include "engine/model_config.h"

namespace qkv {

struct RandomModelOptions {
  GgmlType dtype = GgmlType::kF32;  // of the 2-D weights; norms, biases and sinks stay f32
  uint64_t seed = 0;
  std::string preset;  // a llama-quantize preset ("Q4_K_M"): types per tensor as it chooses them (dtype unused)
  std::vector<std::string> chat_stop;  // written as qkvserve.chat.stop when not empty
  int threads = 1;                     // encoder threads (the bytes do not depend on it)
};

// Tensor names follow llama.cpp (token_embd, blk.N.attn_q/k/v/output, attn_q_norm/attn_k_norm,
// attn_sinks, ffn_gate/up/down, output_norm, output). Weights are uniform with the variance of
// 1/fan_in so that activations keep their scale through the layers and logits are O(1).
Status WriteRandomModel(const ModelConfig& cfg, const RandomModelOptions& opt, const std::string& path);

}  // namespace qkv
