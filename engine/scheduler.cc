#include "engine/scheduler.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace qkv {

Scheduler::Scheduler(std::unique_ptr<CacheStores> cache, const SchedulerOptions& opt)
    : cache_(std::move(cache)),
      pool_(cache_->layout().tokens.n_blocks, cache_->layout().tokens.block_size),
      opt_(opt) {}

void Scheduler::Release(SeqKv& kv) {
  ReleaseBlocks(kv, pool_);
  if (kv.state_slot >= 0) cache_->states().Release(kv.state_slot);
  kv.state_slot = -1;
}

bool Scheduler::CopyState(const SeqKv& from, SeqKv& to) {
  to.state_slot = -1;
  if (from.state_slot < 0) return true;
  StateStore& st = cache_->states();
  const int slot = st.Allocate();
  if (slot < 0) return false;
  std::memcpy(st.Slot(slot), st.Slot(from.state_slot), static_cast<size_t>(st.bytes_per_slot()));
  to.state_slot = slot;
  return true;
}

void Scheduler::Truncate(CachedTokens& ctx, int n) {
  KvBlockPool& pool = pool_;
  if (ctx.kv.state_slot >= 0 && n < ctx.kv.n_tokens) {
    Release(ctx.kv);
    ctx.hashes.clear();
  }
  const int B = pool.block_size();
  if (static_cast<int>(ctx.tokens.size()) > n) ctx.tokens.resize(n);
  ctx.kv.n_tokens = std::min(ctx.kv.n_tokens, n);
  const size_t keep = static_cast<size_t>((ctx.kv.n_tokens + B - 1) / B);
  while (ctx.kv.blocks.size() > keep) {
    pool.Unref(ctx.kv.blocks.back());
    ctx.kv.blocks.pop_back();
  }
  ctx.hashes.resize(std::min(ctx.hashes.size(), static_cast<size_t>(ctx.kv.n_tokens / B)));
}

int Scheduler::ReusePrefix(CachedTokens& ctx, uint32_t ns, int* cached_end) {
  if (cached_end) *cached_end = -1;
  if (!opt_.prefix_caching) return 0;
  // Cached blocks hold K/V, not the state after them: a model that keeps state reuses them only up to a
  // block whose state was snapshotted.
  const bool state = cache_->layout().state_bytes_per_seq > 0;
  if (state && (snapshots_.empty() || !cache_->states().in_use(ctx.kv.state_slot))) return 0;
  const int B = pool_.block_size();
  SeqKv& kv = ctx.kv;
  if (kv.n_tokens % B != 0 || kv.blocks.size() != static_cast<size_t>(kv.n_tokens / B) ||
      ctx.hashes.size() != kv.blocks.size()) {
    return 0;
  }
  // Leave at least one token to compute: its logits are needed to sample.
  const int max_full = (static_cast<int>(ctx.tokens.size()) - 1) / B;
  std::vector<std::pair<int, uint64_t>> found;  // (block, hash) of the cached blocks that continue ctx
  size_t take = 0;                              // how many of them to take
  Snapshot* snap = nullptr;
  for (int i = static_cast<int>(kv.blocks.size()); i < max_full; ++i) {
    const uint64_t parent = i ? (found.empty() ? ctx.hashes[i - 1] : found.back().second) : 0;
    const std::span<const int> toks(ctx.tokens.data() + static_cast<size_t>(i) * B, B);
    const uint64_t h = KvBlockPool::ChainHash(parent, ns, toks);
    const int b = pool_.Lookup(h, parent, ns, toks);
    if (b < 0) break;
    found.emplace_back(b, h);
    if (!state) {
      take = found.size();
    } else if (auto it = snapshots_.find(h); it != snapshots_.end()) {
      take = found.size();
      snap = &it->second;
    }
  }
  if (cached_end && found.size() > take) *cached_end = (kv.n_tokens / B + static_cast<int>(found.size())) * B;
  for (size_t j = 0; j < take; ++j) {
    pool_.Ref(found[j].first);
    kv.blocks.push_back(found[j].first);
    ctx.hashes.push_back(found[j].second);
  }
  if (snap) {  // the state after the last block taken
    StateStore& st = cache_->states();
    std::memcpy(st.Slot(kv.state_slot), cache_->snapshots().Slot(snap->slot), static_cast<size_t>(st.bytes_per_slot()));
    snap->last_use = ++snapshot_clock_;
  }
  const int reused = static_cast<int>(take) * B;
  kv.n_tokens += reused;
  return reused;
}

