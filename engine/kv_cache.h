// The cache stores: what the layer kinds keep between steps (layers/layer.h CacheSpec), in two kinds of
// store. The scheduler owns them (CacheStores) and the model reads and writes them during Forward.
//   KvCache     the paged token store: per token, per caching layer (today K and V; later an MLA latent)
//   StateStore  per-sequence state slots of a fixed size (later linear attention's conv window and state)
//
// The KV arena: K and V of every layer, cut into blocks of block_size token slots.
//
// Layout of each of K and V: [layer][kv_head][block][one head's region], so one kv head's keys inside a
// block are contiguous, and so are a kv head's regions of consecutive blocks: decode attention reads one
// kv head of one layer at a time, and a sequence whose blocks are consecutive (the pool hands them out in
// ascending order) is then one stream the hardware prefetcher follows (with [layer][block][kv_head] it
// was 2 KiB pieces 8 KiB apart; docs/performance.md, "KV layout").
// The two planes may have different widths (v_dim): MLA keeps its normalized latent in the K plane (kv_lora_rank) and
// its shared rope key in the V plane (qk_rope_dim), one "head". The attention kernel (kernels/attention.h) decides the
// order inside a region (keys transposed, values row-major). An int8 region holds the block_size × head_dim int8
// values, then block_size bf16 scales: one per token (per layer, kv head, and K or V), symmetric, value = q × scale. A
// sequence addresses its tokens through a SeqKv (its block ids in position order): position p lives in block blocks[p /
// block_size], slot p % block_size.
//
// This is the paged token store of the layer kinds that cache per token (layers/layer.h): each such layer
// was handed one arena layer at load. The arena is allocated and touched once at start-up. This class only
// stores; ownership of blocks (reference counts, prefix sharing, eviction) belongs to KvBlockPool
// (block_manager.h), which the scheduler owns.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/dtype.h"
#include "engine/status.h"

namespace qkv {

// Bytes one cached vector of n elements takes (one token's K, or V, of one kv head): the elements, plus a
// bf16 scale for int8.
inline int64_t KvVectorBytes(DType dt, int n) { return int64_t{n} * DTypeBytes(dt) + (dt == DType::kI8 ? 2 : 0); }

struct KvCacheShape {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // width of a K-plane vector
  int block_size = 16;
  int64_t n_blocks = 0;
  DType dtype = DType::kBF16;
  int v_dim = 0;  // width of a V-plane vector; 0: head_dim
  int value_dim() const { return v_dim > 0 ? v_dim : head_dim; }
  int64_t bytes_per_token() const {
    return int64_t{n_layers} * n_kv_heads * (KvVectorBytes(dtype, head_dim) + KvVectorBytes(dtype, value_dim()));
  }
  int64_t bytes_per_block() const { return bytes_per_token() * block_size; }
};

// One sequence's view of the cache: its blocks (position p is in blocks[p / block_size]), how many
// positions hold K/V, and its state slot (-1: none; only models whose layers keep state use one).
struct SeqKv {
  std::vector<int> blocks;
  int n_tokens = 0;
  int state_slot = -1;
};

class KvCache {
 public:
  static StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheShape& shape);
  ~KvCache();
  const KvCacheShape& shape() const { return shape_; }
  int64_t arena_bytes() const { return bytes_; }

  // Start of the keys (values) of one kv head in one block: block_size vectors of head_dim (value_dim)
  // elements (for int8, followed by their block_size scales).
  uint8_t* K(int layer, int block, int head) { return k_ + Offset(layer, block, head, k_stride_); }
  uint8_t* V(int layer, int block, int head) { return v_ + Offset(layer, block, head, v_stride_); }
  const uint8_t* K(int layer, int block, int head) const { return k_ + Offset(layer, block, head, k_stride_); }
  const uint8_t* V(int layer, int block, int head) const { return v_ + Offset(layer, block, head, v_stride_); }
  // Copies all layers' K and V of block src into block dst (copy-on-write of a shared block).
  void CopyBlock(int src, int dst);

