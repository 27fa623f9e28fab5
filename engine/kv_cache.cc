#include "engine/kv_cache.h"

#include <sys/mman.h>

#include <cstring>

namespace qkv {

StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheShape& s) {
  if (s.n_blocks <= 0 || s.block_size <= 0 || s.n_layers <= 0 || s.n_kv_heads <= 0 || s.head_dim <= 0) {
    return InvalidArgument("kv cache: empty shape");
  }
  auto kv = std::unique_ptr<KvCache>(new KvCache());
  kv->shape_ = s;
  kv->head_stride_ = static_cast<size_t>(s.block_size) * s.head_dim * DTypeBytes(s.dtype);
  const size_t half = static_cast<size_t>(s.n_layers) * s.n_blocks * s.n_kv_heads * kv->head_stride_;
  kv->bytes_ = static_cast<int64_t>(2 * half);
  void* p = mmap(nullptr, 2 * half, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return ResourceExhausted("kv cache: cannot allocate " + std::to_string(2 * half) + " bytes");
  }
  // Touch every page now so that resident memory reflects the budget from the start.
  std::memset(p, 0, 2 * half);
  kv->k_ = static_cast<uint8_t*>(p);
  kv->v_ = kv->k_ + half;
  return kv;
}

KvCache::~KvCache() {
  if (k_) munmap(k_, static_cast<size_t>(bytes_));
}

BlockPool::BlockPool(int64_t n_blocks) : total_(n_blocks) {
  free_.reserve(n_blocks);
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int>(b));
}

int BlockPool::Allocate() {
  if (free_.empty()) return -1;
  const int b = free_.back();
  free_.pop_back();
  return b;
}

void BlockPool::Free(int block) { free_.push_back(block); }

Status ReserveBlocks(SeqKv& seq, int n_tokens, int block_size, BlockPool& pool) {
  const size_t need = static_cast<size_t>((n_tokens + block_size - 1) / block_size);
  if (need > seq.blocks.size() && static_cast<int64_t>(need - seq.blocks.size()) > pool.free_blocks()) {
    return ResourceExhausted("kv cache: not enough free blocks for " + std::to_string(n_tokens) + " tokens");
  }
  while (seq.blocks.size() < need) seq.blocks.push_back(pool.Allocate());
  return {};
}

void ReleaseBlocks(SeqKv& seq, BlockPool& pool) {
  for (int b : seq.blocks) pool.Free(b);
  seq.blocks.clear();
  seq.n_tokens = 0;
}

}  // namespace qkv
