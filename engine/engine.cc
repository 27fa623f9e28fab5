#include "engine/engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <future>
#include <new>
#include <type_traits>

#include "engine/request_limits.h"

namespace qkv {
namespace {

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double UnixTime(Clock::time_point t) {
  const auto now_sys = std::chrono::system_clock::now();
  const auto delta = std::chrono::duration_cast<std::chrono::system_clock::duration>(t - Clock::now());
  return std::chrono::duration<double>((now_sys + delta).time_since_epoch()).count();
}

}  // namespace

StatusOr<std::unique_ptr<Engine>> Engine::Create(Model& model, const EngineOptions& opt) {
  if (opt.max_num_batched_tokens < 1 || opt.max_num_batched_tokens > model.options().max_batch_tokens) {
    return InvalidArgument("max_num_batched_tokens must be in 1.." + std::to_string(model.options().max_batch_tokens) +
                           " (the model's batch limit)");
  }
  if (opt.max_num_seqs < 1) return InvalidArgument("max_num_seqs must be positive");
  // Every chunk of a step wants at least one row of logits, and a step has at most min(max_num_seqs,
  // max_num_batched_tokens) chunks: each running sequence must be able to take a step.
  if (std::min(opt.max_num_seqs, opt.max_num_batched_tokens) > model.max_logit_rows()) {
    const bool seqs = opt.max_num_seqs <= opt.max_num_batched_tokens;
    return InvalidArgument(std::string(seqs ? "max_num_seqs" : "max_num_batched_tokens") + " (" +
                           std::to_string(seqs ? opt.max_num_seqs : opt.max_num_batched_tokens) +
                           ") exceeds the model's " + std::to_string(model.max_logit_rows()) +
                           " rows of logits (max_logit_rows)");
  }
  if (opt.default_max_tokens < 1) return InvalidArgument("default max_tokens must be positive");
  // The cache stores the model's layers need; the scheduler owns them from here on. Faulting their pages in is
  // most of the start-up after the weights on a big budget (docs/performance.md): the log says how long.
  const auto t0 = Clock::now();
  QKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheStores> cache, CacheStores::Create(model.cache_layout()));
  spdlog::info("kv cache: {:.1f} MiB faulted in in {:.2f} s", cache->layout().bytes() / 1048576.0,
               std::chrono::duration<double>(Clock::now() - t0).count());
  auto e = std::unique_ptr<Engine>(new Engine(model, opt, std::move(cache)));
  e->PublishStats();
  e->progress_ns_.store(Clock::now().time_since_epoch().count());
  e->thread_ = std::thread([p = e.get()] { p->Loop(); });
  return e;
}

Engine::Engine(Model& model, const EngineOptions& opt, std::unique_ptr<CacheStores> cache)
    : model_(model),
      opt_(opt),
      scheduler_(std::move(cache),
                 {opt.max_num_batched_tokens, opt.max_num_seqs, opt.prefix_caching, model.max_logit_rows()}) {
  // Fault injection for the reliability tests (docs/server.md): QKV_FAULT_INJECT=throw_on_step=N makes
  // forward step N throw (as an allocation failure would); stall_on_step=N:SECONDS makes it hang that long.
  if (const char* f = std::getenv("QKV_FAULT_INJECT"); f && *f) {
    const std::string spec(f);
    int n = 0;
    double secs = 0;
    if (std::sscanf(spec.c_str(), "throw_on_step=%d", &n) == 1) {
      fault_throw_step_ = n;
    } else if (std::sscanf(spec.c_str(), "stall_on_step=%d:%lf", &n, &secs) == 2) {
      fault_stall_step_ = n;
      fault_stall_s_ = secs;
    }
    spdlog::warn("QKV_FAULT_INJECT={}: fault injection is on (tests only)", spec);
  }
}

Engine::~Engine() {
  Shutdown();
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Run anything posted after the loop ended so no caller waits forever.
  for (auto& c : commands_) c.fn();
  for (auto& [id, s] : seqs_) scheduler_.Release(s->ctx.kv);
  for (auto& [key, s] : sessions_) scheduler_.Release(s->ctx.kv);
}

void Engine::Post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> l(mu_);
    commands_.push_back({std::move(fn), Clock::now()});
  }
  cv_.notify_all();
}

template <typename T>
void Engine::Async(std::function<T()> fn, Done<T> done) {
  Post([fn = std::move(fn), done = std::move(done)] {
    std::optional<T> result;
    try {
      result.emplace(fn());
    } catch (const std::exception& e) {  // the caller gets an error, the engine thread goes on
      if constexpr (std::is_constructible_v<T, Status>) {
        result.emplace(Internal(std::string("engine: ") + e.what()));
      } else {
        result.emplace();
      }
    }
    done(std::move(*result));
  });
}

void Engine::RunCommand(std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    spdlog::error("engine command failed: {}", e.what());
  }
}

void Engine::FailRunning(const std::string& why) {
  spdlog::error("{}", why);
  std::vector<Sequence*> victims;
  for (auto& [id, s] : seqs_) victims.push_back(s.get());
  for (Sequence* s : victims) Finish(s, FinishReason::kError, "", Internal(why));
}

Status Engine::CheckSessionQuota(const std::string& ns) const {
  if (static_cast<int>(sessions_.size()) >= opt_.max_sessions) {
    return ResourceExhausted("the server holds " + std::to_string(opt_.max_sessions) + " sessions, its limit");
  }
  const int quota = opt_.QuotaFor(ns).max_sessions;
  auto it = sessions_per_ns_.find(ns);
  if (it != sessions_per_ns_.end() && it->second >= quota) {
    return ResourceExhausted("this key holds " + std::to_string(quota) +
                             " sessions, its limit (forks count; --max-sessions-per-key or the key file)");
  }
  return {};
}

double Engine::SecondsSinceProgress() const {
  const int64_t last = progress_ns_.load();
  return std::chrono::duration<double>(Clock::now().time_since_epoch() - Clock::duration(last)).count();
}

