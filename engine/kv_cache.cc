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

void KvCache::CopyBlock(int src, int dst) {
  const size_t n = static_cast<size_t>(shape_.n_kv_heads) * head_stride_;
  for (int l = 0; l < shape_.n_layers; ++l) {
    std::memcpy(K(l, dst, 0), K(l, src, 0), n);
    std::memcpy(V(l, dst, 0), V(l, src, 0), n);
  }
}

}  // namespace qkv
