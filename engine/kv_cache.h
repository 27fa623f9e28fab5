// The KV arena: K and V of every layer, cut into blocks of block_size token slots.
//
// Layout of each of K and V: [layer][block][kv_head][slot][head_dim], so one kv head's keys inside a
// block are contiguous. A sequence addresses its tokens through a SeqKv (its block ids in position
// order): position p lives in block blocks[p / block_size], slot p % block_size.
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

struct KvCacheShape {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;
  int64_t n_blocks = 0;
  DType dtype = DType::kBF16;
  int64_t bytes_per_token() const { return int64_t{n_layers} * 2 * n_kv_heads * head_dim * DTypeBytes(dtype); }
  int64_t bytes_per_block() const { return bytes_per_token() * block_size; }
};

// One sequence's view of the cache: its blocks (position p is in blocks[p / block_size]) and how many
// positions hold K/V.
struct SeqKv {
  std::vector<int> blocks;
  int n_tokens = 0;
};

class KvCache {
 public:
  static StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheShape& shape);
  ~KvCache();
  const KvCacheShape& shape() const { return shape_; }
  int64_t arena_bytes() const { return bytes_; }

  // Start of the keys (values) of one kv head in one block: block_size rows of head_dim elements.
  uint8_t* K(int layer, int block, int head) { return k_ + Offset(layer, block, head); }
  uint8_t* V(int layer, int block, int head) { return v_ + Offset(layer, block, head); }
  const uint8_t* K(int layer, int block, int head) const { return k_ + Offset(layer, block, head); }
  const uint8_t* V(int layer, int block, int head) const { return v_ + Offset(layer, block, head); }
  // Copies all layers' K and V of block src into block dst (copy-on-write of a shared block).
  void CopyBlock(int src, int dst);

 private:
  KvCache() = default;
  size_t Offset(int layer, int block, int head) const {
    return ((static_cast<size_t>(layer) * shape_.n_blocks + block) * shape_.n_kv_heads + head) * head_stride_;
  }
  KvCacheShape shape_;
  size_t head_stride_ = 0;  // bytes of one head's slots in a block
  int64_t bytes_ = 0;       // K and V together
  uint8_t* k_ = nullptr;
  uint8_t* v_ = nullptr;
};

}  // namespace qkv