template <typename T>
T Engine::Call(std::function<T()> fn) {
  auto p = std::make_shared<std::promise<T>>();
  auto f = p->get_future();
  Async<T>(std::move(fn), [p](T r) { p->set_value(std::move(r)); });
  return f.get();
}

void Engine::RunOnEngineThread(std::function<void()> fn) {
  Call<int>([&] {
    fn();
    // Stats() is then current: the rate limit of MaybePublishStats (which grows on a loaded machine) could
    // otherwise leave a snapshot from before the last command.
    PublishStats();
    return 0;
  });
}

void Engine::Shutdown() {
  if (!accepting_.exchange(false)) return;
  Post([this] {
    for (auto& [id, s] : seqs_) s->stream->Cancel();
  });
}

void Engine::Loop() {
  for (;;) {
    std::deque<Command> cmds;
    {
      std::unique_lock<std::mutex> l(mu_);
      const bool idle = scheduler_.idle();
      if (idle && commands_.empty() && !stop_) cv_.wait_for(l, std::chrono::milliseconds(250));
      if (stop_ && commands_.empty() && seqs_.empty()) break;
      if (stop_ && commands_.empty() && !seqs_.empty()) {
        for (auto& [id, s] : seqs_) s->stream->Cancel();
      }
      cmds.swap(commands_);
    }
    const auto now = Clock::now();
    for (auto& c : cmds) {
      counters_.command_wait.Observe(std::chrono::duration<double>(now - c.posted).count());
      RunCommand(c.fn);
    }
    ExpireSessions();
    try {
      Step();
    } catch (const std::exception& e) {
      // An exception (an allocation failure, a bug) fails the requests in flight, not the process.
      FailRunning(std::string("engine step failed: ") + e.what());
    }
    MaybePublishStats();
    progress_ns_.store(Clock::now().time_since_epoch().count());
  }
}

Status Engine::ValidateTokens(const std::vector<int>& tokens, const char* field) const {
  const int vocab = model_.config().vocab;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return InvalidArgument(std::string(field) + "[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                             " is outside the vocabulary (0.." + std::to_string(vocab - 1) + ")");
    }
  }
  return {};
}

Session* Engine::FindSession(const std::string& ns, const std::string& id) {
  auto it = sessions_.find({ns, id});
  return it == sessions_.end() ? nullptr : it->second.get();
}

void Engine::Submit(GenerateParams p, Done<StreamOrError> done) {
  if (!accepting_) return done(Status(StatusCode::kUnavailable, "the server is shutting down"));
  auto params = std::make_shared<GenerateParams>(std::move(p));
  Async<StreamOrError>([this, params] { return DoSubmit(std::move(*params)); }, std::move(done));
}

Engine::StreamOrError Engine::Submit(GenerateParams p) {
  if (!accepting_) return Status(StatusCode::kUnavailable, "the server is shutting down");
  auto params = std::make_shared<GenerateParams>(std::move(p));
  return Call<StreamOrError>([this, params] { return DoSubmit(std::move(*params)); });
}

