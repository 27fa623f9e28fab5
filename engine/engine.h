// The continuous-batching engine: one thread owns the model, the KV cache, the sessions and the schedule.
// Other threads talk to it through this class only: calls post a command to the engine thread and get its
// answer through a completion callback (or wait for it, in the synchronous forms), and tokens stream back
// through RequestStream.
//
// Each step: run posted commands → close expired sessions → drop cancelled requests → plan (scheduler)
// → one forward pass over the plan → sample, stream, retire finished sequences → publish a stats snapshot.
//
// Sessions: a named conversation whose KV blocks stay resident between requests. A request on a session
// appends its prompt to the history, prefills only what is not cached, and on success the history takes
// every prompt and sampled token (including the one that ended the turn). A turn that is cancelled or
// fails leaves the session as it was before the turn: the same tokens, and K/V that is the same or covers
// one more of those tokens (a history position the turn computed keeps its valid K/V).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/model.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"

namespace qkv {

// What one tenant (an API key; "" without keys) may hold at once. Sessions count forks; waiting and running
// are requests queued and sequences in the running batch; priority is the range its requests may ask for
// (outside it: INVALID_ARGUMENT), so that one key cannot outrank another unless an operator allows it.
struct TenantQuota {
  int max_sessions = 10000;
  int max_waiting = 1024;
  int max_running = 64;
  int min_priority = 0, max_priority = 0;
};

struct EngineOptions {
  int max_num_batched_tokens = 512;  // must not exceed the model's max_batch_tokens
  int max_num_seqs = 64;
  bool prefix_caching = true;
  int max_waiting = 1024;                     // queued requests beyond this are refused (RESOURCE_EXHAUSTED)
  int default_max_tokens = 256;               // when a request gives none (capped by the context)
  int max_sessions = 100000;                  // all tenants together
  TenantQuota default_quota;                  // every tenant's, unless overridden below
  std::map<std::string, TenantQuota> quotas;  // by namespace (API key)
  const TenantQuota& QuotaFor(const std::string& ns) const {
    auto it = quotas.find(ns);
    return it == quotas.end() ? default_quota : it->second;
  }
};

struct SessionInfo {
  std::string id;
  std::string affinity_key;
  int n_tokens = 0;         // history length
  int n_cached_tokens = 0;  // positions holding K/V
  int64_t resident_blocks = 0;
  int64_t resident_bytes = 0;
  bool evicted = false;
  bool busy = false;
  double ttl_s = 0;
  int priority = 0;
  double created_unix = 0, last_used_unix = 0;
  ContextOverflow overflow;
  int64_t dropped_tokens = 0;  // history dropped by drop_oldest over the session's life
  std::vector<int> tokens;     // only when asked
};

// A Prometheus-style histogram: counts per bucket (upper bounds `bounds`, then +Inf), sum and count.
struct Histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  // bounds.size() + 1
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b = {}) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void Observe(double v) {
    size_t i = 0;
    while (i < bounds.size() && v > bounds[i]) ++i;
    ++counts[i];
    sum += v;
    ++count;
  }
};

