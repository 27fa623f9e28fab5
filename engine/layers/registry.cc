// Every layer kind the engine knows, and which kinds a model's blocks are made of.
#include "engine/layers/layer.h"

namespace qkv {

StatusOr<std::unique_ptr<Layer>> MakeGqaAttention(const LayerInit& in);  // gqa_attention.cc
StatusOr<std::unique_ptr<Layer>> MakeDenseSwiGlu(const LayerInit& in);   // dense_swiglu.cc

RopeStyle RopeStyleOf(Arch a) { return a == Arch::kLlama ? RopeStyle::kInterleaved : RopeStyle::kHalves; }

namespace {
constexpr LayerKind kKinds[] = {
    {"gqa_attention", &MakeGqaAttention, /*caches_tokens=*/true},
    {"dense_swiglu", &MakeDenseSwiGlu, /*caches_tokens=*/false},
};
}  // namespace

std::span<const LayerKind> LayerKinds() { return kKinds; }

StatusOr<const LayerKind*> FindLayerKind(std::string_view name) {
  for (const LayerKind& k : kKinds) {
    if (k.name == name) return &k;
  }
  return Internal("no layer kind '" + std::string(name) + "'");
}

// Every architecture served today (llama, qwen2, qwen3) is attention then a dense SwiGLU FFN per block.
std::vector<std::string_view> ModelLayerKinds(const ModelConfig& c, int block) {
  return {"gqa_attention", "dense_swiglu"};
}

}  // namespace qkv
