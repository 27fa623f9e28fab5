#include "server/service.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "engine/utf8.h"
#include "server/memory.h"
#include "server/tsan_handoff.h"

namespace qkv::server {
namespace pb = qkvserve::v1;

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

namespace {

// Fills the fields common to GenerateResponse and CompleteResponse from one engine event.
template <typename Resp>
void AppendEvent(const StreamEvent& e, const std::vector<int>& prompt_tokens, Resp* r) {
  for (int t : e.token_ids) r->add_token_ids(t);
  r->mutable_text()->append(e.text);
  for (const auto& lp : e.logprobs) {
    auto* o = r->add_logprobs();
    o->set_token_id(lp.token);
    o->set_logprob(lp.logprob);
    for (const auto& [t, v] : lp.top) {
      auto* top = o->add_top();
      top->set_token_id(t);
      top->set_logprob(v);
    }
  }
  if (!e.prompt_logprobs.empty() && e.prompt_logprobs.size() >= prompt_tokens.size()) {
    // The engine reports every context position (session history first); return the new prompt's.
    const size_t offset = e.prompt_logprobs.size() - prompt_tokens.size();
    for (size_t i = 0; i < prompt_tokens.size(); ++i) {
      auto* p = r->add_prompt_logprobs();
      p->set_token_id(prompt_tokens[i]);
      if (!std::isnan(e.prompt_logprobs[offset + i])) p->set_logprob(e.prompt_logprobs[offset + i]);
    }
  }
  if (e.final) {
    r->set_finish_reason(FinishReasonName(e.finish));
    r->set_stop_reason(e.stop_reason);
    r->mutable_usage()->set_prompt_tokens(e.usage.prompt_tokens);
    r->mutable_usage()->set_cached_tokens(e.usage.cached_tokens);
    r->mutable_usage()->set_completion_tokens(e.usage.completion_tokens);
    r->mutable_usage()->set_dropped_tokens(e.usage.dropped_tokens);
    r->mutable_timings()->set_queue_seconds(e.timings.queue_s);
    r->mutable_timings()->set_time_to_first_token_seconds(e.timings.ttft_s);
    r->mutable_timings()->set_total_seconds(e.timings.total_s);
  }
}

void FillSession(const SessionInfo& i, pb::Session* s) {
  s->set_session_id(i.id);
  s->set_affinity_key(i.affinity_key);
  s->set_num_tokens(i.n_tokens);
  s->set_cached_tokens(i.n_cached_tokens);
  s->set_resident_bytes(i.resident_bytes);
  s->set_resident_blocks(i.resident_blocks);
  s->set_state(i.evicted ? "evicted" : "resident");
  s->set_busy(i.busy);
  s->set_ttl_seconds(i.ttl_s);
  s->set_priority(i.priority);
  s->set_created_unix(i.created_unix);
  s->set_last_used_unix(i.last_used_unix);
  for (int t : i.tokens) s->add_token_ids(t);
  s->mutable_overflow()->set_policy(i.overflow.policy == OverflowPolicy::kDropOldest
                                        ? pb::ContextOverflow::OVERFLOW_DROP_OLDEST
                                        : pb::ContextOverflow::OVERFLOW_ERROR);
  s->mutable_overflow()->set_keep_tokens(i.overflow.keep_tokens);
  s->set_dropped_tokens(i.dropped_tokens);
}

StatusOr<ContextOverflow> ToOverflow(const pb::ContextOverflow& o) {
  ContextOverflow c;
  switch (o.policy()) {
    case pb::ContextOverflow::POLICY_UNSPECIFIED: c.policy = OverflowPolicy::kUnspecified; break;
    case pb::ContextOverflow::OVERFLOW_ERROR: c.policy = OverflowPolicy::kError; break;
    case pb::ContextOverflow::OVERFLOW_DROP_OLDEST: c.policy = OverflowPolicy::kDropOldest; break;
    default: return InvalidArgument("overflow.policy " + std::to_string(o.policy()) + " is not a known policy");
  }
  c.keep_tokens = o.keep_tokens();  // the engine checks its range
  return c;
}

// Authenticates and converts a generation on the caller's thread (stateless checks, tokenization); the
// prompt tokens are kept for prompt logprobs. What the engine decides comes back through Engine::Submit's
// completion callback.
StatusOr<GenerateParams> PrepareRequest(InferenceService* svc, grpc::CallbackServerContext* ctx,
                                        const pb::GenerateRequest& req, std::vector<int>* prompt) {
  QKV_ASSIGN_OR_RETURN(std::string ns, svc->Authenticate(ctx));
  QKV_ASSIGN_OR_RETURN(GenerateParams params, svc->ToParams(req, ns));
  *prompt = params.prompt;
  return params;
}

// Generate and Complete reactors alive (created, not yet OnDone): a leak shows as a count that never
// returns to zero (qkvserve_grpc_live_reactors).
std::atomic<int64_t> g_live_reactors{0};

// One streaming Generate: engine events are pumped into gRPC writes, one write in flight at a time.
// The constructor never waits: the engine accepts or refuses the request in a callback on its thread
// (OnAccepted). The reactor is not finished before that callback has run, so it outlives it. The engine
// thread wakes the pump through the stream's listener; gRPC wakes it on write completion.
// Once Finish (or StartWriteAndFinish) is called, gRPC may run OnDone, which deletes the reactor, on
// another thread at once: every path decides under mu_, releases it, and only then finishes, touching
// nothing afterwards (TSan found the unlock of a mutex already deleted).
class GenerateReactor final : public grpc::ServerWriteReactor<pb::GenerateResponse> {
 public:
  GenerateReactor(InferenceService* svc, grpc::CallbackServerContext* ctx, const pb::GenerateRequest* req) {
    g_live_reactors.fetch_add(1);
    auto params = PrepareRequest(svc, ctx, *req, &prompt_);
    if (!params.ok()) {
      FinishNow(ToGrpc(params.status()));
      return;
    }
    HandOff(this);
    svc->engine().Submit(std::move(*params), [this](Engine::StreamOrError r) { OnAccepted(std::move(r)); });
  }