Engine::StreamOrError Engine::DoSubmit(GenerateParams p) {
  if (!accepting_) return Status(StatusCode::kUnavailable, "the server is shutting down");
  QKV_RETURN_IF_ERROR(p.sampling.Validate());
  if (p.prompt.empty()) return InvalidArgument("prompt is empty");
  QKV_RETURN_IF_ERROR(ValidateTokens(p.prompt, "prompt"));
  QKV_RETURN_IF_ERROR(ValidateTokens(p.stop_token_ids, "stop_token_ids"));
  if (p.max_tokens == 0 || p.max_tokens < -1) return InvalidArgument("max_tokens must be at least 1");
  if (p.logprobs < 0 || p.logprobs > 20) return InvalidArgument("logprobs must be in 0..20");
  if (p.request_id.empty()) p.request_id = "req-" + std::to_string(next_seq_id_);
  QKV_RETURN_IF_ERROR(CheckId("request_id", p.request_id));
  if (by_request_id_.count({p.ns, p.request_id})) {
    return Status(StatusCode::kAlreadyExists, "request_id '" + p.request_id + "' is already running");
  }
  const TenantQuota& quota = opt_.QuotaFor(p.ns);
  if (p.priority < quota.min_priority || p.priority > quota.max_priority) {
    return InvalidArgument("priority " + std::to_string(p.priority) + " is outside this key's range " +
                           std::to_string(quota.min_priority) + ".." + std::to_string(quota.max_priority) +
                           " (--priority-range or the key file)");
  }
  const uint32_t ns_id = scheduler_.pool().Namespace(p.ns);
  if (static_cast<int>(scheduler_.n_waiting()) >= opt_.max_waiting) {
    return ResourceExhausted("the request queue is full (" + std::to_string(opt_.max_waiting) + " waiting)");
  }
  if (scheduler_.n_waiting(ns_id) >= quota.max_waiting) {
    return ResourceExhausted("this key has " + std::to_string(quota.max_waiting) +
                             " requests waiting, its limit (--max-waiting-per-key or the key file)");
  }
  Session* session = nullptr;
  // A session this request created (prompt_is_context, an unknown id) goes again if the request is
  // refused below: a refused request leaves no state behind.
  struct CreatedSession {
    Engine* e;
    std::pair<std::string, std::string> key;
    bool armed = false;
    ~CreatedSession() {
      if (!armed) return;
      if (auto it = e->sessions_.find(key); it != e->sessions_.end()) e->EraseSession(it);
    }
  } created{this, {p.ns, p.session_id}};
  // prompt_is_context: the history is cut back to what it shares with the prompt, once every check passed.
  int64_t cut_to = -1;
  if (!p.session_id.empty()) {
    session = FindSession(p.ns, p.session_id);
    if (!session && p.prompt_is_context) {
      QKV_RETURN_IF_ERROR(DoCreateSession(p.ns, p.session_id, p.create_ttl_s, 0, {}, {}).status());
      session = FindSession(p.ns, p.session_id);
      created.armed = true;
    }
    if (!session) return NotFound("session '" + p.session_id + "' not found");
    if (session->busy) {
      return FailedPrecondition("session '" + p.session_id +
                                "' is busy with another request; wait for it or cancel it");
    }
    if (p.prompt_is_context) {
      // Keep what the history and the prompt share; one prompt token at least stays to be computed.
      const std::vector<int>& h = session->ctx.tokens;
      size_t common = 0;
      while (common < h.size() && common < p.prompt.size() && h[common] == p.prompt[common]) ++common;
      if (common == p.prompt.size()) --common;
      if (common < h.size()) cut_to = static_cast<int64_t>(common);
      p.prompt.erase(p.prompt.begin(), p.prompt.begin() + static_cast<std::ptrdiff_t>(common));
    }
  }
  // The context-overflow policy: the request's, else the session's.
  if (p.overflow.keep_tokens < 0) return InvalidArgument("overflow.keep_tokens must be at least 0");
  ContextOverflow overflow = session ? session->overflow : ContextOverflow{OverflowPolicy::kError, 0};
  if (p.overflow.policy != OverflowPolicy::kUnspecified) overflow = p.overflow;
  if (!session && overflow.policy == OverflowPolicy::kDropOldest) {
    return InvalidArgument("overflow.policy drop_oldest needs a session_id (it drops session history)");
  }
  // 64-bit: a client's max_tokens near INT_MAX must not wrap past the check.
  const int64_t max_ctx = model_.max_context();
  int64_t history = session ? (cut_to >= 0 ? cut_to : static_cast<int64_t>(session->ctx.tokens.size())) : 0;
  int64_t ctx_len = history + static_cast<int64_t>(p.prompt.size());
  int64_t max_tokens = p.max_tokens;
  const int B = model_.options().block_size;
  // drop_oldest: the oldest history after the kept prefix goes, in whole blocks, so that history + prompt +
  // the reply limit (asked, or the server's default) fit. Planned here, applied once every check passed.
  int64_t drop = 0, keep = 0;
  if (overflow.policy == OverflowPolicy::kDropOldest) {
    // No max_tokens: the server's default, capped by what fits beside the kept prefix and the prompt.
    const int64_t want =
        max_tokens == -1
            ? std::min<int64_t>(opt_.default_max_tokens, max_ctx - std::min<int64_t>(overflow.keep_tokens, history) -
                                                             static_cast<int64_t>(p.prompt.size()))
            : max_tokens;
    const int64_t over = ctx_len + want - max_ctx;
    if (over > 0 && want >= 1) {
      keep = std::min<int64_t>(overflow.keep_tokens, history);
      if (history - keep < over) {
        return InvalidArgument("context overflow: the kept prefix (overflow.keep_tokens " + std::to_string(keep) +
                               ") + prompt (" + std::to_string(p.prompt.size()) + ") + max_tokens (" +
                               std::to_string(want) + ") exceeds the context of " + std::to_string(max_ctx) +
                               " tokens even with all other history dropped");
      }
      drop = std::min((over + B - 1) / B * B, history - keep);
      // A chat session drops whole turns: up to the first turn that starts at or after keep + over.
      for (int t : session->turn_starts) {
        if (cut_to >= 0 && t >= cut_to) break;  // turns the prompt no longer shares (cut below)
        if (t >= keep + over && t <= history) {
          drop = t - keep;
          break;
        }
      }
      history -= drop;
      ctx_len -= drop;
      max_tokens = want;
    }
  }
  if (max_tokens == -1) max_tokens = std::min<int64_t>(opt_.default_max_tokens, max_ctx - ctx_len);
  if (ctx_len + max_tokens > max_ctx || max_tokens < 1) {
    return InvalidArgument(
        "context overflow: " + std::string(session ? "session history (" + std::to_string(history) + ") + " : "") +
        "prompt (" + std::to_string(p.prompt.size()) + ") + max_tokens (" +
        std::to_string(std::max<int64_t>(max_tokens, 1)) + ") exceeds the context of " + std::to_string(max_ctx) +
        " tokens" +
        (session ? "; truncate the session (TruncateSession), start a new one, or set overflow.policy drop_oldest"
                 : ""));
  }
  if ((ctx_len + max_tokens + B - 1) / B > scheduler_.pool().total_blocks()) {
    return ResourceExhausted("the request needs " + std::to_string(ctx_len + max_tokens) +
                             " tokens of KV cache, more than the whole cache holds (" +
                             std::to_string(scheduler_.pool().total_blocks() * B) + ")");
  }
  // Every check passed: from here on the request is taken.
  created.armed = false;
  if (cut_to >= 0) {
    const int n = static_cast<int>(cut_to);
    scheduler_.Truncate(session->ctx, n);
    std::erase_if(session->turn_starts, [n](int t) { return t >= n; });
  }
  auto s = std::make_unique<Sequence>();
  s->id = next_seq_id_++;
  s->ns_id = ns_id;
  s->tenant_max_running = quota.max_running;
  s->max_tokens = static_cast<int>(max_tokens);  // <= the context
  s->use_prefix_cache = opt_.prefix_caching && !p.prompt_logprobs;
  if (session) {
    if (drop > 0) {  // positions after the kept prefix change: their K/V goes and is recomputed
      s->n_dropped = static_cast<int>(drop);
      s->drop_keep = static_cast<int>(keep);
      s->tokens_before_drop = session->ctx.tokens;
      s->turn_starts_before_drop = session->turn_starts;
      std::vector<int> rest(session->ctx.tokens.begin() + keep + drop, session->ctx.tokens.end());
      scheduler_.Truncate(session->ctx, static_cast<int>(keep));
      session->ctx.tokens.insert(session->ctx.tokens.end(), rest.begin(), rest.end());
      session->dropped_tokens += drop;
      std::vector<int> starts;  // turns inside the kept prefix stay; dropped ones go; later ones move
      for (int t : session->turn_starts) {
        if (t < keep) starts.push_back(t);
        if (t >= keep + drop) starts.push_back(static_cast<int>(t - drop));
      }
      session->turn_starts = std::move(starts);
    }
    s->session = session;
    s->session_tokens_before = session->ctx.tokens;
    s->session_kv_before = session->ctx.kv.n_tokens;
    s->ctx = std::move(session->ctx);
    session->ctx = {};
    session->busy = true;
    session->turn = s.get();
    Touch(*session);
  }
  s->ctx.tokens.insert(s->ctx.tokens.end(), p.prompt.begin(), p.prompt.end());
  s->n_prompt = static_cast<int>(ctx_len);
  s->n_cached = s->ctx.kv.n_tokens;
  OutputOptions oo;
  oo.stop = p.stop;
  oo.include_stop_str_in_output = p.include_stop_str_in_output;
  oo.stop_token_ids = p.stop_token_ids;
  oo.ignore_eos = p.ignore_eos;
  oo.max_tokens = s->max_tokens;
  oo.max_context = model_.max_context();
  oo.logprobs = p.logprobs;
  oo.want_logprobs = p.want_logprobs;
  s->output = std::make_unique<OutputProcessor>(model_.tokenizer(), p.sampling, s->ctx.tokens, std::move(oo));
  s->stream = std::make_shared<RequestStream>(p.request_id);
  s->submitted = Clock::now();
  if (p.prompt_logprobs) s->prompt_logprobs.assign(ctx_len, NAN);
  s->params = std::move(p);
  by_request_id_[{s->params.ns, s->params.request_id}] = s->id;
  scheduler_.Enqueue(s.get());
  auto stream = s->stream;
  seqs_[s->id] = std::move(s);
  return stream;
}

