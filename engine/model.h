// A loaded decoder-only transformer and its forward pass over a batch of sequence chunks.
//
// Per layer, top to bottom like the math:
//   h = RMSNorm(x) → [q | gate | k | v] = h · W_QKVᵀ (+ b) → q/k RMSNorm (optional) → RoPE(q, k)
//   → store k, v → causal attention over the cache (sinks optional) → × sigmoid(gate) (optional)
//   → x += attn · W_Oᵀ → h = RMSNorm(x) → [g | u] = h · W_GUᵀ → x += (silu(g) · u) · W_downᵀ
// then the final RMSNorm and the LM head on the rows whose logits are wanted.
//
// All scratch memory is sized at load from the batch limit and the context length; Forward allocates
// nothing.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/kernels/linear.h"
#include "engine/kernels/ops.h"
#include "engine/kv_cache.h"
#include "engine/layers/layer.h"
#include "engine/model_config.h"
#include "engine/tokenizer.h"

namespace qkv {

struct ModelOptions {
  std::string tokenizer_path;          // a tokenizer.json to use instead of the GGUF's tokenizer
  DType weights_dtype = DType::kBF16;  // of the tensors that are expanded (all of them unless keep_quantized)
  bool keep_quantized = true;          // quantized tensors stay in their block formats (--weights-dtype auto)
  DType kv_dtype = DType::kBF16;
  int n_threads = 2;
  int max_batch_tokens = 512;  // tokens in one forward pass
  // Rows of logits one forward pass may want (a chunk's last token, or every token of an all_logits chunk);
  // 0: max_batch_tokens. The logits buffer is this many rows × vocab (65.5 MB at 512 rows of 32,000).
  int max_logit_rows = 0;
  int max_context = 0;  // 0: the model's context length
  int block_size = 16;
  // KV arena size, in order of precedence: kv_blocks if > 0; else kv_cache_bytes if > 0; else, if
  // kv_cache_bytes == kAutoKvBytes, a quarter of MemAvailable (after the weights) capped at 8 GiB and at
  // 256 full contexts; else
  // (0) enough for one sequence of max_context. Never less than one full context.
  int64_t kv_blocks = 0;
  int64_t kv_cache_bytes = 0;
  static constexpr int64_t kAutoKvBytes = -1;
  // Per-sequence state slots, for models whose layers keep state (Gated DeltaNet); 0: from the budget (up to
  // half of kv_cache_bytes, 1..64 slots; without a byte budget 64 or as many as 2 GiB hold). A quarter as many
  // snapshot slots (prefix caching) come on top, inside the budget. Model::Load.
  int state_slots = 0;
};

class Model {
 public:
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& path, const ModelOptions& opt);
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opt_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  // The cache this model needs, sized from the options (the KV arena's blocks, the state slots). The
  // model does not hold it: the scheduler owns the stores (CacheStores::Create(cache_layout())) and
  // Forward is handed them.
  const CacheLayout& cache_layout() const { return layout_; }
  int max_context() const { return max_ctx_; }
  // Rows of logits one Forward may want (ModelOptions::max_logit_rows, resolved).
  int max_logit_rows() const { return logit_rows_cap_; }
  // Bytes of converted weights (linear layers, embeddings, norms) as held in memory.
  size_t weight_bytes() const { return weight_bytes_; }
  // What the weights hold in memory: weight_bytes() plus the slack of the arena the quantized ones live in
  // (kernels/weights_arena.h), and of those bytes the ones outside it (in the C allocator's heap).
  size_t weight_memory_bytes() const;
  size_t weight_heap_bytes() const;
  // How the weights are held, e.g. "bf16", "f32", "q4_k+q6_k (quantized) + bf16".
  std::string weights_summary() const;
  // Bytes the LM head, QKV/O/FFN GEMMs read per decoded token (the bandwidth roofline's numerator).
  size_t weight_bytes_per_token() const { return weight_bytes_per_token_; }
  const GemmRuntime& gemm() const { return *rt_; }
  // The dtype the GEMMs take activations in: the weights' dtype on oneDNN, f32 on the packed GEMM (bf16
  // weights widened). bf16 if any layer takes bf16.
  DType compute_dtype() const;
  // Bytes of scratch sized at load: activation buffers, logits, attention and oneDNN scratchpads.
  size_t scratch_bytes() const;

  // Runs the batch over the cache stores `cache` (created from cache_layout()). Each chunk's tokens are
  // appended to its sequence (blocks must be reserved first, see ReserveBlocks). Logits rows come out in
  // chunk order: all of a chunk's tokens if all_logits, else its last; they stay valid until the next
  // Forward.
  Status Forward(std::span<const BatchChunk> batch, CacheStores& cache);
  // The checks Forward makes of one chunk (context, reserved blocks, token ids), so that a caller can
  // drop a chunk the model would refuse instead of failing the whole batch.
  Status CheckChunk(const BatchChunk& ch) const;
  const float* logits() const { return logits_.data(); }

  // Seconds spent per part of Forward since the last reset (only while profiling is on).
  using Profile = ForwardProfile;
  // The decoder stack: per block, its layers in order (see layers/layer.h).
  const std::vector<std::unique_ptr<Layer>>& layers() const { return layers_; }
  // What the layers cache, summed: paged bytes per token (the KV arena's figure) and per-sequence state.
  CacheSpec cache_spec() const;
  // Per mixture-of-experts block: its index and the tokens routed to each of its experts since load.
  std::vector<std::pair<int, std::vector<uint64_t>>> ExpertTokens() const;
  // Whether a step of one token runs in one parallel region (Layer::ForwardTeam; QKV_TEAM_STEP=0: never).
  bool team_step() const { return team_step_; }
  void set_profiling(bool on) {
    profiling_ = on;
    profile_ = {};
  }
  const Profile& profile() const { return profile_; }
  int logits_rows() const { return logits_rows_; }

 private:
  Model() = default;
  Status LoadWeights(const GgufFile& f);

  ModelConfig cfg_;
  ModelOptions opt_;
  int max_ctx_ = 0;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<GemmRuntime> rt_;
  CacheLayout layout_;
  std::unique_ptr<RopeTable> rope_;
  std::vector<std::unique_ptr<Layer>> layers_;
  int kv_layers_ = 0;                            // layers of the paged token store handed out to layer kinds
  std::vector<float> embed_f32_;                 // [vocab][hidden] when weights are f32
  std::vector<uint16_t> embed_bf16_;             // [vocab][hidden] when weights are bf16
  std::shared_ptr<const QuantWeights> embed_q_;  // when kept quantized (shared with lm_head_ when tied)
  std::vector<float> final_norm_;
  std::unique_ptr<Linear> lm_head_;
  size_t weight_bytes_ = 0;
  size_t weight_bytes_per_token_ = 0;

  // Scratch, sized at load.
  int rows_cap_ = 0;
  int logit_rows_cap_ = 0;
  std::vector<float> x_, h_, qkv_, attn_, tmp_, gu_, act_, logits_;
  std::vector<uint16_t> in_lp_;
  std::vector<float> attn_scratch_;  // per thread
  size_t attn_scratch_stride_ = 0;
  bool team_step_ = false;        // one-token steps run Layer::ForwardTeam in one parallel region
  std::vector<float> team_rows_;  // per thread, team_stride_ floats (LayerScratch::team_rows)
  SharedScratch shared_scratch_;  // what layers share (LayerInit::shared)
  size_t team_stride_ = 0;
  std::vector<int> tok_chunk_, tok_pos_, logit_src_;
  int logits_rows_ = 0;
  bool profiling_ = false;
  Profile profile_;
};

}  // namespace qkv
