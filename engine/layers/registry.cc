// Every layer kind the engine knows, and which kinds a model's blocks are made of.
#include "engine/layers/layer.h"

namespace qkv {

StatusOr<std::unique_ptr<Layer>> MakeGqaAttention(const LayerInit& in);  // gqa_attention.cc
StatusOr<std::unique_ptr<Layer>> MakeDenseSwiGlu(const LayerInit& in);   // dense_swiglu.cc
StatusOr<std::unique_ptr<Layer>> MakeMlaAttention(const LayerInit& in);  // mla_attention.cc

// llama.cpp's LLAMA_ROPE_TYPE_NORM (interleaved) for llama and deepseek2, NEOX (halves) for qwen2/qwen3.
RopeStyle RopeStyleOf(Arch a) {
  return a == Arch::kLlama || a == Arch::kDeepseek2 ? RopeStyle::kInterleaved : RopeStyle::kHalves;
}

namespace {
constexpr LayerKind kKinds[] = {
    {"gqa_attention", &MakeGqaAttention, /*caches_tokens=*/true},
    {"dense_swiglu", &MakeDenseSwiGlu, /*caches_tokens=*/false},
    {"mla_attention", &MakeMlaAttention, /*caches_tokens=*/true},
};
}  // namespace

std::span<const LayerKind> LayerKinds() { return kKinds; }

StatusOr<const LayerKind*> FindLayerKind(std::string_view name) {
  for (const LayerKind& k : kKinds) {
    if (k.name == name) return &k;
  }
  return Internal("no layer kind '" + std::string(name) + "'");
}

// llama, qwen2, qwen3: grouped-query attention then a dense SwiGLU FFN per block; deepseek2: MLA then a
// dense SwiGLU FFN (its leading dense blocks; expert blocks are refused by ModelConfig::Validate).
std::vector<std::string_view> ModelLayerKinds(const ModelConfig& c, int block) {
  if (c.is_mla()) return {"mla_attention", "dense_swiglu"};
  return {"gqa_attention", "dense_swiglu"};
}

}  // namespace qkv