void Engine::Cancel(const std::string& ns, const std::string& request_id) {
  Post([this, ns, request_id] {
    auto it = by_request_id_.find({ns, request_id});
    if (it == by_request_id_.end()) return;
    seqs_[it->second]->stream->Cancel();
  });
}

void Engine::Finish(Sequence* s, FinishReason reason, const std::string& stop_reason, Status error) {
  StreamEvent e;
  e.final = true;
  e.finish = reason;
  e.stop_reason = stop_reason;
  e.error = std::move(error);
  if (reason != FinishReason::kError) e.text = s->output->Finish();
  e.usage = {s->n_prompt, s->n_cached, s->n_generated, s->n_dropped};
  const auto now = Clock::now();
  e.timings.queue_s = s->scheduled_once ? Seconds(s->submitted, s->first_scheduled) : Seconds(s->submitted, now);
  e.timings.ttft_s = s->emitted_token ? Seconds(s->submitted, s->first_token) : 0;
  e.timings.total_s = Seconds(s->submitted, now);
  counters_.e2e.Observe(e.timings.total_s);
  if (s->scheduled_once) counters_.queue.Observe(e.timings.queue_s);
  if (s->params.prompt_logprobs && !s->prompt_logprobs_sent) e.prompt_logprobs = s->prompt_logprobs;

  if (Session* ss = s->session) {
    if (reason != FinishReason::kStop && reason != FinishReason::kLength) {
      // The turn failed: back to exactly the history before it, including what drop_oldest dropped (its
      // K/V past the kept prefix is gone and is recomputed by the next turn).
      if (s->n_dropped > 0) {
        scheduler_.Truncate(s->ctx, s->drop_keep);
        s->ctx.tokens = std::move(s->tokens_before_drop);
        ss->dropped_tokens -= s->n_dropped;
        ss->turn_starts = std::move(s->turn_starts_before_drop);
      } else {
        scheduler_.Truncate(s->ctx, static_cast<int>(s->session_tokens_before.size()));
      }
    } else if (s->params.from_messages) {
      ss->turn_starts.push_back(static_cast<int>(s->session_tokens_before.size()));  // where this turn began
    }
    ss->ctx = std::move(s->ctx);
    ss->busy = false;
    ss->turn = nullptr;
    Touch(*ss);
  } else {
    scheduler_.Release(s->ctx.kv);
  }
  switch (reason) {
    case FinishReason::kStop: ++counters_.finished_stop; break;
    case FinishReason::kLength: ++counters_.finished_length; break;
    case FinishReason::kCancelled: ++counters_.finished_cancelled; break;
    default: ++counters_.finished_error; break;
  }
  ++counters_.finished_by_front[{s->params.front.empty() ? "other" : s->params.front, FinishReasonName(reason)}];
  counters_.prompt_tokens += s->n_prompt;
  counters_.cached_prompt_tokens += s->n_cached;
  counters_.generated_tokens += s->n_generated;
  scheduler_.Remove(s);
  by_request_id_.erase({s->params.ns, s->params.request_id});
  auto stream = s->stream;
  seqs_.erase(s->id);  // s is gone from here on
  stream->Push(std::move(e));
}

bool Engine::EvictIdleSession() {
  Session* victim = nullptr;
  for (auto& [key, s] : sessions_) {
    if (s->busy || s->ctx.kv.blocks.empty()) continue;
    if (!victim || s->priority < victim->priority ||
        (s->priority == victim->priority && s->last_used < victim->last_used)) {
      victim = s.get();
    }
  }
  if (!victim) return false;
  scheduler_.Release(victim->ctx.kv);
  victim->ctx.hashes.clear();
  ++counters_.session_evictions_memory;
  return true;
}

void Engine::Touch(Session& s) {
  s.last_used = Clock::now();
  if (s.expiry_queued) expiry_.erase({s.expires_at, s.ns, s.id});
  s.expiry_queued = s.ttl_s > 0;
  if (s.expiry_queued) {
    s.expires_at = s.last_used + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s.ttl_s));
    expiry_.insert({s.expires_at, s.ns, s.id});
  }
}

void Engine::Forget(Session& s) {
  if (s.expiry_queued) expiry_.erase({s.expires_at, s.ns, s.id});
  s.expiry_queued = false;
}