bool Scheduler::IsSnapshotBoundary(const Sequence& s, int pos) const {
  if (!opt_.prefix_caching || !s.use_prefix_cache || cache_->snapshots().n_slots() == 0 || pos <= 0) return false;
  const int B = pool_.block_size();
  return pos == (static_cast<int>(s.ctx.tokens.size()) - 1) / B * B || pos == s.snapshot_at;
}

int Scheduler::NextSnapshotBoundary(const Sequence& s) const {
  const int n = s.ctx.kv.n_tokens;
  const int B = pool_.block_size();
  const int last = (static_cast<int>(s.ctx.tokens.size()) - 1) / B * B;
  int next = -1;
  for (int b : {s.snapshot_at, last}) {
    if (b > n && IsSnapshotBoundary(s, b) && (next < 0 || b < next)) next = b;
  }
  return next;
}

void Scheduler::TakeSnapshot(const CachedTokens& ctx) {
  const int B = pool_.block_size();
  const int n = ctx.kv.n_tokens;
  if (n == 0 || n % B != 0 || ctx.hashes.size() != static_cast<size_t>(n / B)) return;
  if (!cache_->states().in_use(ctx.kv.state_slot)) return;
  const uint64_t h = ctx.hashes.back();
  auto it = snapshots_.find(h);
  if (it != snapshots_.end()) {
    it->second.last_use = ++snapshot_clock_;
    return;
  }
  StateStore& snaps = cache_->snapshots();
  if (snaps.free_slots() == 0) {  // evict the least recently used
    auto lru = snapshots_.end();
    for (auto e = snapshots_.begin(); e != snapshots_.end(); ++e) {
      if (lru == snapshots_.end() || e->second.last_use < lru->second.last_use) lru = e;
    }
    if (lru == snapshots_.end()) return;
    snaps.Release(lru->second.slot);
    snapshots_.erase(lru);
  }
  const int slot = snaps.Allocate();
  if (slot < 0) return;
  std::memcpy(snaps.Slot(slot), cache_->states().Slot(ctx.kv.state_slot), static_cast<size_t>(snaps.bytes_per_slot()));
  snapshots_[h] = {slot, ++snapshot_clock_};
}

std::string Scheduler::CheckSnapshots() const {
  const StateStore& snaps = cache_->snapshots();
  std::vector<int> owners(static_cast<size_t>(snaps.n_slots()), 0);
  for (const auto& [h, sn] : snapshots_) {
    if (!snaps.in_use(sn.slot)) return "a snapshot holds slot " + std::to_string(sn.slot) + ", which is free";
    if (++owners[static_cast<size_t>(sn.slot)] > 1)
      return "snapshot slot " + std::to_string(sn.slot) + " has two owners";
  }
  if (static_cast<int>(snapshots_.size()) != snaps.used_slots()) {
    return std::to_string(snaps.used_slots()) + " snapshot slots in use but " + std::to_string(snapshots_.size()) +
           " snapshots";
  }
  return "";
}

void Scheduler::RegisterFullBlocks(Sequence& seq) {
  if (!opt_.prefix_caching) return;
  const int B = pool_.block_size();
  CachedTokens& c = seq.ctx;
  const int full = c.kv.n_tokens / B;
  for (int i = static_cast<int>(c.hashes.size()); i < full; ++i) {
    const uint64_t parent = i ? c.hashes[i - 1] : 0;
    const std::span<const int> toks(c.tokens.data() + static_cast<size_t>(i) * B, B);
    const uint64_t h = KvBlockPool::ChainHash(parent, seq.ns_id, toks);
    pool_.Register(c.kv.blocks[i], h, parent, seq.ns_id, toks);
    c.hashes.push_back(h);
  }
  if (IsSnapshotBoundary(seq, c.kv.n_tokens)) TakeSnapshot(c);
}

