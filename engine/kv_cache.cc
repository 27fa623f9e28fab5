#include "engine/kv_cache.h"

#include <sys/mman.h>

#include <cstring>

namespace qkv {

StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheShape& s) {
  if (s.n_blocks <= 0 || s.block_size <= 0 || s.n_layers <= 0 || s.n_kv_heads <= 0 || s.head_dim <= 0 || s.v_dim < 0) {
    return InvalidArgument("kv cache: empty shape");
  }
  auto kv = std::unique_ptr<KvCache>(new KvCache());
  kv->shape_ = s;
  kv->k_stride_ = static_cast<size_t>(s.block_size) * static_cast<size_t>(KvVectorBytes(s.dtype, s.head_dim));
  kv->v_stride_ = static_cast<size_t>(s.block_size) * static_cast<size_t>(KvVectorBytes(s.dtype, s.value_dim()));
  const size_t per_stride = static_cast<size_t>(s.n_layers) * s.n_blocks * s.n_kv_heads;
  const size_t k_bytes = per_stride * kv->k_stride_, total = k_bytes + per_stride * kv->v_stride_;
  kv->bytes_ = static_cast<int64_t>(total);
  // MAP_POPULATE faults every page in now (zeroed, writable), so that resident memory reflects the budget
  // from the start; on a VM it is ~4x faster than touching the pages with memset (2 GiB: 4 s against 17 s
  // on a 2-core EPYC guest, 2026-12-01).
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    return ResourceExhausted("kv cache: cannot allocate " + std::to_string(total) + " bytes");
  }
  kv->k_ = static_cast<uint8_t*>(p);
  kv->v_ = kv->k_ + k_bytes;
  return kv;
}

KvCache::~KvCache() {
  if (k_) munmap(k_, static_cast<size_t>(bytes_));
}

void KvCache::CopyBlock(int src, int dst) {
  for (int l = 0; l < shape_.n_layers; ++l) {
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      std::memcpy(K(l, dst, h), K(l, src, h), k_stride_);
      std::memcpy(V(l, dst, h), V(l, src, h), v_stride_);
    }
  }
}

StateStore::StateStore(int n_slots, int64_t bytes_per_slot)
    : n_slots_(n_slots), bytes_per_slot_(bytes_per_slot), used_(static_cast<size_t>(n_slots), false) {
  data_.assign(static_cast<size_t>(n_slots) * static_cast<size_t>(bytes_per_slot), 0);
  for (int i = n_slots - 1; i >= 0; --i) free_.push_back(i);
}

int StateStore::Allocate() {
  if (free_.empty()) return -1;
  const int s = free_.back();
  free_.pop_back();
  used_[s] = true;
  std::memset(Slot(s), 0, static_cast<size_t>(bytes_per_slot_));
  return s;
}

void StateStore::Release(int slot) {
  if (!in_use(slot)) return;
  used_[slot] = false;
  free_.push_back(slot);
}

Status ReserveStateSlot(SeqKv& seq, StateStore& st) {
  if (st.n_slots() == 0 || st.in_use(seq.state_slot)) return {};
  seq.state_slot = st.Allocate();
  if (seq.state_slot < 0) return ResourceExhausted("no free state slot");
  return {};
}

void ReleaseStateSlot(SeqKv& seq, StateStore& st) {
  if (seq.state_slot >= 0) st.Release(seq.state_slot);
  seq.state_slot = -1;
}

StatusOr<std::unique_ptr<CacheStores>> CacheStores::Create(const CacheLayout& layout) {
  if (layout.state_bytes_per_seq < 0 || layout.state_slots < 0 || layout.snapshot_slots < 0 ||
      (layout.state_bytes_per_seq > 0 && layout.state_slots == 0)) {
    return InvalidArgument("cache: state slots must be positive when layers keep state");
  }
  auto c = std::unique_ptr<CacheStores>(new CacheStores());
  c->layout_ = layout;
  QKV_ASSIGN_OR_RETURN(c->tokens_, KvCache::Create(layout.tokens));
  const bool state = layout.state_bytes_per_seq > 0;
  c->states_ = std::make_unique<StateStore>(state ? layout.state_slots : 0, layout.state_bytes_per_seq);
  c->snapshots_ = std::make_unique<StateStore>(state ? layout.snapshot_slots : 0, layout.state_bytes_per_seq);
  return c;
}

}  // namespace qkv