// Only the sessions whose time has come are visited (expiry_ is ordered by deadline), so the cost per
// step does not grow with the number of sessions.
void Engine::ExpireSessions() {
  const auto now = Clock::now();
  while (!expiry_.empty() && std::get<0>(*expiry_.begin()) <= now) {
    const auto [at, ns, id] = *expiry_.begin();
    expiry_.erase(expiry_.begin());
    auto it = sessions_.find({ns, id});
    if (it == sessions_.end()) continue;
    Session& s = *it->second;
    s.expiry_queued = false;
    if (s.busy) continue;  // re-queued by Touch when its turn ends
    EraseSession(it);
    ++counters_.session_evictions_ttl;
  }
}

SessionInfo Engine::AddSession(std::unique_ptr<Session> s) {
  s->created = Clock::now();
  Touch(*s);
  SessionInfo info = Info(*s, false);
  ++sessions_per_ns_[s->ns];
  const auto key = std::make_pair(s->ns, s->id);
  sessions_[key] = std::move(s);
  return info;
}

void Engine::EraseSession(SessionMap::iterator it) {
  Session& s = *it->second;
  scheduler_.Release(s.ctx.kv);
  Forget(s);
  --sessions_per_ns_[s.ns];
  sessions_.erase(it);
}

void Engine::Step() {
  // Cancellations take effect before planning, so their blocks are free for this step.
  std::vector<Sequence*> cancelled;
  for (auto& [id, s] : seqs_) {
    if (s->stream->cancelled()) cancelled.push_back(s.get());
  }
  for (Sequence* s : cancelled) Finish(s, FinishReason::kCancelled, "");

  StepPlan plan = scheduler_.PlanStep([this] { return EvictIdleSession(); });
  for (Sequence* s : plan.failed) {
    Finish(s, FinishReason::kError, "", ResourceExhausted("the request no longer fits in the KV cache"));
  }
  if (plan.empty()) return;
  ++counters_.steps;
  if (static_cast<int64_t>(counters_.steps) == fault_throw_step_) throw std::bad_alloc();
  if (static_cast<int64_t>(counters_.steps) == fault_stall_step_) {
    std::this_thread::sleep_for(std::chrono::duration<double>(fault_stall_s_));
  }
  const auto step_start = Clock::now();
  counters_.batch_tokens.Observe(plan.n_tokens);

  // A chunk the model would refuse fails its own request only; the step runs without it.
  std::vector<ScheduledChunk>& chunks = step_chunks_;
  chunks.clear();
  for (const ScheduledChunk& c : plan.chunks) {
    Sequence* s = c.seq;
    const BatchChunk bc{&s->ctx.kv, std::span<const int>(s->ctx.tokens.data() + s->ctx.kv.n_tokens, c.n_tokens),
                        c.all_logits};
    if (Status cs = model_.CheckChunk(bc); !cs.ok()) {
      spdlog::error("request {} refused by the model: {}", s->params.request_id, cs.ToString());
      Finish(s, FinishReason::kError, "", Internal("the model refused the request's step: " + cs.message()));
      continue;
    }
    chunks.push_back(c);
  }
  if (chunks.empty()) return;
  std::vector<BatchChunk>& batch = step_batch_;  // scratch reused every step: nothing allocated per token
  batch.clear();
  const auto now = Clock::now();
  for (const ScheduledChunk& c : chunks) {
    Sequence* s = c.seq;
    if (!s->scheduled_once) {
      s->scheduled_once = true;
      s->first_scheduled = now;
    }
    batch.push_back(
        {&s->ctx.kv, std::span<const int>(s->ctx.tokens.data() + s->ctx.kv.n_tokens, c.n_tokens), c.all_logits});
  }
  std::vector<int>& starts = step_starts_;
  starts.clear();
  for (const ScheduledChunk& c : chunks) starts.push_back(c.seq->ctx.kv.n_tokens);
  const Status st = model_.Forward(batch, scheduler_.cache());
  if (!st.ok()) {
    spdlog::error("forward pass failed: {}", st.ToString());
    for (const ScheduledChunk& c : chunks)
      Finish(c.seq, FinishReason::kError, "", Internal("forward pass failed: " + st.message()));
    return;
  }
  ProcessOutputs(chunks, starts);
  counters_.step.Observe(Seconds(step_start, Clock::now()));
}

// After the forward pass: register newly full blocks, prompt logprobs, then each sampling sequence's
// OutputProcessor turns its logits row into the token and text that stream back, and the ends.
void Engine::ProcessOutputs(const std::vector<ScheduledChunk>& chunks, const std::vector<int>& starts) {
  const int V = model_.config().vocab;
  int r = 0;
  struct Done {
    Sequence* s;
    FinishReason reason;
    std::string stop_reason;
    Status error;
  };
  std::vector<Done> done;
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const ScheduledChunk& c = chunks[ci];
    Sequence* s = c.seq;
    const int rows = c.all_logits ? c.n_tokens : 1;
    const float* first_row = model_.logits() + static_cast<size_t>(r) * V;
    r += rows;
    scheduler_.RegisterFullBlocks(*s);
    if (c.all_logits) {  // row i predicts the token at position start + i + 1
      for (int i = 0; i < rows; ++i) {
        const int pos = starts[ci] + i + 1;
        if (pos >= s->n_prompt) break;
        const float* lr = first_row + static_cast<size_t>(i) * V;
        const auto [m, lse] = LogSumExp(lr, V);
        s->prompt_logprobs[pos] = lr[s->ctx.tokens[pos]] - m - lse;
      }
    }
    if (!c.sample) continue;
    const float* last = first_row + static_cast<size_t>(rows - 1) * V;
    OutputProcessor::Step out = s->output->Next(last, V, static_cast<int>(s->ctx.tokens.size()) + 1);
    if (out.finish == FinishReason::kError) {  // this request ends; the others in the step are untouched
      done.push_back({s, out.finish, "", std::move(out.error)});
      continue;
    }
    s->ctx.tokens.push_back(out.token);
    ++s->n_generated;
    const auto tnow = Clock::now();
    if (!s->emitted_token) {
      s->emitted_token = true;
      s->first_token = tnow;
      counters_.ttft.Observe(Seconds(s->submitted, tnow));
    } else {
      counters_.itl.Observe(Seconds(s->last_token, tnow));
    }
    s->last_token = tnow;
    StreamEvent e;
    e.token_ids.push_back(out.token);
    e.text = std::move(out.text);
    if (out.logprob) e.logprobs.push_back(std::move(*out.logprob));
    if (s->params.prompt_logprobs && !s->prompt_logprobs_sent) {
      e.prompt_logprobs = s->prompt_logprobs;
      s->prompt_logprobs_sent = true;
    }
    s->stream->Push(std::move(e));
    if (out.finish != FinishReason::kNone) done.push_back({s, out.finish, std::move(out.stop_reason), {}});
  }
  for (Done& d : done) Finish(d.s, d.reason, d.stop_reason, std::move(d.error));
}