bool Scheduler::EnsureStateSlot(Sequence& s, const Evictor& evict) {
  if (cache_->layout().state_bytes_per_seq == 0 || s.ctx.kv.state_slot >= 0) return true;
  while (cache_->states().free_slots() == 0) {
    if (!evict()) return false;
  }
  s.ctx.kv.state_slot = cache_->states().Allocate();
  return true;
}

void Scheduler::Preempt(Sequence& s) {
  Release(s.ctx.kv);
  s.ctx.hashes.clear();
  ++s.preemptions;
  ++preemptions_;
}

bool Scheduler::MakeRoom(int64_t blocks, Sequence& for_seq, std::vector<Sequence*>& running, StepPlan& plan,
                         const Evictor& evict) {
  while (pool_.available_blocks() < blocks) {
    if (evict()) continue;
    // Preempt by recompute: lowest priority first, then the newest.
    Sequence* victim = nullptr;
    for (Sequence* s : running) {
      if (s == &for_seq || s->ctx.kv.blocks.empty()) continue;
      const bool scheduled =
          std::any_of(plan.chunks.begin(), plan.chunks.end(), [&](const auto& c) { return c.seq == s; });
      if (scheduled) continue;
      if (!victim || s->params.priority < victim->params.priority ||
          (s->params.priority == victim->params.priority && s->id > victim->id)) {
        victim = s;
      }
    }
    if (!victim) return false;
    Preempt(*victim);
    plan.preempted.push_back(victim);
  }
  return true;
}

bool Scheduler::EnsureBlocks(Sequence& seq, int end, std::vector<Sequence*>& running, StepPlan& plan,
                             const Evictor& evict) {
  const int B = pool_.block_size();
  SeqKv& kv = seq.ctx.kv;
  const int64_t need = std::max<int64_t>(0, (end + B - 1) / B - static_cast<int64_t>(kv.blocks.size()));
  const int wi = kv.n_tokens / B;  // the block the first new token is written into
  const bool cow = kv.n_tokens % B != 0 && (pool_.ref_count(kv.blocks[wi]) > 1 || pool_.is_registered(kv.blocks[wi]));
  const int64_t total = need + (cow ? 1 : 0);
  if (total > pool_.available_blocks() && !MakeRoom(total, seq, running, plan, evict)) {
    const int64_t whole = (static_cast<int64_t>(seq.ctx.tokens.size()) + seq.max_tokens - seq.n_generated + B - 1) / B;
    if (whole > pool_.total_blocks()) plan.failed.push_back(&seq);
    return false;
  }
  if (cow) {  // never write into a shared or cached block
    const int nb = pool_.Allocate();
    cache_->tokens().CopyBlock(kv.blocks[wi], nb);
    pool_.Unref(kv.blocks[wi]);
    kv.blocks[wi] = nb;
  }
  for (int64_t i = 0; i < need; ++i) kv.blocks.push_back(pool_.Allocate());
  return true;
}

void Scheduler::Enqueue(Sequence* s) {
  waiting_.push_back(s);
  ++waiting_by_ns_[s->ns_id];
}

void Scheduler::Remove(Sequence* s) {
  auto r = std::find(running_.begin(), running_.end(), s);
  if (r != running_.end()) {
    running_.erase(r);
    --running_by_ns_[s->ns_id];
  }
  auto w = std::find(waiting_.begin(), waiting_.end(), s);
  if (w != waiting_.end()) {
    waiting_.erase(w);
    --waiting_by_ns_[s->ns_id];
  }
}