  void OnWriteDone(bool ok) override {
    Received(this);
    {
      std::unique_lock<std::mutex> l(mu_);
      writing_ = false;
      if (!ok) {  // the client went away
        if (stream_) stream_->Cancel();
        if (done_) return HandOff(this);
        done_ = true;
        l.unlock();
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
        return;
      }
    }
    Pump();
  }

  void OnCancel() override {  // client cancel, dropped stream or deadline
    Received(this);
    std::unique_lock<std::mutex> l(mu_);
    cancelled_ = true;
    if (!accepted_) return HandOff(this);  // OnAccepted finishes the call
    if (stream_) stream_->Cancel();
    if (done_ || writing_) return HandOff(this);
    done_ = true;
    l.unlock();
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }

  void OnDone() override {
    Received(this);
    if (stream_) {
      stream_->SetListener(nullptr);
      stream_->Cancel();  // no-op if it already ended
    }
    g_live_reactors.fetch_sub(1);
    delete this;
  }

 private:
  // gRPC's calls that hand the reactor over, each after HandOff (tsan_handoff.h).
  using Base = grpc::ServerWriteReactor<pb::GenerateResponse>;
  void Finish(grpc::Status s) {
    HandOff(this);
    Base::Finish(std::move(s));
  }
  void StartWrite(const pb::GenerateResponse* r) {
    HandOff(this);
    Base::StartWrite(r);
  }
  void StartWriteAndFinish(const pb::GenerateResponse* r, grpc::WriteOptions o, grpc::Status s) {
    HandOff(this);
    Base::StartWriteAndFinish(r, o, std::move(s));
  }
  void FinishNow(const grpc::Status& s) {  // in the constructor, before gRPC has the reactor
    done_ = true;
    Finish(s);
  }