SessionInfo Engine::Info(const Session& s, bool with_tokens) const {
  SessionInfo i;
  i.id = s.id;
  i.affinity_key = s.affinity_key;
  // While a turn runs, the session's context is the turn's: its history is what it had before the turn
  // (the turn commits only when it ends), and it holds the blocks the turn holds.
  const CachedTokens& ctx = s.turn ? s.turn->ctx : s.ctx;
  const int history =
      s.turn ? static_cast<int>(s.turn->session_tokens_before.size()) : static_cast<int>(ctx.tokens.size());
  i.n_tokens = history;
  i.n_cached_tokens = std::min(ctx.kv.n_tokens, history);
  i.resident_blocks = static_cast<int64_t>(ctx.kv.blocks.size());
  i.resident_bytes = i.resident_blocks * scheduler_.cache().layout().tokens.bytes_per_block();
  i.evicted = ctx.kv.blocks.empty() && history > 0;
  i.busy = s.busy;
  i.ttl_s = s.ttl_s;
  i.priority = s.priority;
  i.overflow = s.overflow;
  i.dropped_tokens = s.dropped_tokens;
  i.created_unix = UnixTime(s.created);
  i.last_used_unix = UnixTime(s.last_used);
  if (with_tokens) {
    i.tokens = s.turn ? s.turn->session_tokens_before : ctx.tokens;
  }
  return i;
}

void Engine::CreateSession(const std::string& ns, const std::string& id, double ttl_s, int priority,
                           std::vector<int> initial_tokens, ContextOverflow overflow,
                           Done<StatusOr<SessionInfo>> done) {
  Async<StatusOr<SessionInfo>>([=, this] { return DoCreateSession(ns, id, ttl_s, priority, initial_tokens, overflow); },
                               std::move(done));
}

StatusOr<SessionInfo> Engine::CreateSession(const std::string& ns, const std::string& id, double ttl_s, int priority,
                                            std::vector<int> initial_tokens, ContextOverflow overflow) {
  return Call<StatusOr<SessionInfo>>(
      [&] { return DoCreateSession(ns, id, ttl_s, priority, initial_tokens, overflow); });
}

namespace {
// A session's policy: unspecified means error; keep_tokens must not be negative.
StatusOr<ContextOverflow> SessionOverflow(ContextOverflow o) {
  if (o.keep_tokens < 0) return InvalidArgument("overflow.keep_tokens must be at least 0");
  if (o.policy == OverflowPolicy::kUnspecified) o.policy = OverflowPolicy::kError;
  return o;
}
}  // namespace

StatusOr<SessionInfo> Engine::DoCreateSession(const std::string& ns, const std::string& id, double ttl_s, int priority,
                                              std::vector<int> initial_tokens, ContextOverflow overflow) {
  QKV_RETURN_IF_ERROR(CheckId("session_id", id));
  QKV_ASSIGN_OR_RETURN(overflow, SessionOverflow(overflow));
  // Bounded so that now + ttl is representable (an infinite or 1e30 s TTL overflowed the deadline).
  constexpr double kMaxTtl = 10.0 * 365 * 24 * 3600;
  if (!(ttl_s >= 0 && ttl_s <= kMaxTtl)) {
    return InvalidArgument("ttl_seconds must be in 0..315360000 (ten years; 0: never expires)");
  }
  QKV_RETURN_IF_ERROR(ValidateTokens(initial_tokens, "initial_token_ids"));
  if (static_cast<int>(initial_tokens.size()) >= model_.max_context()) {
    return InvalidArgument("initial_token_ids (" + std::to_string(initial_tokens.size()) +
                           ") must be shorter than the context of " + std::to_string(model_.max_context()));
  }
  if (sessions_.count({ns, id})) return Status(StatusCode::kAlreadyExists, "session '" + id + "' already exists");
  QKV_RETURN_IF_ERROR(CheckSessionQuota(ns));
  auto s = std::make_unique<Session>();
  s->id = id;
  s->ns = ns;
  s->ns_id = scheduler_.pool().Namespace(ns);
  s->affinity_key = id;
  s->ctx.tokens = std::move(initial_tokens);
  s->ttl_s = ttl_s;
  s->priority = priority;
  s->overflow = overflow;
  return AddSession(std::move(s));
}

void Engine::UpdateSession(const std::string& ns, const std::string& id, ContextOverflow overflow,
                           Done<StatusOr<SessionInfo>> done) {
  Async<StatusOr<SessionInfo>>([=, this] { return DoUpdateSession(ns, id, overflow); }, std::move(done));
}

StatusOr<SessionInfo> Engine::UpdateSession(const std::string& ns, const std::string& id, ContextOverflow overflow) {
  return Call<StatusOr<SessionInfo>>([&] { return DoUpdateSession(ns, id, overflow); });
}

StatusOr<SessionInfo> Engine::DoUpdateSession(const std::string& ns, const std::string& id, ContextOverflow overflow) {
  Session* s = FindSession(ns, id);
  if (!s) return NotFound("session '" + id + "' not found");
  QKV_ASSIGN_OR_RETURN(s->overflow, SessionOverflow(overflow));
  if (!s->busy) Touch(*s);
  return Info(*s, false);
}