 private:
  KvCache() = default;
  size_t Offset(int layer, int block, int head, size_t stride) const {
    return ((static_cast<size_t>(layer) * shape_.n_kv_heads + head) * shape_.n_blocks + block) * stride;
  }
  KvCacheShape shape_;
  size_t k_stride_ = 0, v_stride_ = 0;  // bytes of one head's slots in a block, per plane
  int64_t bytes_ = 0;                   // K and V together
  uint8_t* k_ = nullptr;
  uint8_t* v_ = nullptr;
};

// Fixed-size per-sequence state slots. A slot is handed out zeroed (a new sequence's state is zero) and
// belongs to one sequence or session until released.
class StateStore {
 public:
  StateStore(int n_slots, int64_t bytes_per_slot);
  int n_slots() const { return n_slots_; }
  int64_t bytes_per_slot() const { return bytes_per_slot_; }
  int64_t bytes() const { return static_cast<int64_t>(data_.size()); }
  int free_slots() const { return static_cast<int>(free_.size()); }
  int used_slots() const { return n_slots_ - free_slots(); }
  // A zeroed slot, or -1 when all are in use.
  int Allocate();
  void Release(int slot);
  bool in_use(int slot) const { return slot >= 0 && slot < n_slots_ && used_[slot]; }
  uint8_t* Slot(int slot) { return data_.data() + static_cast<size_t>(slot) * bytes_per_slot_; }
  const uint8_t* Slot(int slot) const { return data_.data() + static_cast<size_t>(slot) * bytes_per_slot_; }

 private:
  int n_slots_;
  int64_t bytes_per_slot_;
  std::vector<uint8_t> data_;
  std::vector<int> free_;  // a stack: the lowest slot on top
  std::vector<bool> used_;
};

// For tools and tests that drive Model::Forward without a scheduler: gives seq a zeroed slot when the store has
// slots and seq holds none (ResourceExhausted when all are in use); the release gives it back.
Status ReserveStateSlot(SeqKv& seq, StateStore& st);
void ReleaseStateSlot(SeqKv& seq, StateStore& st);

// What a model's layers cache, sized: the paged token store's shape (n_blocks included) and the state
// slots. Model::cache_layout() computes it from the model options; CacheStores::Create allocates it.
struct CacheLayout {
  KvCacheShape tokens;
  int64_t state_bytes_per_seq = 0;  // 0: no layer keeps per-sequence state
  int state_slots = 0;
  // Slots holding copies of a state at a block boundary (prefix caching for models that keep state).
  int snapshot_slots = 0;
  int64_t bytes() const { return token_bytes() + state_bytes(); }
  int64_t token_bytes() const { return tokens.bytes_per_block() * tokens.n_blocks; }  // the KV arena
  int64_t state_bytes() const { return state_bytes_per_seq * (state_slots + snapshot_slots); }
};

// Every store of one model's cache. Owned by the scheduler (which hands out blocks and slots); the
// model's Forward writes and reads them.
class CacheStores {
 public:
  static StatusOr<std::unique_ptr<CacheStores>> Create(const CacheLayout& layout);
  const CacheLayout& layout() const { return layout_; }
  KvCache& tokens() { return *tokens_; }
  const KvCache& tokens() const { return *tokens_; }
  StateStore& states() { return *states_; }
  const StateStore& states() const { return *states_; }
  StateStore& snapshots() { return *snapshots_; }
  const StateStore& snapshots() const { return *snapshots_; }
  // Bytes of all stores (the KV arena, the state slots and the snapshots).
  int64_t bytes() const { return tokens_->arena_bytes() + states_->bytes() + snapshots_->bytes(); }

 private:
  CacheStores() = default;
  CacheLayout layout_;
  std::unique_ptr<KvCache> tokens_;
  std::unique_ptr<StateStore> states_;
  std::unique_ptr<StateStore> snapshots_;
};

}  // namespace qkv
