// Ownership of the KV arena's blocks: reference counts, a content-addressed prefix cache, and LRU
// eviction of unreferenced cached blocks.
//
// A block is in exactly one state:
//   used   - referenced by at least one sequence or session (ref_count > 0);
//   cached - unreferenced but holding the K/V of a known token prefix (reusable, evictable, LRU order);
//   free   - empty.
// Full blocks are content-addressed by a hash chain: hash(parent hash, namespace, the block's tokens).
// The tokens and parent are stored with the block and compared on lookup, so a 64-bit hash collision
// can never hand out wrong K/V. A block that is referenced more than once, or that is registered in
// the cache, is never written in place: writers copy it first (Scheduler::EnsureBlocks).
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/status.h"

namespace qkv {

class KvBlockPool {
 public:
  KvBlockPool(int64_t n_blocks, int block_size);

  int block_size() const { return block_size_; }
  int64_t total_blocks() const { return static_cast<int64_t>(meta_.size()); }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  int64_t cached_blocks() const { return static_cast<int64_t>(lru_.size()); }
  int64_t used_blocks() const { return total_blocks() - free_blocks() - cached_blocks(); }
  // Blocks an allocation could obtain right now (free + evictable cached).
  int64_t available_blocks() const { return free_blocks() + cached_blocks(); }

  // A block with ref_count 1: a free one, else the least recently used cached one (evicted from the
  // cache). -1 if every block is in use.
  int Allocate();
  void Ref(int block);
  // Drops one reference; at zero the block becomes cached (if registered) or free.
  void Unref(int block);
  int ref_count(int block) const { return meta_[block].ref; }
  bool is_registered(int block) const { return meta_[block].hash != 0; }

  // The hash of a full block given its parent's hash (0 for the first block), the namespace and tokens.
  static uint64_t ChainHash(uint64_t parent, uint32_t ns, std::span<const int> tokens);
  // The cached or used block holding exactly this prefix block, or -1. Does not take a reference.
  int Lookup(uint64_t hash, uint64_t parent, uint32_t ns, std::span<const int> tokens) const;
  // Records that a (full, fully computed) block holds this content. If another block already holds it,
  // nothing changes and false is returned.
  bool Register(int block, uint64_t hash, uint64_t parent, uint32_t ns, std::span<const int> tokens);

  // Interns a namespace name (e.g. an API key) as a small id; "" is 0.
  uint32_t Namespace(const std::string& name);

  // Consistency check for tests: states partition the blocks and the cache index matches. "" when fine.
  std::string CheckInvariants() const;

 private:
  struct Meta {
    int ref = 0;
    uint64_t hash = 0;  // 0: not registered
    uint64_t parent = 0;
    uint32_t ns = 0;
    std::vector<int> tokens;
    bool in_lru = false;
    std::list<int>::iterator lru_it;
  };
  void Unregister(int block);

  int block_size_;
  std::vector<Meta> meta_;
  std::vector<int> free_;
  std::list<int> lru_;  // cached blocks, least recently used first
  std::unordered_map<uint64_t, int> index_;
  std::unordered_map<std::string, uint32_t> namespaces_;
};

// Ensures seq has blocks for `n_tokens` positions (fresh ones, ref 1); ResourceExhausted if short, in
// which case nothing is taken.
Status ReserveBlocks(SeqKv& seq, int n_tokens, int block_size, KvBlockPool& pool);
// Drops seq's references to all its blocks and empties it.
void ReleaseBlocks(SeqKv& seq, KvBlockPool& pool);

}  // namespace qkv