void Engine::GetSession(const std::string& ns, const std::string& id, bool with_tokens,
                        Done<StatusOr<SessionInfo>> done) {
  Async<StatusOr<SessionInfo>>([=, this] { return DoGetSession(ns, id, with_tokens); }, std::move(done));
}

StatusOr<SessionInfo> Engine::GetSession(const std::string& ns, const std::string& id, bool with_tokens) {
  return Call<StatusOr<SessionInfo>>([&] { return DoGetSession(ns, id, with_tokens); });
}

StatusOr<SessionInfo> Engine::DoGetSession(const std::string& ns, const std::string& id, bool with_tokens) {
  Session* s = FindSession(ns, id);
  if (!s) return NotFound("session '" + id + "' not found");
  return Info(*s, with_tokens);
}

void Engine::ListSessions(const std::string& ns, Done<std::vector<SessionInfo>> done) {
  Async<std::vector<SessionInfo>>([=, this] { return DoListSessions(ns); }, std::move(done));
}

std::vector<SessionInfo> Engine::ListSessions(const std::string& ns) {
  return Call<std::vector<SessionInfo>>([&] { return DoListSessions(ns); });
}

std::vector<SessionInfo> Engine::DoListSessions(const std::string& ns) {
  std::vector<SessionInfo> out;
  for (auto it = sessions_.lower_bound({ns, ""}); it != sessions_.end() && it->first.first == ns; ++it) {
    out.push_back(Info(*it->second, false));
  }
  return out;
}

void Engine::ForkSession(const std::string& ns, const std::string& parent, const std::string& child,
                         Done<StatusOr<SessionInfo>> done) {
  Async<StatusOr<SessionInfo>>([=, this] { return DoForkSession(ns, parent, child); }, std::move(done));
}

StatusOr<SessionInfo> Engine::ForkSession(const std::string& ns, const std::string& parent, const std::string& child) {
  return Call<StatusOr<SessionInfo>>([&] { return DoForkSession(ns, parent, child); });
}

StatusOr<SessionInfo> Engine::DoForkSession(const std::string& ns, const std::string& parent,
                                            const std::string& child) {
  QKV_RETURN_IF_ERROR(CheckId("child session_id", child));
  Session* p = FindSession(ns, parent);
  if (!p) return NotFound("session '" + parent + "' not found");
  if (p->busy) return FailedPrecondition("session '" + parent + "' is busy with another request");
  if (sessions_.count({ns, child})) return Status(StatusCode::kAlreadyExists, "session '" + child + "' already exists");
  QKV_RETURN_IF_ERROR(CheckSessionQuota(ns));
  auto s = std::make_unique<Session>();
  s->id = child;
  s->ns = ns;
  s->ns_id = p->ns_id;
  s->affinity_key = p->affinity_key;
  s->ctx = p->ctx;  // shares the parent's blocks, copy-on-write; its state (if any) is copied
  if (!scheduler_.CopyState(p->ctx.kv, s->ctx.kv)) {
    return ResourceExhausted("no free state slot for the fork of session '" + parent + "'");
  }
  for (int b : s->ctx.kv.blocks) scheduler_.pool().Ref(b);
  s->ttl_s = p->ttl_s;
  s->priority = p->priority;
  s->overflow = p->overflow;
  s->dropped_tokens = p->dropped_tokens;
  s->turn_starts = p->turn_starts;
  return AddSession(std::move(s));
}

void Engine::TruncateSession(const std::string& ns, const std::string& id, int n_tokens,
                             Done<StatusOr<SessionInfo>> done) {
  Async<StatusOr<SessionInfo>>([=, this] { return DoTruncateSession(ns, id, n_tokens); }, std::move(done));
}

StatusOr<SessionInfo> Engine::TruncateSession(const std::string& ns, const std::string& id, int n_tokens) {
  return Call<StatusOr<SessionInfo>>([&] { return DoTruncateSession(ns, id, n_tokens); });
}

StatusOr<SessionInfo> Engine::DoTruncateSession(const std::string& ns, const std::string& id, int n_tokens) {
  Session* s = FindSession(ns, id);
  if (!s) return NotFound("session '" + id + "' not found");
  if (s->busy) return FailedPrecondition("session '" + id + "' is busy with another request");
  if (n_tokens < 0 || n_tokens > static_cast<int>(s->ctx.tokens.size())) {
    return InvalidArgument("num_tokens must be in 0.." + std::to_string(s->ctx.tokens.size()) +
                           " (the session's length)");
  }
  scheduler_.Truncate(s->ctx, n_tokens);
  std::erase_if(s->turn_starts, [n_tokens](int t) { return t >= n_tokens; });
  Touch(*s);
  return Info(*s, false);
}

void Engine::CloseSession(const std::string& ns, const std::string& id, Done<Status> done) {
  Async<Status>([=, this] { return DoCloseSession(ns, id); }, std::move(done));
}

Status Engine::CloseSession(const std::string& ns, const std::string& id) {
  return Call<Status>([&] { return DoCloseSession(ns, id); });
}

Status Engine::DoCloseSession(const std::string& ns, const std::string& id) {
  auto it = sessions_.find({ns, id});
  if (it == sessions_.end()) return NotFound("session '" + id + "' not found");
  if (it->second->busy) return FailedPrecondition("session '" + id + "' is busy with another request; cancel it first");
  EraseSession(it);
  ++counters_.session_evictions_closed;
  return {};
}

// The snapshot walks every session and block: when that gets expensive (many sessions) it is published at
// most every 50x its own cost, so it takes under 2% of the engine thread; a cheap one goes out every step.
// The cost is the engine thread's CPU time, not wall time (a thread descheduled for 1 s in the middle of a
// snapshot would otherwise hold the next one back for 50 s), and the wait is capped at one second, so the
// metrics of a quiet server are never more than ~1.25 s old (the idle loop wakes every 250 ms).
Clock::duration Engine::StatsPublishInterval(Clock::duration cost) {
  if (cost < std::chrono::microseconds(200)) return Clock::duration::zero();
  return std::min<Clock::duration>(50 * cost, std::chrono::seconds(1));
}