int Scheduler::n_waiting(uint32_t ns) const {
  auto it = waiting_by_ns_.find(ns);
  return it == waiting_by_ns_.end() ? 0 : it->second;
}

StepPlan Scheduler::PlanStep(const Evictor& evict) {
  std::deque<Sequence*>& waiting = waiting_;
  std::vector<Sequence*>& running = running_;
  StepPlan plan;
  // Admission: highest priority first, then arrival order, skipping tenants at their running cap.
  while (static_cast<int>(running.size()) < opt_.max_num_seqs && !waiting.empty()) {
    auto best = waiting.end();
    for (auto it = waiting.begin(); it != waiting.end(); ++it) {
      if (running_by_ns_[(*it)->ns_id] >= (*it)->tenant_max_running) continue;
      if (best == waiting.end() || (*it)->params.priority > (*best)->params.priority) best = it;
    }
    if (best == waiting.end()) break;
    if (!EnsureStateSlot(**best, evict)) break;
    Sequence* s = *best;
    waiting.erase(best);
    --waiting_by_ns_[s->ns_id];
    ++running_by_ns_[s->ns_id];
    if (s->use_prefix_cache && s->ctx.kv.n_tokens < static_cast<int>(s->ctx.tokens.size()) - 1) {
      const int before = s->ctx.kv.n_tokens;
      ReusePrefix(s->ctx, s->ns_id, &s->snapshot_at);
      if (s->preemptions == 0) s->n_cached = s->ctx.kv.n_tokens;
      if (s->preemptions == 0) CountPrefixQuery(s->n_prompt - before, s->ctx.kv.n_tokens - before);
    }
    running.push_back(s);
  }
  // Decodes first (one token each), then prompt chunks, each group by priority then arrival.
  std::vector<Sequence*> order(running.begin(), running.end());
  std::stable_sort(order.begin(), order.end(), [](const Sequence* a, const Sequence* b) {
    const bool da = a->pending() == 1 && a->n_generated > 0, db = b->pending() == 1 && b->n_generated > 0;
    if (da != db) return da;
    if (a->params.priority != b->params.priority) return a->params.priority > b->params.priority;
    return a->id < b->id;
  });
  int budget = opt_.max_num_batched_tokens;
  int logit_rows = opt_.max_logit_rows > 0 ? opt_.max_logit_rows : std::numeric_limits<int>::max();
  for (Sequence* s : order) {
    if (budget == 0 || logit_rows == 0) break;
    if (std::find(plan.preempted.begin(), plan.preempted.end(), s) != plan.preempted.end()) continue;
    int n = std::min(s->pending(), budget);
    if (n <= 0) continue;
    // Prompt logprobs: a row of logits per token, so the chunk stops where the step's rows run out.
    const bool all_logits = s->params.prompt_logprobs && s->ctx.kv.n_tokens < s->n_prompt;
    if (all_logits) n = std::min(n, logit_rows);
    // A model that keeps state: stop the chunk at the snapshot boundary, so that the state there is seen.
    if (const int b = NextSnapshotBoundary(*s); b > 0 && s->ctx.kv.n_tokens + n > b) {
      n = b - s->ctx.kv.n_tokens;
    }
    if (!EnsureBlocks(*s, s->ctx.kv.n_tokens + n, running, plan, evict)) continue;
    ScheduledChunk c;
    c.seq = s;
    c.n_tokens = n;
    c.sample = s->ctx.kv.n_tokens + n == static_cast<int>(s->ctx.tokens.size());
    c.all_logits = all_logits;
    plan.chunks.push_back(c);
    plan.n_tokens += n;
    budget -= n;
    logit_rows -= all_logits ? n : 1;
  }
  // Preempted sequences lost their KV; they go back to the front of the queue and recompute later.
  for (Sequence* s : plan.preempted) {
    running.erase(std::remove(running.begin(), running.end(), s), running.end());
    waiting.push_front(s);
    --running_by_ns_[s->ns_id];
    ++waiting_by_ns_[s->ns_id];
  }
  return plan;
}

}  // namespace qkv
