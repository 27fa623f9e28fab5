// The decoder stack as layer kinds. Each block of the model is a short list of layers (today: one
// attention kind, then one FFN kind); a layer owns its weights and kernels, reads the residual stream and
// adds its output to it, and declares what it caches (CacheSpec), so the cache stores and their accounting
// follow from the kinds a model uses.
//
// A new kind is one file under engine/layers/ defining its class and a factory, plus one line in
// registry.cc; ModelLayerKinds (registry.cc) says which kinds a model's blocks are made of.
#pragma once

#include <omp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/gguf.h"
#include "engine/kernels/linear.h"
#include "engine/kernels/ops.h"
#include "engine/kernels/team_barrier.h"
#include "engine/kv_cache.h"
#include "engine/model_config.h"

namespace qkv {

// One sequence's share of a batch: its new tokens, placed at positions seq->n_tokens onwards.
struct BatchChunk {
  SeqKv* seq = nullptr;
  std::span<const int> tokens;
  bool all_logits = false;  // logits for every new token (else only for the last)
};

// Seconds spent per part of a forward pass (only while profiling is on).
struct ForwardProfile {
  double embed = 0, norms = 0, qkv = 0, rope_store = 0, attention = 0, o = 0, ffn_up = 0, ffn_act = 0, ffn_down = 0,
         lm_head = 0;
  double total() const {
    return embed + norms + qkv + rope_store + attention + o + ffn_up + ffn_act + ffn_down + lm_head;
  }
};

// Adds the time since the last mark to a profile field, when profiling.
class PhaseTimer {
 public:
  explicit PhaseTimer(bool on) : on_(on) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  void Mark(double& field) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    field += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  bool on_;
  std::chrono::steady_clock::time_point last_;
};

// The tokens of one step: T rows, each from a chunk of the batch, at a position.
struct StepRows {
  int T = 0;
  std::span<const BatchChunk> batch;
  const int* chunk_of = nullptr;  // [T]
  const int* pos = nullptr;       // [T]
};

// Scratch sized at load from the batch limit (rows) and the model's widths; shared by every layer.
struct LayerScratch {
  float *h = nullptr, *qkv = nullptr, *attn = nullptr, *tmp = nullptr, *gu = nullptr, *act = nullptr;
  float* attn_per_thread = nullptr;  // n_threads × attn_stride floats
  size_t attn_stride = 0;
  uint16_t* bf16_in = nullptr;   // activations rounded to bf16 for layers whose GEMM takes bf16
  KvCache* kv = nullptr;         // the paged token store (layers that cache per token use their kv_layer)
  StateStore* states = nullptr;  // per-sequence state slots (layers that keep state use seq->state_slot)
  int n_threads = 1;
  // Team steps (Layer::ForwardTeam): n_threads blocks of team_stride floats, one per thread, for the rows a
  // thread computes for itself (its RMSNorm of the one token, routing).
  float* team_rows = nullptr;
  size_t team_stride = 0;
  float* TeamRows(int t) const { return team_rows + team_stride * static_cast<size_t>(t); }
  TeamBarrier* barrier = nullptr;
  // Waits for every thread of the team (a spinning barrier: libgomp's costs ~1.7 µs here).
  void Barrier() const { barrier->Wait(omp_get_num_threads()); }
  PhaseTimer* timer = nullptr;
  ForwardProfile* profile = nullptr;
  // lin.Forward on f32 rows x, through bf16_in when the layer takes bf16 input.
  void Gemm(const Linear& lin, const float* x, int rows, float* y) const;
  // A team step's first phase, on the calling thread: its RMSNorm (weights norm, one row) of x into its
  // team row, which it returns, then its share of lin over that row into y. No barrier.
  float* TeamNormShare(const float* x, const std::vector<float>& norm, float eps, const Linear& lin, float* y) const;
};

// What a layer keeps between steps. Paged per-token bytes live in the KV arena's blocks (a token's K/V,
// later an MLA latent); per-sequence state (later linear attention) in state slots.
struct CacheSpec {
  int64_t bytes_per_token = 0;      // in the paged token store (whole-layer figure, all heads)
  int64_t state_bytes_per_seq = 0;  // in the per-sequence state store
};

class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::string_view kind() const = 0;
  // x: the residual stream, rows.T rows of hidden values; the layer adds its output to it.
  virtual void Forward(float* x, const StepRows& rows, const LayerScratch& s) = 0;
  // A step of one token inside one parallel region for the whole forward pass (Model::Forward): called
  // by every thread of the team, it computes what Forward computes, with the same bits, and returns when
  // x holds the layer's output for every thread (it ends with a barrier). Only where team_ready().
  // Regions cost ~3.5 µs and barriers ~1.7 µs on a 2-vCPU VM; a decoded token of a 16-layer model ran 81
  // regions. Inside one, the work a thread can do alone (the norm of one row, the routing) needs no barrier.
  virtual bool team_ready() const { return false; }
  virtual void ForwardTeam(float* /*x*/, const StepRows& /*rows*/, const LayerScratch& /*s*/) {}
  // Floats of LayerScratch::team_rows a thread needs (stride per thread).
  virtual size_t team_floats() const { return 0; }
  virtual size_t weight_bytes() const = 0;            // resident
  virtual size_t weight_bytes_per_token() const = 0;  // GEMM weights a decoded token reads
  virtual CacheSpec cache() const { return {}; }
  // Attention scratch one compute thread needs for a query over n_ctx positions (LayerScratch's
  // attn_per_thread holds the largest any layer asks for).
  virtual size_t scratch_floats_per_thread(int n_ctx, int block_size) const { return 0; }
  // Bytes of scratch the layer holds itself (sized at load from LayerInit::max_rows).
  virtual size_t scratch_bytes() const { return 0; }
  // A mixture of experts: tokens routed to each expert since load (one count per token and chosen
  // expert), or nullptr. Read on the engine thread.
  virtual const std::vector<uint64_t>* expert_tokens() const { return nullptr; }
  // Calls f on each GEMM the layer owns (for reports).
  virtual void ForEachLinear(const std::function<void(const Linear&)>& f) const = 0;
};