struct EngineStats {
  int64_t blocks_total = 0, blocks_used = 0, blocks_cached = 0, blocks_free = 0;
  int block_size = 0;
  int64_t kv_bytes_per_token = 0;
  int64_t tokens_capacity = 0, tokens_used = 0, slack_tokens = 0;
  // Per-sequence state slots (models with Gated DeltaNet layers; else 0): in use, free, bytes of one.
  int64_t state_slots_used = 0, state_slots_free = 0, state_bytes_per_slot = 0;
  // Prefix caching of such models: states kept at block boundaries, and room for how many.
  int64_t state_snapshots = 0, state_snapshot_slots = 0;
  int64_t sessions_resident = 0, sessions_evicted = 0, session_kv_bytes = 0;
  int64_t requests_running = 0, requests_waiting = 0;
  uint64_t preemptions = 0;
  uint64_t session_evictions_memory = 0, session_evictions_ttl = 0, session_evictions_closed = 0;
  uint64_t prefix_queries_tokens = 0, prefix_hits_tokens = 0;
  uint64_t finished_stop = 0, finished_length = 0, finished_cancelled = 0, finished_error = 0;
  // Finished requests by the transport that submitted them (GenerateParams::front; "" as "other") and reason.
  std::map<std::pair<std::string, std::string>, uint64_t> finished_by_front;
  uint64_t prompt_tokens = 0, cached_prompt_tokens = 0, generated_tokens = 0;
  uint64_t steps = 0;
  // Mixture of experts: per MoE block, tokens routed to each expert since start (routing skew).
  std::vector<std::pair<int, std::vector<uint64_t>>> expert_tokens;
  Histogram ttft{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram itl{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1}};
  Histogram e2e{{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120}};
  Histogram queue{{0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30}};
  Histogram step{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
  Histogram batch_tokens{{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048}};
  // How long a posted command (a submit, a session call) waits for the engine thread.
  Histogram command_wait{{0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
};

class Engine {
 public:
  // The model must outlive the engine. Starts the engine thread.
  static StatusOr<std::unique_ptr<Engine>> Create(Model& model, const EngineOptions& opt);
  ~Engine();  // cancels what runs and joins the thread

  // Every call below comes in two forms. The asynchronous one posts the work to the engine thread and
  // returns at once; `done` runs on the engine thread with the result (exactly once, also at shutdown) and
  // must not block: gRPC reactors use it to finish a call or to start a stream. The synchronous one waits
  // for that result (at most one engine step), for tools and tests.
  template <typename T>
  using Done = std::function<void(T)>;
  using StreamOrError = StatusOr<std::shared_ptr<RequestStream>>;

  // Validates and queues a request. Errors: INVALID_ARGUMENT (bad tokens, ranges, context overflow),
  // NOT_FOUND (unknown session), FAILED_PRECONDITION (session busy), RESOURCE_EXHAUSTED (queue full or
  // the request cannot fit even in an empty cache), ALREADY_EXISTS (request id in use), UNAVAILABLE (stopping).
  void Submit(GenerateParams p, Done<StreamOrError> done);
  StreamOrError Submit(GenerateParams p);
  // Cancels a request of namespace ns; unknown ids are a no-op. Takes effect within one step. Never waits.
  void Cancel(const std::string& ns, const std::string& request_id);

  // overflow: the session's context-overflow policy (kUnspecified: kError).
  void CreateSession(const std::string& ns, const std::string& id, double ttl_s, int priority,
                     std::vector<int> initial_tokens, ContextOverflow overflow, Done<StatusOr<SessionInfo>> done);
  StatusOr<SessionInfo> CreateSession(const std::string& ns, const std::string& id, double ttl_s, int priority,
                                      std::vector<int> initial_tokens, ContextOverflow overflow = {});
  // Changes a session's context-overflow policy (also while a turn runs: it applies from the next one).
  void UpdateSession(const std::string& ns, const std::string& id, ContextOverflow overflow,
                     Done<StatusOr<SessionInfo>> done);
  StatusOr<SessionInfo> UpdateSession(const std::string& ns, const std::string& id, ContextOverflow overflow);
  // A busy session (a turn running on it) reports its history before the turn and the blocks it holds now.
  void GetSession(const std::string& ns, const std::string& id, bool with_tokens, Done<StatusOr<SessionInfo>> done);
  StatusOr<SessionInfo> GetSession(const std::string& ns, const std::string& id, bool with_tokens);
  void ListSessions(const std::string& ns, Done<std::vector<SessionInfo>> done);
  std::vector<SessionInfo> ListSessions(const std::string& ns);
  void ForkSession(const std::string& ns, const std::string& parent, const std::string& child,
                   Done<StatusOr<SessionInfo>> done);
  StatusOr<SessionInfo> ForkSession(const std::string& ns, const std::string& parent, const std::string& child);
  void TruncateSession(const std::string& ns, const std::string& id, int n_tokens, Done<StatusOr<SessionInfo>> done);
  StatusOr<SessionInfo> TruncateSession(const std::string& ns, const std::string& id, int n_tokens);
  void CloseSession(const std::string& ns, const std::string& id, Done<Status> done);
  Status CloseSession(const std::string& ns, const std::string& id);

  // The snapshot published after the last step (never takes the engine's lock). It can lag: when it is
  // expensive it is published at most every 50x its cost (at most 1 s apart), so it may predate the last
  // commands.
  EngineStats Stats() const;
  // The wait after a snapshot that cost `cost` of the engine thread's CPU time before the next one.
  static Clock::duration StatsPublishInterval(Clock::duration cost);
  // Requests in flight (running, waiting or preempted), counted on the engine thread after every command
  // posted before this call (so a request submitted earlier is counted). Waits at most one step; the drain
  // uses it because the snapshot above can predate a request that has already streamed tokens.
  int64_t RequestsInFlight();
  // Seconds since the engine thread last finished a loop iteration (it wakes at least every 250 ms, so a
  // large figure means it is stuck); liveness checks read it.
  double SecondsSinceProgress() const;
  // Stops taking requests (UNAVAILABLE) and cancels the running ones.
  void Shutdown();
  // Test hook: checks block accounting against every owner; "" when consistent. Runs on the engine thread.
  std::string CheckConsistency();
  // Test hook: runs fn on the engine thread between steps, then publishes the stats snapshot.
  void RunOnEngineThread(std::function<void()> fn);
  const Model& model() const { return model_; }
  const EngineOptions& options() const { return opt_; }

 private:
  Engine(Model& model, const EngineOptions& opt, std::unique_ptr<CacheStores> cache);
  void Loop();
  void Post(std::function<void()> fn);
  void RunCommand(std::function<void()>& fn);
  // Ends every request in flight with INTERNAL (after an exception on the engine thread).
  void FailRunning(const std::string& why);
  // The global session cap and ns's own (forks included).
  Status CheckSessionQuota(const std::string& ns) const;
  // Runs fn on the engine thread and hands its result to done there.
  template <typename T>
  void Async(std::function<T()> fn, Done<T> done);
  // Runs fn on the engine thread and waits for its result.
  template <typename T>
  T Call(std::function<T()> fn);
  StreamOrError DoSubmit(GenerateParams p);
  StatusOr<SessionInfo> DoCreateSession(const std::string& ns, const std::string& id, double ttl_s, int priority,
                                        std::vector<int> initial_tokens, ContextOverflow overflow);
  StatusOr<SessionInfo> DoUpdateSession(const std::string& ns, const std::string& id, ContextOverflow overflow);
  StatusOr<SessionInfo> DoGetSession(const std::string& ns, const std::string& id, bool with_tokens);
  std::vector<SessionInfo> DoListSessions(const std::string& ns);
  StatusOr<SessionInfo> DoForkSession(const std::string& ns, const std::string& parent, const std::string& child);
  StatusOr<SessionInfo> DoTruncateSession(const std::string& ns, const std::string& id, int n_tokens);
  Status DoCloseSession(const std::string& ns, const std::string& id);
  // One step: drop cancelled requests → plan (scheduler) → forward pass → ProcessOutputs.
  void Step();
  void ProcessOutputs(const std::vector<ScheduledChunk>& chunks, const std::vector<int>& starts);
  void Finish(Sequence* s, FinishReason reason, const std::string& stop_reason, Status error = {});
  void ExpireSessions();
  // Marks a session used now and (re)queues its expiry; Forget dequeues it (before it is erased).
  void Touch(Session& s);
  void Forget(Session& s);
  using SessionMap = std::map<std::pair<std::string, std::string>, std::unique_ptr<Session>>;
  // The only places sessions enter and leave sessions_: expiry order and per-key counts follow them.
  SessionInfo AddSession(std::unique_ptr<Session> s);
  void EraseSession(SessionMap::iterator it);
  bool EvictIdleSession();
  SessionInfo Info(const Session& s, bool with_tokens) const;
  void PublishStats();
  void MaybePublishStats();
  Session* FindSession(const std::string& ns, const std::string& id);
  Status ValidateTokens(const std::vector<int>& tokens, const char* field) const;

  Model& model_;
  EngineOptions opt_;
  Scheduler scheduler_;
  std::thread thread_;

  std::mutex mu_;  // guards commands_ and stop_
  std::condition_variable cv_;
  struct Command {
    std::function<void()> fn;
    Clock::time_point posted;
  };
  std::deque<Command> commands_;
  bool stop_ = false;
  std::atomic<bool> accepting_{true};

  // Engine-thread state.
  uint64_t next_seq_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Sequence>> seqs_;
  std::map<std::pair<std::string, std::string>, uint64_t> by_request_id_;
  SessionMap sessions_;
  std::set<std::tuple<Clock::time_point, std::string, std::string>> expiry_;  // (deadline, ns, id), TTL > 0
  std::map<std::string, int> sessions_per_ns_;
  EngineStats counters_;
  // Per-step scratch, kept so that the step loop does not allocate.
  std::vector<ScheduledChunk> step_chunks_;
  std::vector<BatchChunk> step_batch_;
  std::vector<int> step_starts_, stats_filled_;

  Clock::time_point next_publish_{};
  std::atomic<int64_t> progress_ns_{0};                    // steady-clock time of the last finished loop iteration
  int64_t fault_throw_step_ = -1, fault_stall_step_ = -1;  // QKV_FAULT_INJECT (tests)
  double fault_stall_s_ = 0;
  mutable std::mutex stats_mu_;
  EngineStats published_;
};

}  // namespace qkv