  // On the engine thread: the request was queued (or refused). No event can have been pushed yet (pushes
  // happen on this thread, in later steps), so attaching the listener is enough; calling Pump here could
  // race with a cancel that finishes and deletes the reactor. SetListener under mu_ cannot deadlock: the
  // stream calls the listener (which takes mu_) without holding any of its own locks.
  void OnAccepted(Engine::StreamOrError r) {
    std::unique_lock<std::mutex> l(mu_);
    accepted_ = true;
    grpc::Status end;
    if (!r.ok()) {
      end = ToGrpc(r.status());
    } else {
      stream_ = *r;
      if (!cancelled_) {
        stream_->SetListener([this] { Pump(); });
        return;
      }
      stream_->Cancel();
      end = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    done_ = true;
    l.unlock();
    Finish(end);
  }

  // Runs on the engine thread (the stream's listener) or after a write (gRPC's thread). OnDone's
  // SetListener(nullptr) waits for a listener call to return, so the reactor outlives this call either way.
  void Pump() {
    std::unique_lock<std::mutex> l(mu_);
    if (writing_ || done_) return HandOff(this);
    StreamEvent e;
    if (!stream_->TryNext(&e)) return HandOff(this);
    resp_.Clear();
    if (first_) {
      resp_.set_request_id(stream_->request_id());
      first_ = false;
    }
    if (e.final && e.finish == FinishReason::kError) {
      done_ = true;
      l.unlock();
      Finish(ToGrpc(e.error));
      return;
    }
    AppendEvent(e, prompt_, &resp_);
    writing_ = true;  // resp_ stays untouched until OnWriteDone clears this
    if (!e.final) {
      StartWrite(&resp_);  // under mu_: a write cannot end the call, and it orders resp_'s serialization
      return;
    }
    done_ = true;
    l.unlock();
    StartWriteAndFinish(&resp_, grpc::WriteOptions(), grpc::Status::OK);
  }

  std::mutex mu_;
  std::shared_ptr<RequestStream> stream_;
  std::vector<int> prompt_;
  pb::GenerateResponse resp_;
  bool first_ = true;
  bool writing_ = false;
  bool done_ = false;
  bool accepted_ = false;
  bool cancelled_ = false;
};

// Unary Complete: collects the engine's events into one response.
class CompleteReactor final : public grpc::ServerUnaryReactor {
 public:
  CompleteReactor(InferenceService* svc, grpc::CallbackServerContext* ctx, const pb::GenerateRequest* req,
                  pb::CompleteResponse* resp)
      : resp_(resp) {
    g_live_reactors.fetch_add(1);
    auto params = PrepareRequest(svc, ctx, *req, &prompt_);
    if (!params.ok()) {
      finished_ = true;
      Finish(ToGrpc(params.status()));
      return;
    }
    HandOff(this);
    svc->engine().Submit(std::move(*params), [this](Engine::StreamOrError r) { OnAccepted(std::move(r)); });
  }
  void OnCancel() override {
    Received(this);
    std::lock_guard<std::mutex> l(mu_);
    cancelled_ = true;
    if (stream_) stream_->Cancel();  // the engine ends it; Drain finishes the call
    HandOff(this);
  }
  void OnDone() override {
    Received(this);
    if (stream_) {
      stream_->SetListener(nullptr);
      stream_->Cancel();
    }
    g_live_reactors.fetch_sub(1);
    delete this;
  }

 private:
  void Finish(grpc::Status s) {  // after HandOff (tsan_handoff.h)
    HandOff(this);
    grpc::ServerUnaryReactor::Finish(std::move(s));
  }
  // On the engine thread: the request was queued (or refused); until then the call is not finished.
  // As in GenerateReactor, no event exists yet, so attaching the listener is enough.
  // As in GenerateReactor, Finish comes last, after mu_ is released.
  void OnAccepted(Engine::StreamOrError r) {
    std::unique_lock<std::mutex> l(mu_);
    if (!r.ok()) {
      finished_ = true;
      l.unlock();
      Finish(ToGrpc(r.status()));
      return;
    }
    stream_ = *r;
    resp_->set_request_id(stream_->request_id());
    if (cancelled_) stream_->Cancel();
    stream_->SetListener([this] { Drain(); });
  }