// Scratch that the layers of one model share: they run one after another on the engine thread, so one copy
// per key (a layer kind and every size its buffers depend on) serves them all, counted once in the model's
// scratch bytes (T::bytes()); docs/engine.md "Scratch memory".
class SharedScratch {
 public:
  template <class T, class Make>
  std::shared_ptr<T> Get(const std::string& key, const Make& make) {
    Entry& e = entries_[key];
    if (!e.ptr) {
      std::shared_ptr<T> p = make();
      e.bytes = [q = p.get()] { return q->bytes(); };
      e.ptr = std::move(p);
    }
    return std::static_pointer_cast<T>(e.ptr);
  }
  size_t bytes() const {
    size_t n = 0;
    for (const auto& [key, e] : entries_) n += e.bytes();
    return n;
  }

 private:
  struct Entry {
    std::shared_ptr<void> ptr;
    std::function<size_t()> bytes;
  };
  std::map<std::string, Entry> entries_;
};

// What a factory gets: the file, the shape, the block index, the GEMM runtime and dtypes, the RoPE table,
// (for layers that cache per token) the layer of the paged token store it was given, and the model's
// shared scratch.
struct LayerInit {
  const GgufFile& file;
  const ModelConfig& config;
  int block = 0;
  GemmRuntime& gemm;
  DType weights_dtype = DType::kBF16;
  bool keep_quantized = true;  // quantized tensors stay in their block formats (WeightsMode auto)
  DType kv_dtype = DType::kBF16;
  int kv_layer = -1;
  int64_t state_offset = 0;  // (for layers that keep state) where its share of a state slot starts, in bytes
  const RopeTable* rope = nullptr;
  int max_rows = 0;  // rows of one forward pass (the batch limit rounded up to the GEMM tile)
  SharedScratch* shared = nullptr;
};

using LayerFactory = StatusOr<std::unique_ptr<Layer>> (*)(const LayerInit&);
struct LayerKind {
  std::string_view name;
  LayerFactory make;
  bool caches_tokens;  // takes a layer of the paged token store
};
// The registered kinds (registry.cc) and the kinds block `block` of a model is made of, in order.
std::span<const LayerKind> LayerKinds();
StatusOr<const LayerKind*> FindLayerKind(std::string_view name);
std::vector<std::string_view> ModelLayerKinds(const ModelConfig& c, int block);

// RoPE pairing per architecture, as llama.cpp defines it.
RopeStyle RopeStyleOf(Arch a);

// Rows [r0, r0 + n) of a 2-D weight tensor of `rows` rows (ggml ne = {k, rows}); with planes > 0, of a 3-D
// tensor ne = {k, rows / planes, planes} read as `rows` rows (e.g. one matrix per head).
struct WeightRows {
  std::string tensor;
  uint64_t rows;
  int r0, n;
  uint64_t planes = 0;
  std::vector<uint64_t> ne(uint64_t k) const {
    if (planes > 0) return {k, rows / planes, planes};
    return {k, rows};
  }
};
// A GEMM over the given rows stacked in order, with an optional bias. Kept in the tensors' ggml block
// formats (Linear::CreateQuantized) when keep_quantized and every tensor is quantized; otherwise expanded
// to f32 and created in `dtype`. Shapes are checked, and values must be finite.
StatusOr<std::unique_ptr<Linear>> MakeLinear(const GgufFile& f, GemmRuntime& gemm, DType dtype, bool keep_quantized,
                                             const std::vector<WeightRows>& rows, int k, const float* bias);
// A quantized 2-D tensor [rows, k] as QuantWeights in the arena, or nullptr when it is not quantized.
StatusOr<std::shared_ptr<const QuantWeights>> ReadQuantized(const GgufFile& f, const std::string& name, uint64_t rows,
                                                            uint64_t k, std::shared_ptr<WeightsArena> arena);

// Reads a tensor as f32 after checking that its shape (ggml order) is exactly `ne` and its values finite.
StatusOr<std::vector<float>> ReadTensor(const GgufFile& f, const std::string& name, std::vector<uint64_t> ne);

}  // namespace qkv
