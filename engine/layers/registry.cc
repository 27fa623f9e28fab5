// Every layer kind the engine knows, and which kinds a model's blocks are made of.
#include "engine/layers/layer.h"

namespace qkv {

StatusOr<std::unique_ptr<Layer>> MakeGqaAttention(const LayerInit& in);   // gqa_attention.cc
StatusOr<std::unique_ptr<Layer>> MakeDenseSwiGlu(const LayerInit& in);    // dense_swiglu.cc
StatusOr<std::unique_ptr<Layer>> MakeMlaAttention(const LayerInit& in);   // mla_attention.cc
StatusOr<std::unique_ptr<Layer>> MakeMoeSwiGlu(const LayerInit& in);      // moe_swiglu.cc
StatusOr<std::unique_ptr<Layer>> MakeGatedDeltaNet(const LayerInit& in);  // gated_deltanet.cc

// llama.cpp's LLAMA_ROPE_TYPE_NORM (interleaved) for llama and deepseek2, NEOX (halves) for qwen2/qwen3; qwen35's
// IMROPE rotates halves too, and for text every M-RoPE section sees the same position: plain halves.
RopeStyle RopeStyleOf(Arch a) {
  return a == Arch::kLlama || a == Arch::kDeepseek2 ? RopeStyle::kInterleaved : RopeStyle::kHalves;
}

namespace {
constexpr LayerKind kKinds[] = {
    {"gqa_attention", &MakeGqaAttention, /*caches_tokens=*/true},
    {"dense_swiglu", &MakeDenseSwiGlu, /*caches_tokens=*/false},
    {"mla_attention", &MakeMlaAttention, /*caches_tokens=*/true},
    {"moe_swiglu", &MakeMoeSwiGlu, /*caches_tokens=*/false},
    {"gated_deltanet", &MakeGatedDeltaNet, /*caches_tokens=*/false},
};
}  // namespace

std::span<const LayerKind> LayerKinds() { return kKinds; }

StatusOr<const LayerKind*> FindLayerKind(std::string_view name) {
  for (const LayerKind& k : kKinds) {
    if (k.name == name) return &k;
  }
  return Internal("no layer kind '" + std::string(name) + "'");
}

// llama, qwen2, qwen3: grouped-query attention then a dense SwiGLU FFN per block; qwen3moe: attention then a
// mixture of experts; deepseek2: MLA then a dense SwiGLU FFN (its leading dense blocks; its expert blocks
// are refused by ModelConfig::Validate until they are wired up); qwen35: Gated DeltaNet or gated attention, then
// a dense SwiGLU FFN.
std::vector<std::string_view> ModelLayerKinds(const ModelConfig& c, int block) {
  const std::string_view ffn = c.is_moe_block(block) ? "moe_swiglu" : "dense_swiglu";
  if (c.is_linear_layer(block)) return {"gated_deltanet", ffn};
  return {c.is_mla() ? "mla_attention" : "gqa_attention", ffn};
}

}  // namespace qkv
