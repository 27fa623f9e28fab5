// The state of one request in flight (Sequence) and of one named conversation (Session). Both are owned
// by the engine thread; nothing here is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/block_manager.h"
#include "engine/output_processor.h"
#include "engine/request.h"

namespace qkv {

using Clock = std::chrono::steady_clock;

// A token list whose K/V live (partly) in the cache.
struct CachedTokens {
  std::vector<int> tokens;       // every token of the context
  SeqKv kv;                      // blocks; kv.n_tokens positions hold K/V (<= tokens.size())
  std::vector<uint64_t> hashes;  // chain hashes of the leading full blocks whose content is known
};

struct Sequence;

struct Session {
  std::string id;
  std::string ns;
  uint32_t ns_id = 0;
  std::string affinity_key;  // its own id, or its fork root's
  CachedTokens ctx;
  double ttl_s = 0;  // idle time before it is closed; 0: never
  int priority = 0;
  Clock::time_point created, last_used;
  Clock::time_point expires_at;  // last_used + ttl, while queued in the engine's expiry order
  bool expiry_queued = false;
  ContextOverflow overflow{OverflowPolicy::kError, 0};
  // Where each chat turn (a request fed by messages) began in ctx.tokens, ascending: drop_oldest drops whole
  // turns when it can.
  std::vector<int> turn_starts;
  int64_t dropped_tokens = 0;  // history dropped by drop_oldest over the session's life
  bool busy = false;           // a request is running on it
  // The running turn while busy: the context (and its blocks) are with it until it finishes.
  const Sequence* turn = nullptr;
  bool evicted() const { return ctx.kv.blocks.empty() && !ctx.tokens.empty(); }
};

struct Sequence {
  uint64_t id = 0;
  GenerateParams params;
  uint32_t ns_id = 0;
  CachedTokens ctx;
  int n_prompt = 0;  // context length before generation
  int n_cached = 0;  // context tokens reused at admission
  int n_generated = 0;
  int max_tokens = 0;
  int tenant_max_running = 1 << 30;  // its tenant's running cap (TenantQuota::max_running)
  bool use_prefix_cache = true;
  // (Models that keep state) where the context leaves the cached blocks found at admission, past the deepest
  // state snapshot: its state is snapshotted there too, so that the next request sharing that prefix (a
  // common system prompt) reuses it. -1: none.
  int snapshot_at = -1;
  std::unique_ptr<OutputProcessor> output;  // sampling, logprobs, text, stop checks
  std::shared_ptr<RequestStream> stream;
  Session* session = nullptr;
  std::vector<int> session_tokens_before;  // to restore the session if the turn fails
  int session_kv_before = 0;
  // drop_oldest at admission: how many history tokens were dropped, after which kept prefix, and the
  // history before the drop (a failed turn restores it; its K/V past the kept prefix is recomputed).
  int n_dropped = 0;
  int drop_keep = 0;
  std::vector<int> tokens_before_drop;
  std::vector<int> turn_starts_before_drop;
  std::vector<float> prompt_logprobs;
  bool prompt_logprobs_sent = false;
  Clock::time_point submitted, first_scheduled, first_token, last_token;
  bool scheduled_once = false;
  bool emitted_token = false;
  int preemptions = 0;
  // Tokens still to compute before the next sample.
  int pending() const { return static_cast<int>(ctx.tokens.size()) - ctx.kv.n_tokens; }
};

}  // namespace qkv