static Clock::duration ThreadCpuTime() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(ts.tv_sec) +
                                                     std::chrono::nanoseconds(ts.tv_nsec));
}

void Engine::MaybePublishStats() {
  const auto now = Clock::now();
  if (now < next_publish_) return;
  const auto cpu = ThreadCpuTime();
  PublishStats();
  next_publish_ = now + StatsPublishInterval(ThreadCpuTime() - cpu);
}

void Engine::PublishStats() {
  EngineStats s = counters_;
  const KvBlockPool& pool = scheduler_.pool();
  const int B = pool.block_size();
  s.blocks_total = pool.total_blocks();
  s.blocks_used = pool.used_blocks();
  s.blocks_cached = pool.cached_blocks();
  s.blocks_free = pool.free_blocks();
  s.block_size = B;
  s.kv_bytes_per_token = scheduler_.cache().layout().tokens.bytes_per_token();
  const StateStore& states = scheduler_.cache().states();
  s.state_slots_used = states.used_slots();
  s.state_slots_free = states.free_slots();
  s.state_bytes_per_slot = states.bytes_per_slot();
  s.state_snapshots = scheduler_.n_snapshots();
  s.state_snapshot_slots = scheduler_.cache().snapshots().n_slots();
  s.expert_tokens = model_.ExpertTokens();
  s.tokens_capacity = s.blocks_total * B;
  // Token slots holding K/V: per used block, the most positions any owner has filled in it.
  std::vector<int>& filled = stats_filled_;
  filled.assign(static_cast<size_t>(s.blocks_total), 0);
  auto account = [&](const SeqKv& kv) {
    for (size_t i = 0; i < kv.blocks.size(); ++i) {
      const int n = std::clamp(kv.n_tokens - static_cast<int>(i) * B, 0, B);
      filled[kv.blocks[i]] = std::max(filled[kv.blocks[i]], n);
    }
  };
  for (const auto& [id, q] : seqs_) account(q->ctx.kv);
  int64_t session_blocks = 0;
  for (const auto& [key, ss] : sessions_) {
    const CachedTokens& ctx = ss->turn ? ss->turn->ctx : ss->ctx;  // a busy session's KV is with its turn
    account(ctx.kv);
    session_blocks += static_cast<int64_t>(ctx.kv.blocks.size());
    if (!ss->turn && ss->evicted())
      ++s.sessions_evicted;
    else
      ++s.sessions_resident;
  }
  for (size_t b = 0; b < filled.size(); ++b) {
    if (pool.ref_count(static_cast<int>(b)) > 0) s.tokens_used += filled[b];
  }
  s.slack_tokens = s.blocks_used * B - s.tokens_used;
  s.session_kv_bytes = session_blocks * scheduler_.cache().layout().tokens.bytes_per_block();
  s.requests_running = static_cast<int64_t>(scheduler_.n_running());
  s.requests_waiting = static_cast<int64_t>(scheduler_.n_waiting());
  s.preemptions = scheduler_.preemptions();
  s.prefix_queries_tokens = scheduler_.prefix_queries_tokens();
  s.prefix_hits_tokens = scheduler_.prefix_hits_tokens();
  std::lock_guard<std::mutex> l(stats_mu_);
  published_ = s;
}

int64_t Engine::RequestsInFlight() {
  return Call<int64_t>([this] { return static_cast<int64_t>(seqs_.size()); });
}

EngineStats Engine::Stats() const {
  std::lock_guard<std::mutex> l(stats_mu_);
  return published_;
}

std::string Engine::CheckConsistency() {
  return Call<std::string>([this] {
    const KvBlockPool& pool = scheduler_.pool();
    std::string err = pool.CheckInvariants();
    if (!err.empty()) return err;
    std::vector<int> refs(static_cast<size_t>(pool.total_blocks()), 0);
    const int B = pool.block_size();
    auto count = [&](const CachedTokens& c, const std::string& who) -> std::string {
      if (static_cast<int>(c.kv.blocks.size()) * B < c.kv.n_tokens) return who + " has fewer blocks than positions";
      if (c.kv.n_tokens > static_cast<int>(c.tokens.size())) return who + " has more positions than tokens";
      for (int b : c.kv.blocks) ++refs[b];
      return "";
    };
    for (const auto& [id, q] : seqs_) {
      if (auto e = count(q->ctx, "request " + q->params.request_id); !e.empty()) return e;
    }
    for (const auto& [key, ss] : sessions_) {
      if (auto e = count(ss->ctx, "session " + ss->id); !e.empty()) return e;
    }
    for (size_t b = 0; b < refs.size(); ++b) {
      if (refs[b] != pool.ref_count(static_cast<int>(b))) {
        return "block " + std::to_string(b) + " has ref_count " + std::to_string(pool.ref_count(static_cast<int>(b))) +
               " but " + std::to_string(refs[b]) + " owners";
      }
    }
    // State slots: each in-use slot has exactly one owner, and no owner holds a free slot.
    const StateStore& states = scheduler_.cache().states();
    std::vector<int> slot_owners(static_cast<size_t>(states.n_slots()), 0);
    int owned = 0;
    auto own = [&](const CachedTokens& c, const std::string& who) -> std::string {
      if (c.kv.state_slot < 0) return "";
      if (!states.in_use(c.kv.state_slot))
        return who + " holds state slot " + std::to_string(c.kv.state_slot) + ", which is free";
      if (++slot_owners[c.kv.state_slot] > 1)
        return "state slot " + std::to_string(c.kv.state_slot) + " has two owners";
      ++owned;
      return "";
    };
    for (const auto& [id, q] : seqs_) {
      if (auto e = own(q->ctx, "request " + q->params.request_id); !e.empty()) return e;
    }
    for (const auto& [key, ss] : sessions_) {
      if (auto e = own(ss->ctx, "session " + ss->id); !e.empty()) return e;
    }
    if (owned != states.used_slots()) {
      return std::to_string(states.used_slots()) + " state slots in use but " + std::to_string(owned) + " owned";
    }
    return scheduler_.CheckSnapshots();
  });
}

}  // namespace qkv