  void Drain() {
    std::unique_lock<std::mutex> l(mu_);
    StreamEvent e;
    while (!finished_ && stream_->TryNext(&e)) {
      if (e.final && e.finish == FinishReason::kError) {
        finished_ = true;
        l.unlock();
        Finish(ToGrpc(e.error));
        return;
      }
      AppendEvent(e, prompt_, resp_);
      if (e.final) {
        finished_ = true;
        l.unlock();
        Finish(grpc::Status::OK);
        return;
      }
    }
  }
  std::mutex mu_;
  pb::CompleteResponse* resp_;
  std::shared_ptr<RequestStream> stream_;
  std::vector<int> prompt_;
  bool finished_ = false;
  bool cancelled_ = false;
};

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const grpc::Status& s) {
  auto* r = ctx->DefaultReactor();
  r->Finish(s);
  return r;
}

// The engine's answer to a session call finishes the call (on the engine thread; never blocks).
Engine::Done<StatusOr<SessionInfo>> SessionDone(grpc::ServerUnaryReactor* reactor, pb::Session* resp) {
  return [reactor, resp](StatusOr<SessionInfo> r) {
    if (r.ok()) FillSession(*r, resp);
    reactor->Finish(ToGrpc(r.status()));
  };
}

}  // namespace

int64_t LiveStreamReactors() { return g_live_reactors.load(); }

InferenceService::InferenceService(Engine& engine, ServiceOptions opt) : engine_(engine), opt_(std::move(opt)) {}

std::string InferenceService::NewId(const char* prefix) {
  return std::string(prefix) + "-" + opt_.instance_id + "-" + std::to_string(++counter_);
}

StatusOr<std::string> InferenceService::Authenticate(grpc::CallbackServerContext* ctx) const {
  if (opt_.api_keys.empty()) return std::string();
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return AuthenticateHeader(nullptr);
  return AuthenticateHeader(std::string(it->second.data(), it->second.size()).c_str());
}

StatusOr<std::string> InferenceService::AuthenticateHeader(const char* authorization) const {
  if (opt_.api_keys.empty()) return std::string();
  if (!authorization) return Status(StatusCode::kUnauthenticated, "missing 'authorization: Bearer <key>' metadata");
  const std::string v(authorization);
  const std::string prefix = "Bearer ";
  if (v.compare(0, prefix.size(), prefix) != 0) {
    return Status(StatusCode::kUnauthenticated, "authorization must be 'Bearer <key>'");
  }
  const std::string key = v.substr(prefix.size());
  if (!opt_.api_keys.count(key)) return Status(StatusCode::kUnauthenticated, "unknown API key");
  return key;
}

StatusOr<GenerateParams> InferenceService::ToParams(const pb::GenerateRequest& req, const std::string& ns) {
  if (draining_) return Status(StatusCode::kUnavailable, "the server is draining; retry on another replica");
  GenerateParams p;
  p.ns = ns;
  p.front = "grpc";
  const Tokenizer& tok = engine_.model().tokenizer();
  const RequestLimits& lim = opt_.limits;
  // Sizes first: nothing proportional to the input (tokenization, the engine's stop scans) runs before.
  QKV_RETURN_IF_ERROR(CheckStops(lim, req.stop(), req.stop_token_ids_size()));
  if (req.has_session_id()) QKV_RETURN_IF_ERROR(CheckId("session_id", req.session_id()));
  if (req.has_request_id()) QKV_RETURN_IF_ERROR(CheckId("request_id", req.request_id()));
  switch (req.input_case()) {
    case pb::GenerateRequest::kText:
      QKV_RETURN_IF_ERROR(CheckPromptBytes(lim, "text", static_cast<int64_t>(req.text().size())));
      if (req.text().empty()) return InvalidArgument("text is empty");
      if (!IsValidUtf8(req.text())) return InvalidArgument("text is not valid UTF-8");
      if (!req.has_session_id() && tok.add_bos() && tok.bos_id() >= 0) p.prompt.push_back(tok.bos_id());
      {
        const auto ids = tok.Encode(req.text(), req.parse_special());
        p.prompt.insert(p.prompt.end(), ids.begin(), ids.end());
      }
      break;
    case pb::GenerateRequest::kTokenIds:
      QKV_RETURN_IF_ERROR(CheckPromptTokens(lim, req.token_ids().ids_size(), engine_.model().max_context()));
      if (req.token_ids().ids().empty()) return InvalidArgument("token_ids is empty");
      for (int i = 0, vocab = engine_.model().config().vocab; i < req.token_ids().ids_size(); ++i) {
        const int id = req.token_ids().ids(i);
        if (id < 0 || id >= vocab) {
          return InvalidArgument("token_ids.ids[" + std::to_string(i) + "] = " + std::to_string(id) +
                                 " is outside the vocabulary (0.." + std::to_string(vocab - 1) + ")");
        }
      }
      p.prompt.assign(req.token_ids().ids().begin(), req.token_ids().ids().end());
      break;
    case pb::GenerateRequest::kMessages: {
      QKV_RETURN_IF_ERROR(CheckMessageCount(lim, req.messages().messages_size()));
      int64_t bytes = 0;
      for (const auto& m : req.messages().messages())
        bytes += static_cast<int64_t>(m.content().size() + m.role().size());
      QKV_RETURN_IF_ERROR(CheckPromptBytes(lim, "messages", bytes));
      std::vector<ChatMessageIn> msgs;
      for (int i = 0; i < req.messages().messages_size(); ++i) {
        const auto& m = req.messages().messages(i);
        if (!IsValidUtf8(m.content())) {
          return InvalidArgument("messages[" + std::to_string(i) + "].content is not valid UTF-8");
        }
        msgs.push_back({m.role(), m.content()});
      }
      QKV_ASSIGN_OR_RETURN(p.prompt,
                           ApplyChatTemplate(opt_.chat_template, tok, msgs, !req.has_session_id() && tok.add_bos()));
      p.from_messages = true;
      break;
    }
    default: return InvalidArgument("one of text, token_ids or messages is required");
  }
  QKV_RETURN_IF_ERROR(CheckPromptTokens(lim, static_cast<int64_t>(p.prompt.size()), engine_.model().max_context()));
  if (req.has_session_id()) {
    if (req.session_id().empty()) return InvalidArgument("session_id is empty");
    p.session_id = req.session_id();
  }
  p.request_id = req.has_request_id() ? req.request_id() : NewId("req");
  if (req.has_request_id() && req.request_id().empty()) return InvalidArgument("request_id is empty");
  p.priority = req.priority();
  QKV_ASSIGN_OR_RETURN(p.overflow, ToOverflow(req.overflow()));
  SamplingParams& s = p.sampling;
  if (req.has_temperature()) s.temperature = req.temperature();
  if (req.has_top_p()) s.top_p = req.top_p();
  if (req.has_top_k()) s.top_k = req.top_k();
  if (req.has_min_p()) s.min_p = req.min_p();
  if (req.has_repetition_penalty()) s.repetition_penalty = req.repetition_penalty();
  if (req.has_presence_penalty()) s.presence_penalty = req.presence_penalty();
  if (req.has_frequency_penalty()) s.frequency_penalty = req.frequency_penalty();
  if (req.has_seed()) s.seed = req.seed();
  if (req.has_max_tokens()) {
    if (req.max_tokens() < 1) return InvalidArgument("max_tokens must be at least 1");
    p.max_tokens = req.max_tokens();
  }
  for (const auto& stop : req.stop()) {
    if (stop.empty()) return InvalidArgument("stop strings must not be empty");
    if (!IsValidUtf8(stop)) return InvalidArgument("stop strings must be valid UTF-8");
    p.stop.push_back(stop);
  }
  p.stop_token_ids.assign(req.stop_token_ids().begin(), req.stop_token_ids().end());
  p.ignore_eos = req.ignore_eos();
  p.include_stop_str_in_output = req.include_stop_str_in_output();
  if (req.has_logprobs()) {
    p.want_logprobs = true;
    p.logprobs = req.logprobs();
  }
  p.prompt_logprobs = req.prompt_logprobs();
  return p;
}

grpc::ServerWriteReactor<pb::GenerateResponse>* InferenceService::Generate(grpc::CallbackServerContext* ctx,
                                                                           const pb::GenerateRequest* req) {
  return new GenerateReactor(this, ctx, req);
}

grpc::ServerUnaryReactor* InferenceService::Complete(grpc::CallbackServerContext* ctx, const pb::GenerateRequest* req,
                                                     pb::CompleteResponse* resp) {
  return new CompleteReactor(this, ctx, req, resp);
}

grpc::ServerUnaryReactor* InferenceService::Cancel(grpc::CallbackServerContext* ctx, const pb::CancelRequest* req,
                                                   pb::CancelResponse*) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  if (Status st = CheckId("request_id", req->request_id()); !st.ok()) return Done(ctx, ToGrpc(st));
  engine_.Cancel(*ns, req->request_id());
  return Done(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* InferenceService::CreateSession(grpc::CallbackServerContext* ctx,
                                                          const pb::CreateSessionRequest* req, pb::Session* resp) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  if (draining_) return Done(ctx, ToGrpc(Status(StatusCode::kUnavailable, "the server is draining")));
  const std::string id = req->has_session_id() ? req->session_id() : NewId("s");
  auto overflow = ToOverflow(req->overflow());
  if (!overflow.ok()) return Done(ctx, ToGrpc(overflow.status()));
  auto* reactor = ctx->DefaultReactor();
  engine_.CreateSession(*ns, id, req->ttl_seconds(), req->priority(),
                        std::vector<int>(req->initial_token_ids().begin(), req->initial_token_ids().end()), *overflow,
                        SessionDone(reactor, resp));
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::UpdateSession(grpc::CallbackServerContext* ctx,
                                                          const pb::UpdateSessionRequest* req, pb::Session* resp) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  if (Status st = CheckId("session_id", req->session_id()); !st.ok()) return Done(ctx, ToGrpc(st));
  auto overflow = ToOverflow(req->overflow());
  if (!overflow.ok()) return Done(ctx, ToGrpc(overflow.status()));
  auto* reactor = ctx->DefaultReactor();
  engine_.UpdateSession(*ns, req->session_id(), *overflow, SessionDone(reactor, resp));
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::GetSession(grpc::CallbackServerContext* ctx,
                                                       const pb::GetSessionRequest* req, pb::Session* resp) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  if (Status st = CheckId("session_id", req->session_id()); !st.ok()) return Done(ctx, ToGrpc(st));
  auto* reactor = ctx->DefaultReactor();
  engine_.GetSession(*ns, req->session_id(), req->include_token_ids(), SessionDone(reactor, resp));
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::ListSessions(grpc::CallbackServerContext* ctx,
                                                         const pb::ListSessionsRequest*,
                                                         pb::ListSessionsResponse* resp) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  auto* reactor = ctx->DefaultReactor();
  engine_.ListSessions(*ns, [reactor, resp](std::vector<SessionInfo> all) {
    for (const SessionInfo& i : all) FillSession(i, resp->add_sessions());
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::ForkSession(grpc::CallbackServerContext* ctx,
                                                        const pb::ForkSessionRequest* req, pb::Session* resp) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  if (Status st = CheckId("session_id", req->session_id()); !st.ok()) return Done(ctx, ToGrpc(st));
  const std::string child = req->has_child_session_id() ? req->child_session_id() : NewId("s");
  auto* reactor = ctx->DefaultReactor();
  engine_.ForkSession(*ns, req->session_id(), child, SessionDone(reactor, resp));
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::TruncateSession(grpc::CallbackServerContext* ctx,
                                                            const pb::TruncateSessionRequest* req, pb::Session* resp) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  if (Status st = CheckId("session_id", req->session_id()); !st.ok()) return Done(ctx, ToGrpc(st));
  auto* reactor = ctx->DefaultReactor();
  engine_.TruncateSession(*ns, req->session_id(), req->num_tokens(), SessionDone(reactor, resp));
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::CloseSession(grpc::CallbackServerContext* ctx,
                                                         const pb::CloseSessionRequest* req,
                                                         pb::CloseSessionResponse*) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  if (Status st = CheckId("session_id", req->session_id()); !st.ok()) return Done(ctx, ToGrpc(st));
  auto* reactor = ctx->DefaultReactor();
  engine_.CloseSession(*ns, req->session_id(), [reactor](Status st) { reactor->Finish(ToGrpc(st)); });
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::Tokenize(grpc::CallbackServerContext* ctx, const pb::TokenizeRequest* req,
                                                     pb::TokenizeResponse* resp) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  if (Status st = CheckPromptBytes(opt_.limits, "text", static_cast<int64_t>(req->text().size())); !st.ok()) {
    return Done(ctx, ToGrpc(st));
  }
  if (!IsValidUtf8(req->text())) return Done(ctx, ToGrpc(InvalidArgument("text is not valid UTF-8")));
  const Tokenizer& tok = engine_.model().tokenizer();
  if (req->add_special() && tok.add_bos() && tok.bos_id() >= 0) resp->add_token_ids(tok.bos_id());
  for (int t : tok.Encode(req->text(), req->parse_special())) resp->add_token_ids(t);
  return Done(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* InferenceService::Detokenize(grpc::CallbackServerContext* ctx,
                                                       const pb::DetokenizeRequest* req, pb::DetokenizeResponse* resp) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  const Tokenizer& tok = engine_.model().tokenizer();
  std::vector<int> ids(req->token_ids().begin(), req->token_ids().end());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= tok.vocab_size()) {
      return Done(ctx, ToGrpc(InvalidArgument("token_ids[" + std::to_string(i) + "] is outside the vocabulary")));
    }
  }
  TextStream ts;  // invalid UTF-8 from arbitrary ids becomes U+FFFD: protobuf strings must be UTF-8
  std::string text = ts.Push(tok.Decode(ids));
  text += ts.Finish();
  resp->set_text(text);
  return Done(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* InferenceService::GetModelInfo(grpc::CallbackServerContext* ctx,
                                                         const pb::GetModelInfoRequest*, pb::ModelInfo* resp) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  const Model& m = engine_.model();
  const ModelConfig& c = m.config();
  resp->set_architecture(ArchName(c.arch));
  resp->set_name(opt_.model_name);
  resp->set_hidden_size(c.hidden);
  resp->set_num_layers(c.n_layers);
  resp->set_num_heads(c.n_heads);
  resp->set_num_kv_heads(c.n_kv_heads);
  resp->set_head_dim(c.head_dim);
  resp->set_rotary_dim(c.rotary_dim);
  resp->set_intermediate_size(c.ffn);
  resp->set_vocab_size(c.vocab);
  resp->set_attention(c.AttentionKind());
  if (c.is_mla()) {
    resp->set_kv_lora_rank(c.mla.kv_lora_rank);
    resp->set_q_lora_rank(c.mla.q_lora_rank);
    resp->set_qk_nope_head_dim(c.mla.qk_nope_dim);
    resp->set_qk_rope_head_dim(c.rotary_dim);
    resp->set_v_head_dim(c.mla.v_head_dim);
  }
  resp->set_num_parameters(c.ParameterCount());
  resp->set_active_parameters(c.ActiveParameterCount());
  resp->set_weight_bytes_per_token(static_cast<int64_t>(m.weight_bytes_per_token()));
  resp->set_num_experts(c.moe.n_experts);
  resp->set_experts_per_token(c.moe.n_used);
  if (!c.rope_freq_factors.empty()) {  // Llama 3.1's scaling, in the file as per-pair divisors (rope_freqs.weight)
    resp->set_rope_scaling("llama3");
    resp->set_rope_scaling_factor(*std::max_element(c.rope_freq_factors.begin(), c.rope_freq_factors.end()));
  } else {
    resp->set_rope_scaling(RopeScalingName(c.rope_scaling));
    resp->set_rope_scaling_factor(c.rope_factor);
  }
  resp->set_rope_original_context(c.rope_scaling == RopeScaling::kNone ? 0 : c.Rope().orig_ctx);
  resp->set_kv_bytes_per_token(m.cache_layout().tokens.bytes_per_token());
  resp->set_linear_attention_layers(c.n_layers - c.n_attention_layers());
  resp->set_state_bytes_per_sequence(m.cache_layout().state_bytes_per_seq);
  resp->set_state_slots(m.cache_layout().state_slots);
  resp->set_state_snapshot_slots(m.cache_layout().snapshot_slots);
  resp->set_context_length(m.max_context());
  const EngineStats s = engine_.Stats();
  resp->set_kv_cache_tokens(s.tokens_capacity);
  resp->set_kv_cache_bytes(m.cache_layout().token_bytes());
  resp->set_block_size(s.block_size);
  resp->set_weights_dtype(m.weights_summary());
  resp->set_kv_dtype(DTypeName(m.options().kv_dtype));
  resp->set_cpu_isa(GemmRuntime::CpuIsa());
  resp->set_kernel_isa(KernelIsaName(ActiveKernelIsa()));
  resp->set_compute_dtype(DTypeName(m.compute_dtype()));
  resp->set_gemm(m.gemm().Summary());
  resp->set_instance_id(opt_.instance_id);
  resp->set_eos_token_id(m.tokenizer().eos_id());
  for (int id : m.tokenizer().eog_ids()) resp->add_eog_token_ids(id);
  resp->set_bos_token_id(m.tokenizer().bos_id());
  resp->set_chat_template(ChatTemplateName(opt_.chat_template));
  for (const std::string& st : opt_.chat_stop) resp->add_chat_stop(st);
  return Done(ctx, grpc::Status::OK);
}

}  // namespace qkv::server

namespace qkv::server {

grpc::ServerUnaryReactor* InferenceService::GetStats(grpc::CallbackServerContext* ctx, const pb::GetStatsRequest* req,
                                                     pb::Stats* r) {
  auto ns = Authenticate(ctx);
  if (!ns.ok()) return Done(ctx, ToGrpc(ns.status()));
  const EngineStats s = engine_.Stats();
  const MemoryBreakdown mem = MeasureMemory(engine_.model());
  r->set_kv_blocks_used(s.blocks_used);
  r->set_kv_blocks_cached(s.blocks_cached);
  r->set_kv_blocks_free(s.blocks_free);
  r->set_kv_blocks_total(s.blocks_total);
  r->set_kv_tokens_capacity(s.tokens_capacity);
  r->set_kv_tokens_used(s.tokens_used);
  r->set_kv_bytes_capacity(s.tokens_capacity * s.kv_bytes_per_token);
  r->set_kv_bytes_used(s.tokens_used * s.kv_bytes_per_token);
  r->set_kv_cache_usage_ratio(s.blocks_total ? static_cast<double>(s.blocks_used) / static_cast<double>(s.blocks_total)
                                             : 0.0);
  r->set_kv_cache_slack_tokens(s.slack_tokens);
  r->set_kv_bytes_per_token(s.kv_bytes_per_token);
  r->set_kv_block_size_tokens(s.block_size);
  r->set_prefix_cache_queries_tokens_total(s.prefix_queries_tokens);
  r->set_prefix_cache_hits_tokens_total(s.prefix_hits_tokens);
  r->set_sessions_resident(s.sessions_resident);
  r->set_sessions_evicted(s.sessions_evicted);
  r->set_session_kv_bytes(s.session_kv_bytes);
  r->set_session_evictions_memory_total(s.session_evictions_memory);
  r->set_session_evictions_ttl_total(s.session_evictions_ttl);
  r->set_session_evictions_closed_total(s.session_evictions_closed);
  r->set_preemptions_total(s.preemptions);
  r->set_requests_running(s.requests_running);
  r->set_requests_waiting(s.requests_waiting);
  r->set_requests_finished_stop_total(s.finished_stop);
  r->set_requests_finished_length_total(s.finished_length);
  r->set_requests_finished_cancelled_total(s.finished_cancelled);
  r->set_requests_finished_error_total(s.finished_error);
  r->set_prompt_tokens_total(s.prompt_tokens);
  r->set_cached_prompt_tokens_total(s.cached_prompt_tokens);
  r->set_generated_tokens_total(s.generated_tokens);
  r->set_memory_weights_bytes(mem.weights);
  r->set_memory_kv_arena_bytes(mem.kv_arena);
  r->set_memory_scratch_bytes(mem.scratch);
  r->set_memory_heap_bytes(mem.heap);
  r->set_memory_other_bytes(mem.other);
  r->set_resident_memory_bytes(mem.rss);
  r->set_memory_state_bytes(mem.state);
  r->set_state_slots_used(s.state_slots_used);
  r->set_state_slots_free(s.state_slots_free);
  const size_t top = req->top_sessions() > 0 ? static_cast<size_t>(req->top_sessions()) : 10;
  auto* reactor = ctx->DefaultReactor();
  engine_.ListSessions(*ns, [reactor, r, top](std::vector<SessionInfo> mine) {
    const size_t n = std::min(top, mine.size());
    std::partial_sort(mine.begin(), mine.begin() + static_cast<std::ptrdiff_t>(n), mine.end(),
                      [](const auto& a, const auto& b) { return a.resident_bytes > b.resident_bytes; });
    for (size_t i = 0; i < n; ++i) {
      auto* u = r->add_top_sessions();
      u->set_session_id(mine[i].id);
      u->set_resident_bytes(mine[i].resident_bytes);
      u->set_resident_blocks(mine[i].resident_blocks);
      u->set_num_tokens(mine[i].n_tokens);
      u->set_state(mine[i].evicted ? "evicted" : "resident");
    }
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

}  // namespace qkv::server
