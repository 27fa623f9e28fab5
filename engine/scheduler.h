// Decides what the next engine step computes: which sequences run and how many of their tokens, within
// a token budget (max_num_batched_tokens) and a sequence limit (max_num_seqs). Decodes go first so a long
// prompt cannot stall them; prompts are prefilled in chunks with what budget remains.
//
// It also makes room in the KV cache when a step needs blocks: unreferenced prefix blocks are evicted by
// the pool itself (LRU); then idle sessions' KV is dropped (through the Evictor); then running sequences
// are preempted by recompute (lowest priority, newest first). The plan is a small explicit object that
// the engine hands to the model.
//
// It owns the cache stores (kv_cache.h) and hands out their pieces: token blocks through the block pool,
// and, for models whose layers keep per-sequence state, one state slot per admitted sequence (a sequence
// waits while none is free and idle sessions' state can't be evicted).
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/sequence.h"

namespace qkv {

struct SchedulerOptions {
  int max_num_batched_tokens = 512;
  int max_num_seqs = 64;
  bool prefix_caching = true;
  // Rows of logits a step may want (Model::max_logit_rows): a chunk takes one, a prompt-logprobs chunk one
  // per token and is cut to what is left. 0: no limit.
  int max_logit_rows = 0;
};

struct ScheduledChunk {
  Sequence* seq = nullptr;
  int n_tokens = 0;         // positions seq->ctx.kv.n_tokens .. + n_tokens
  bool sample = false;      // the chunk reaches the end of the context: sample after it
  bool all_logits = false;  // logits for every token (prompt logprobs)
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;
  std::vector<Sequence*> preempted;  // lost their KV this step; they recompute later
  std::vector<Sequence*> failed;     // cannot fit even in an empty cache
  int n_tokens = 0;
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  // Drops one idle session's KV to free blocks; false when no idle session holds any.
  using Evictor = std::function<bool()>;

  // The scheduler owns the cache stores and the block pool over their token blocks (who holds which
  // block, the prefix cache).
  Scheduler(std::unique_ptr<CacheStores> cache, const SchedulerOptions& opt);
  const SchedulerOptions& options() const { return opt_; }
  KvBlockPool& pool() { return pool_; }
  const KvBlockPool& pool() const { return pool_; }
  CacheStores& cache() { return *cache_; }
  const CacheStores& cache() const { return *cache_; }

  // Gives back everything kv holds (blocks, state slot) and empties it.
  void Release(SeqKv& kv);
  // A fork's copy of a context's state: `to` (which shares `from`'s blocks) gets a slot of its own holding
  // the same state. False when no slot is free. Without state, nothing to do.
  bool CopyState(const SeqKv& from, SeqKv& to);
  // Truncates cached tokens to n (tokens, KV and known hashes), dropping block references past the end.
  // State summarizes every token, so a context that keeps state and is cut below what it computed starts
  // over (its KV and state are released; it recomputes).
  void Truncate(CachedTokens& ctx, int n);

  // The queues: a submitted sequence waits until admitted, then runs until the engine removes it.
  void Enqueue(Sequence* s);
  void Remove(Sequence* s);  // from whichever queue holds it
  size_t n_waiting() const { return waiting_.size(); }
  int n_waiting(uint32_t ns) const;
  size_t n_running() const { return running_.size(); }
  bool idle() const { return waiting_.empty() && running_.empty(); }

  // Moves admissible waiting sequences to running (priority order, then arrival), reusing cached prefix
  // blocks, then plans one step. Sequences preempted to make room are back in the waiting queue (front).
  StepPlan PlanStep(const Evictor& evict);

  // After a step: registers blocks that became full in the prefix cache; for a model that keeps state,
  // snapshots the state when the sequence stands at one of its snapshot boundaries (IsSnapshotBoundary).
  void RegisterFullBlocks(Sequence& seq);
  // Takes cached prefix blocks for ctx (from position kv.n_tokens on); returns how many tokens it reused. For
  // a model that keeps state, only up to the deepest block whose state snapshot exists, which it copies into
  // ctx's state slot (the slot must be held); cached_end (if given) is then where the cached blocks found end
  // when that is further (else -1).
  int ReusePrefix(CachedTokens& ctx, uint32_t ns, int* cached_end = nullptr);
  // Where a sequence's state is snapshotted for prefix caching (models that keep state): the last block
  // boundary of its context that leaves a token to compute, and its snapshot_at. Prefill chunks stop at the
  // next one (NextSnapshotBoundary, -1: none), so that a step ends at it.
  bool IsSnapshotBoundary(const Sequence& s, int pos) const;
  int NextSnapshotBoundary(const Sequence& s) const;
  int n_snapshots() const { return static_cast<int>(snapshots_.size()); }
  // "" when every snapshot slot in use belongs to exactly one entry, else the first error.
  std::string CheckSnapshots() const;

  uint64_t prefix_queries_tokens() const { return prefix_queries_; }
  uint64_t prefix_hits_tokens() const { return prefix_hits_; }
  uint64_t preemptions() const { return preemptions_; }
  void CountPrefixQuery(int queried, int hit) {
    prefix_queries_ += queried;
    prefix_hits_ += hit;
  }

 private:
  // Makes seq's blocks cover positions up to end and its write block private (copy-on-write).
  bool EnsureBlocks(Sequence& seq, int end, std::vector<Sequence*>& running, StepPlan& plan, const Evictor& evict);
  bool MakeRoom(int64_t blocks, Sequence& for_seq, std::vector<Sequence*>& running, StepPlan& plan,
                const Evictor& evict);
  void Preempt(Sequence& s);
  // Gives s a state slot if the model keeps state and it has none; false when none can be freed.
  bool EnsureStateSlot(Sequence& s, const Evictor& evict);

  void TakeSnapshot(const CachedTokens& ctx);

  std::unique_ptr<CacheStores> cache_;
  KvBlockPool pool_;
  // State snapshots at block boundaries, by the chain hash of the block that ends there (which covers the
  // namespace and every token before), least recently used evicted first.
  struct Snapshot {
    int slot = -1;
    uint64_t last_use = 0;
  };
  std::unordered_map<uint64_t, Snapshot> snapshots_;
  uint64_t snapshot_clock_ = 0;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;
  std::unordered_map<uint32_t, int> waiting_by_ns_, running_by_ns_;  // per tenant
  SchedulerOptions opt_;
  uint64_t prefix_queries_ = 0, prefix_hits_ = 0, preemptions_ = 0;
};

}  // namespace qkv
