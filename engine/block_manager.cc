#include "engine/block_manager.h"

#include <algorithm>

namespace qkv {

KvBlockPool::KvBlockPool(int64_t n_blocks, int block_size) : block_size_(block_size), meta_(n_blocks) {
  free_.reserve(n_blocks);
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int>(b));
  namespaces_[""] = 0;
}

int KvBlockPool::Allocate() {
  int b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    b = lru_.front();
    lru_.pop_front();
    meta_[b].in_lru = false;
    Unregister(b);
  } else {
    return -1;
  }
  meta_[b].ref = 1;
  return b;
}

void KvBlockPool::Ref(int block) {
  Meta& m = meta_[block];
  if (m.ref == 0 && m.in_lru) {
    lru_.erase(m.lru_it);
    m.in_lru = false;
  }
  ++m.ref;
}

void KvBlockPool::Unref(int block) {
  Meta& m = meta_[block];
  if (--m.ref > 0) return;
  if (m.hash != 0) {
    m.lru_it = lru_.insert(lru_.end(), block);
    m.in_lru = true;
  } else {
    free_.push_back(block);
  }
}

uint64_t KvBlockPool::ChainHash(uint64_t parent, uint32_t ns, std::span<const int> tokens) {
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(parent ^ (0x9e3779b97f4a7c15ull * (ns + 1)));
  for (int t : tokens) h = mix(h ^ static_cast<uint32_t>(t)) + 0x9e3779b97f4a7c15ull;
  return h == 0 ? 1 : h;  // 0 means "not registered"
}

int KvBlockPool::Lookup(uint64_t hash, uint64_t parent, uint32_t ns, std::span<const int> tokens) const {
  auto it = index_.find(hash);
  if (it == index_.end()) return -1;
  const Meta& m = meta_[it->second];
  if (m.parent != parent || m.ns != ns || !std::equal(m.tokens.begin(), m.tokens.end(), tokens.begin(), tokens.end())) {
    return -1;  // a hash collision: treat as a miss
  }
  return it->second;
}

bool KvBlockPool::Register(int block, uint64_t hash, uint64_t parent, uint32_t ns, std::span<const int> tokens) {
  Meta& m = meta_[block];
  if (m.hash != 0 || index_.count(hash)) return false;
  m.hash = hash;
  m.parent = parent;
  m.ns = ns;
  m.tokens.assign(tokens.begin(), tokens.end());
  index_[hash] = block;
  return true;
}

void KvBlockPool::Unregister(int block) {
  Meta& m = meta_[block];
  if (m.hash == 0) return;
  auto it = index_.find(m.hash);
  if (it != index_.end() && it->second == block) index_.erase(it);
  m.hash = 0;
  m.tokens.clear();
}

uint32_t KvBlockPool::Namespace(const std::string& name) {
  auto [it, inserted] = namespaces_.emplace(name, static_cast<uint32_t>(namespaces_.size()));
  return it->second;
}

std::string KvBlockPool::CheckInvariants() const {
  std::vector<int> seen(meta_.size(), 0);
  for (int b : free_) {
    if (meta_[b].ref != 0 || meta_[b].hash != 0)
      return "free block " + std::to_string(b) + " is referenced or registered";
    ++seen[b];
  }
  for (int b : lru_) {
    if (meta_[b].ref != 0 || meta_[b].hash == 0 || !meta_[b].in_lru)
      return "cached block " + std::to_string(b) + " is inconsistent";
    ++seen[b];
  }
  for (size_t b = 0; b < meta_.size(); ++b) {
    if (meta_[b].ref < 0) return "block " + std::to_string(b) + " has a negative ref count";
    if (meta_[b].ref > 0) ++seen[b];
    if (seen[b] != 1) return "block " + std::to_string(b) + " is in " + std::to_string(seen[b]) + " states";
  }
  for (const auto& [h, b] : index_) {
    if (meta_[b].hash != h) return "cache index points at block " + std::to_string(b) + " with another hash";
  }
  return "";
}

Status ReserveBlocks(SeqKv& seq, int n_tokens, int block_size, KvBlockPool& pool) {
  const size_t need = static_cast<size_t>((n_tokens + block_size - 1) / block_size);
  if (need > seq.blocks.size() && static_cast<int64_t>(need - seq.blocks.size()) > pool.available_blocks()) {
    return ResourceExhausted("kv cache: not enough free blocks for " + std::to_string(n_tokens) + " tokens");
  }
  while (seq.blocks.size() < need) seq.blocks.push_back(pool.Allocate());
  return {};
}

void ReleaseBlocks(SeqKv& seq, KvBlockPool& pool) {
  // Last block first: the free list is a stack, so the next sequence gets these blocks back in ascending
  // order (runs of consecutive blocks are one stream per kv head for decode attention, kv_cache.h), and a
  // cached prefix chain is evicted from its tail, which keeps its head usable longest.
  for (auto it = seq.blocks.rbegin(); it != seq.blocks.rend(); ++it) pool.Unref(*it);
  seq.blocks.clear();
  seq.n_tokens = 0;
}

}  // namespace qkv
