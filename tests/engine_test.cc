#include "engine/engine.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <random>
#include <thread>
#include <tuple>

#include "tests/test_util.h"

namespace qkv {
namespace {

struct Result {
  std::vector<int> tokens;
  std::vector<float> logprobs, prompt_logprobs;
  std::string text;
  StreamEvent final;
};

Result Drain(const std::shared_ptr<RequestStream>& s) {
  Result r;
  StreamEvent e;
  for (;;) {
    EXPECT_TRUE(s->Next(&e, std::chrono::seconds(60))) << "stream stalled";
    r.tokens.insert(r.tokens.end(), e.token_ids.begin(), e.token_ids.end());
    for (const auto& lp : e.logprobs) r.logprobs.push_back(lp.logprob);
    r.prompt_logprobs.insert(r.prompt_logprobs.end(), e.prompt_logprobs.begin(), e.prompt_logprobs.end());
    r.text += e.text;
    if (e.final) {
      r.final = e;
      return r;
    }
  }
}

// Every engine test runs on a bf16 and on an int8 KV cache, with grouped-query attention (qwen3), with
// MLA (deepseek2, a latent cache) and with a mixture of experts (qwen3moe): sessions, prefix caching, fork
// with copy-on-write, truncation, eviction and preemption must behave the same on all of them.
class EngineTest : public ::testing::TestWithParam<std::tuple<Arch, DType>> {
 protected:
  void Start(int64_t kv_blocks = 256, int max_batched = 64, int block_size = 16, bool prefix = true,
             int state_slots = 0, int max_logit_rows = 0) {
    cfg_ = testing::SmallConfig(std::get<0>(GetParam()));
    const std::string path = testing::WriteModel(cfg_, std::string("engine_model_") + ArchName(cfg_.arch), 5);
    ModelOptions mo;
    mo.n_threads = 2;
    mo.max_batch_tokens = 64;
    mo.kv_blocks = kv_blocks;
    mo.block_size = block_size;
    mo.kv_dtype = std::get<1>(GetParam());
    mo.state_slots = state_slots;
    mo.max_logit_rows = max_logit_rows;
    auto m = Model::Load(path, mo);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
    EngineOptions eo;
    eo.max_num_batched_tokens = max_batched;
    eo.max_num_seqs = 16;
    eo.prefix_caching = prefix;
    auto e = Engine::Create(*model_, eo);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    engine_ = std::move(*e);
  }
  void TearDown() override {
    engine_.reset();
    model_.reset();
  }
  GenerateParams Greedy(std::vector<int> prompt, int max_tokens, std::string session = "") {
    GenerateParams p;
    p.prompt = std::move(prompt);
    p.max_tokens = max_tokens;
    p.sampling.temperature = 0;
    p.ignore_eos = true;
    p.want_logprobs = true;
    p.session_id = std::move(session);
    return p;
  }
  Result Run(GenerateParams p) {
    auto s = engine_->Submit(std::move(p));
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? Drain(*s) : Result{};
  }
  // Stats() is a snapshot the engine publishes at a rate limit that grows on a loaded machine; a test reads
  // it through the engine thread, which publishes it first (bare Stats() reads made tests flaky under
  // ctest -j2: a stale snapshot from before the eviction or copy being checked).
  EngineStats CurrentStats() {
    engine_->RunOnEngineThread([] {});
    return engine_->Stats();
  }
  // A cancel races its turn: a small model decodes 100-150 tokens in milliseconds, so a test thread descheduled
  // between the turn's first event and the cancel (ctest -j2 on 2 cores) sees the turn end first. Such a run is
  // not the case under test: `scenario` runs again on a new session (prefix0, prefix1, ...) until `won` says
  // the cancel came first, 5 times at most, or until it fails. Returns the last session's id.
  std::string UntilTheCancelWins(const std::string& prefix, const std::function<void(const std::string&)>& scenario,
                                 const std::function<bool()>& won) {
    std::string sid;
    for (int attempt = 0; attempt < 5; ++attempt) {
      sid = prefix + std::to_string(attempt);
      scenario(sid);
      if (::testing::Test::HasFatalFailure() || won()) break;
    }
    return sid;
  }
  std::vector<int> Prompt(int n, int salt) {
    std::vector<int> t;
    for (int i = 0; i < n; ++i) t.push_back((i * 31 + salt * 17 + 3) % cfg_.vocab);
    return t;
  }

  ModelConfig cfg_;
  std::unique_ptr<Model> model_;
  // Whether the model's layers keep per-sequence state (Gated DeltaNet), which a context cut short loses.
  bool keeps_state() const { return cfg_.StateBytesPerSeq() > 0; }
  std::unique_ptr<Engine> engine_;
};

// A request's greedy tokens and logprobs are bit-identical alone and with 1-15 other requests of
// different lengths, with chunked prefill (64-token budget) and with prefix-cache hits.
TEST_P(EngineTest, BatchInvariance) {
  Start();
  const std::vector<int> target = Prompt(70, 1);
  const Result alone = Run(Greedy(target, 24));
  ASSERT_EQ(alone.tokens.size(), 24u);
  for (int others : {1, 3, 7, 15}) {
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (int k = 0; k < others; ++k) {
      std::vector<int> p = Prompt(5 + 13 * k % 90, 100 + k);
      if (k % 3 == 0) p.insert(p.begin(), target.begin(), target.begin() + 32);  // shares cached prefix blocks
      auto s = engine_->Submit(Greedy(p, 8 + k));
      ASSERT_TRUE(s.ok());
      streams.push_back(*s);
    }
    auto mine = engine_->Submit(Greedy(target, 24));
    ASSERT_TRUE(mine.ok());
    const Result together = Drain(*mine);
    for (auto& s : streams) Drain(s);
    EXPECT_EQ(together.tokens, alone.tokens) << others << " others";
    ASSERT_EQ(together.logprobs.size(), alone.logprobs.size());
    EXPECT_EQ(0, std::memcmp(together.logprobs.data(), alone.logprobs.data(), alone.logprobs.size() * sizeof(float)))
        << others << " others";
    // (a hybrid model: through the state snapshot the first run took at its last block boundary)
    EXPECT_GT(together.final.usage.cached_tokens, 0) << "the second run should hit the prefix cache";
  }
  EXPECT_EQ(engine_->CheckConsistency(), "");
  EXPECT_GT(CurrentStats().prefix_hits_tokens, 0u);
  if (keeps_state()) {
    EXPECT_GT(CurrentStats().state_snapshots, 0);
  }
}

// A session's TTL must leave now + ttl representable: infinite, NaN, negative and absurd values are refused
// (found by the API fuzzer under UBSan: ttl_seconds = inf overflowed the deadline's conversion).
TEST_P(EngineTest, SessionTtlIsBounded) {
  Start();
  for (double ttl : {std::numeric_limits<double>::infinity(), std::nan(""), -1.0, 1e30, 3.2e8}) {
    auto r = engine_->CreateSession("", "t", ttl, 0, {});
    ASSERT_FALSE(r.ok()) << ttl;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("ttl_seconds"), std::string::npos);
  }
  EXPECT_TRUE(engine_->CreateSession("", "t", 315360000.0, 0, {}).ok());
  EXPECT_TRUE(engine_->CreateSession("", "u", 0.5, 0, {}).ok());
}

// A three-turn session produces the same tokens as sending the full history fresh each turn, reuses its
// KV (cached_tokens), and accounts prompt tokens as the whole context.
TEST_P(EngineTest, SessionEquivalenceAndAccounting) {
  Start(256, 64, 16, /*prefix=*/false);  // prefix caching off: reuse must come from the session itself
  ASSERT_TRUE(engine_->CreateSession("", "chat", 0, 0, {}).ok());
  std::vector<int> history;
  for (int turn = 0; turn < 3; ++turn) {
    const std::vector<int> prompt = Prompt(20 + turn * 7, turn);
    const Result s = Run(Greedy(prompt, 12, "chat"));
    std::vector<int> full = history;
    full.insert(full.end(), prompt.begin(), prompt.end());
    const Result fresh = Run(Greedy(full, 12));
    EXPECT_EQ(s.tokens, fresh.tokens) << "turn " << turn;
    EXPECT_EQ(s.final.usage.prompt_tokens, static_cast<int>(full.size()));
    if (turn == 0)
      EXPECT_EQ(s.final.usage.cached_tokens, 0);
    else
      EXPECT_EQ(s.final.usage.cached_tokens, static_cast<int>(history.size()) - 1);  // all but the last sampled token
    history = full;
    history.insert(history.end(), s.tokens.begin(), s.tokens.end());
    auto info = engine_->GetSession("", "chat", true);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->tokens, history);
  }
  EXPECT_EQ(engine_->CheckConsistency(), "");
  ASSERT_TRUE(engine_->CloseSession("", "chat").ok());
  EXPECT_EQ(CurrentStats().blocks_used, 0);
}

TEST_P(EngineTest, CancelledTurnLeavesTheSessionAsItWas) {
  Start();
  StatusOr<SessionInfo> before = InvalidArgument("unset");
  Result r;
  StatusCode busy_code = StatusCode::kOk;
  const std::string sid = UntilTheCancelWins(
      "s",
      [&](const std::string& id) {
        ASSERT_TRUE(engine_->CreateSession("", id, 0, 0, {}).ok());
        Run(Greedy(Prompt(30, 1), 5, id));
        before = engine_->GetSession("", id, true);
        ASSERT_TRUE(before.ok());
        auto st = engine_->Submit(Greedy(Prompt(40, 2), 150, id));
        ASSERT_TRUE(st.ok());
        StreamEvent e;
        ASSERT_TRUE((*st)->Next(&e, std::chrono::seconds(30)));  // running
        auto busy = engine_->Submit(Greedy(Prompt(3, 3), 2, id));
        busy_code = busy.status().code();
        engine_->Cancel("", (*st)->request_id());
        r = Drain(*st);
        if (busy.ok()) Drain(*busy);
      },
      [&] { return busy_code != StatusCode::kOk && r.final.finish == FinishReason::kCancelled; });
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(busy_code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.final.finish, FinishReason::kCancelled);
  auto after = engine_->GetSession("", sid, true);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->tokens, before->tokens);
  // Positions the turn computed for history tokens stay valid (same bits as before), so KV can only grow;
  // state summarizes every token the turn computed, so a model that keeps state recomputes the session.
  if (keeps_state()) {
    EXPECT_EQ(after->n_cached_tokens, 0);
  } else {
    EXPECT_GE(after->n_cached_tokens, before->n_cached_tokens);
  }
  EXPECT_LE(after->n_cached_tokens, after->n_tokens);
  // The next turn behaves as if the cancelled one never happened.
  std::vector<int> full = before->tokens;
  const std::vector<int> p = Prompt(9, 4);
  full.insert(full.end(), p.begin(), p.end());
  EXPECT_EQ(Run(Greedy(p, 6, sid)).tokens, Run(Greedy(full, 6)).tokens);
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

TEST_P(EngineTest, ForkSharesBlocksCopyOnWrite) {
  Start();
  ASSERT_TRUE(engine_->CreateSession("", "p", 0, 0, {}).ok());
  Run(Greedy(Prompt(37, 1), 4, "p"));  // 41 tokens: the last block is partial and will be shared
  auto fork = engine_->ForkSession("", "p", "c");
  ASSERT_TRUE(fork.ok());
  EXPECT_EQ(fork->affinity_key, "p");
  auto parent = engine_->GetSession("", "p", true);
  const int64_t used_before = CurrentStats().blocks_used;
  const Result a = Run(Greedy(Prompt(5, 2), 6, "c"));
  const Result b = Run(Greedy(Prompt(5, 3), 6, "p"));
  std::vector<int> fa = parent->tokens, fb = parent->tokens;
  auto pa = Prompt(5, 2), pb = Prompt(5, 3);
  fa.insert(fa.end(), pa.begin(), pa.end());
  fb.insert(fb.end(), pb.begin(), pb.end());
  EXPECT_EQ(a.tokens, Run(Greedy(fa, 6)).tokens);
  EXPECT_EQ(b.tokens, Run(Greedy(fb, 6)).tokens);
  EXPECT_GT(CurrentStats().blocks_used, used_before);  // the partial block was copied, not shared for writing
  EXPECT_EQ(engine_->CheckConsistency(), "");
  ASSERT_TRUE(engine_->CloseSession("", "c").ok());
  ASSERT_TRUE(engine_->CloseSession("", "p").ok());
  EXPECT_EQ(CurrentStats().blocks_used, 0);
}

// Truncating a session and continuing gives what a fresh request over the kept history gives.
TEST_P(EngineTest, TruncatedSessionContinuesAsFresh) {
  Start();
  ASSERT_TRUE(engine_->CreateSession("", "t", 0, 0, {}).ok());
  Run(Greedy(Prompt(45, 1), 6, "t"));
  Run(Greedy(Prompt(12, 2), 6, "t"));
  auto before = engine_->GetSession("", "t", true);
  ASSERT_TRUE(before.ok());
  for (int keep : {50, 33, 16}) {  // inside a block, and at a block boundary
    ASSERT_TRUE(engine_->TruncateSession("", "t", keep).ok());
    std::vector<int> full(before->tokens.begin(), before->tokens.begin() + keep);
    const std::vector<int> p = Prompt(7, keep);
    full.insert(full.end(), p.begin(), p.end());
    EXPECT_EQ(Run(Greedy(p, 6, "t")).tokens, Run(Greedy(full, 6)).tokens) << "keep " << keep;
    ASSERT_TRUE(engine_->TruncateSession("", "t", keep).ok());  // back to the kept history
  }
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// drop_oldest: a session keeps going past its context. Each turn drops whole blocks of the oldest history
// after the kept prefix, reports them in usage and on the session, and answers exactly what a fresh request
// over the shortened history answers; the kept prefix never changes.
TEST_P(EngineTest, DropOldestKeepsThePrefixAndAnswersAsFresh) {
  Start();
  const int B = 16, keep = 10;
  ASSERT_TRUE(engine_->CreateSession("", "d", 0, 0, Prompt(keep, 9), {OverflowPolicy::kDropOldest, keep}).ok());
  const std::vector<int> prefix = Prompt(keep, 9);
  int64_t dropped_total = 0;
  int turns_that_dropped = 0;
  for (int turn = 0; turn < 14; ++turn) {
    auto before = engine_->GetSession("", "d", true);
    ASSERT_TRUE(before.ok());
    const std::vector<int> p = Prompt(30 + turn % 3, turn);
    const Result r = Run(Greedy(p, 20, "d"));
    ASSERT_EQ(r.final.finish, FinishReason::kLength) << "turn " << turn << ": " << r.final.error.ToString();
    const int d = r.final.usage.dropped_tokens;
    const int n = static_cast<int>(before->tokens.size());
    if (d > 0) {
      ++turns_that_dropped;
      EXPECT_TRUE(d % B == 0 || d == n - keep) << d;
      EXPECT_LE(n - d + static_cast<int>(p.size()) + 20, cfg_.context_length);
    } else {
      EXPECT_LE(n + static_cast<int>(p.size()) + 20, cfg_.context_length);
    }
    std::vector<int> full(before->tokens.begin(), before->tokens.begin() + keep);
    full.insert(full.end(), before->tokens.begin() + keep + d, before->tokens.end());
    full.insert(full.end(), p.begin(), p.end());
    EXPECT_EQ(r.final.usage.prompt_tokens, static_cast<int>(full.size()));
    EXPECT_EQ(r.tokens, Run(Greedy(full, 20)).tokens) << "turn " << turn;
    dropped_total += d;
    auto after = engine_->GetSession("", "d", true);
    ASSERT_TRUE(after.ok());
    EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), after->tokens.begin()));
    EXPECT_EQ(after->dropped_tokens, dropped_total);
    EXPECT_EQ(after->overflow.policy, OverflowPolicy::kDropOldest);
  }
  EXPECT_GE(turns_that_dropped, 4);
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// A chat (turns fed by messages) drops whole turns: what remains after the kept prefix starts with the
// prompt of an earlier turn; a truncation forgets the turns it cut.
TEST_P(EngineTest, DropOldestDropsWholeTurnsOfAChat) {
  Start();
  const int keep = 6;
  ASSERT_TRUE(engine_->CreateSession("", "m", 0, 0, Prompt(keep, 9), {OverflowPolicy::kDropOldest, keep}).ok());
  std::vector<std::vector<int>> prompts;
  int drops = 0;
  for (int turn = 0; turn < 12; ++turn) {
    auto before = engine_->GetSession("", "m", true);
    ASSERT_TRUE(before.ok());
    prompts.push_back(Prompt(20 + 7 * (turn % 4), 40 + turn));
    GenerateParams p = Greedy(prompts.back(), 24, "m");
    p.from_messages = true;
    const Result r = Run(p);
    ASSERT_EQ(r.final.finish, FinishReason::kLength);
    const int d = r.final.usage.dropped_tokens;
    if (d == 0) continue;
    ++drops;
    const auto at = before->tokens.begin() + keep + d;
    bool on_a_turn = false;
    for (const auto& q : prompts)
      on_a_turn |= before->tokens.end() - at >= static_cast<long>(q.size()) && std::equal(q.begin(), q.end(), at);
    EXPECT_TRUE(on_a_turn) << "turn " << turn << " dropped " << d << " tokens, not up to a turn's start";
    std::vector<int> full(before->tokens.begin(), before->tokens.begin() + keep);
    full.insert(full.end(), at, before->tokens.end());
    full.insert(full.end(), prompts.back().begin(), prompts.back().end());
    EXPECT_EQ(r.tokens, Run(Greedy(full, 24)).tokens) << "turn " << turn;
  }
  EXPECT_GE(drops, 3);
  ASSERT_TRUE(engine_->TruncateSession("", "m", keep + 3).ok());  // inside a turn: the rest is forgotten
  GenerateParams p = Greedy(Prompt(210, 77), 40, "m");
  p.from_messages = true;
  const Result r = Run(p);                     // 9 + 210 + 40 = 259 > 256: no turn boundary left, so a block, capped
  EXPECT_EQ(r.final.usage.dropped_tokens, 3);  // all that may go (keep 6 of 9)
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// The policy: error by default (the message points at drop_oldest), per request, changeable, validated.
TEST_P(EngineTest, OverflowPolicyPerSessionAndPerRequest) {
  Start();
  ASSERT_TRUE(engine_->CreateSession("", "e", 0, 0, Prompt(200, 1)).ok());
  auto over = engine_->Submit(Greedy(Prompt(40, 2), 20, "e"));
  ASSERT_EQ(over.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(over.status().message().find("drop_oldest"), std::string::npos) << over.status().message();
  GenerateParams one = Greedy(Prompt(40, 2), 20, "e");  // this request only
  one.overflow = {OverflowPolicy::kDropOldest, 0};
  const Result r = Run(one);
  EXPECT_EQ(r.final.usage.dropped_tokens, 16);  // 200 + 40 + 20 - 256 = 4 over: one whole block
  EXPECT_EQ(engine_->GetSession("", "e", false)->overflow.policy, OverflowPolicy::kError);
  auto up = engine_->UpdateSession("", "e", {OverflowPolicy::kDropOldest, 5});
  ASSERT_TRUE(up.ok());
  EXPECT_EQ(up->overflow.keep_tokens, 5);
  EXPECT_EQ(Run(Greedy(Prompt(40, 3), 20, "e")).final.finish, FinishReason::kLength);
  // No max_tokens: the default (256, the whole context here) is capped by what fits beside keep + prompt.
  const Result dflt = Run(Greedy(Prompt(40, 5), -1, "e"));
  EXPECT_EQ(dflt.final.finish, FinishReason::kLength);
  EXPECT_EQ(dflt.final.usage.completion_tokens, 256 - 5 - 40);
  // Validation: keep + prompt + max_tokens must fit; drop_oldest needs a session; keep_tokens >= 0.
  ASSERT_TRUE(engine_->UpdateSession("", "e", {OverflowPolicy::kDropOldest, 230}).ok());
  auto big = engine_->Submit(Greedy(Prompt(20, 4), 20, "e"));
  EXPECT_EQ(big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(big.status().message().find("overflow.keep_tokens"), std::string::npos) << big.status().message();
  GenerateParams stateless = Greedy(Prompt(20, 4), 4);
  stateless.overflow = {OverflowPolicy::kDropOldest, 0};
  EXPECT_EQ(engine_->Submit(stateless).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->UpdateSession("", "e", {OverflowPolicy::kDropOldest, -1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->UpdateSession("", "nope", {}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// A request that resends the conversation (prompt_is_context, the HTTP front's x-session-id) and is refused
// leaves nothing behind: no session created for an unknown id, no history cut on a known one.
TEST_P(EngineTest, RefusedContextRequestLeavesSessionsAsTheyWere) {
  Start();
  GenerateParams fresh = Greedy(Prompt(40, 2), 1000, "fresh");  // 40 + 1000 > 256: refused
  fresh.prompt_is_context = true;
  fresh.create_ttl_s = 60;
  EXPECT_EQ(engine_->Submit(fresh).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->GetSession("", "fresh", false).status().code(), StatusCode::kNotFound);
  fresh.max_tokens = 4;  // the same request within the context creates it
  EXPECT_EQ(Run(fresh).final.finish, FinishReason::kLength);
  EXPECT_EQ(engine_->GetSession("", "fresh", false)->n_tokens, 44);

  const std::vector<int> history = Prompt(100, 1);
  ASSERT_TRUE(engine_->CreateSession("", "h", 0, 0, history).ok());
  std::vector<int> diverging(history.begin(), history.begin() + 50);
  const std::vector<int> other = Prompt(30, 7);
  diverging.insert(diverging.end(), other.begin(), other.end());
  GenerateParams cut = Greedy(diverging, 500, "h");  // 80 + 500 > 256: refused
  cut.prompt_is_context = true;
  EXPECT_EQ(engine_->Submit(cut).status().code(), StatusCode::kInvalidArgument);
  auto after = engine_->GetSession("", "h", true);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->tokens, history);
  cut.max_tokens = 4;  // accepted: now the history is cut to the 50 shared tokens
  EXPECT_EQ(Run(cut).final.finish, FinishReason::kLength);
  EXPECT_EQ(engine_->GetSession("", "h", false)->n_tokens, 84);
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// A turn that dropped history and was then cancelled leaves the session's history and count as they were.
TEST_P(EngineTest, CancelledTurnRestoresDroppedHistory) {
  Start();
  StatusOr<SessionInfo> before = InvalidArgument("unset");
  Result r;
  const std::string sid = UntilTheCancelWins(
      "c",
      [&](const std::string& id) {
        ASSERT_TRUE(engine_->CreateSession("", id, 0, 0, Prompt(100, 1), {OverflowPolicy::kDropOldest, 8}).ok());
        Run(Greedy(Prompt(60, 2), 8, id));  // 169 tokens of history, with K/V
        before = engine_->GetSession("", id, true);
        ASSERT_TRUE(before.ok());
        auto st = engine_->Submit(Greedy(Prompt(40, 3), 100, id));  // drops 64
        ASSERT_TRUE(st.ok());
        StreamEvent e;
        ASSERT_TRUE((*st)->Next(&e, std::chrono::seconds(30)));
        engine_->Cancel("", (*st)->request_id());
        r = Drain(*st);
      },
      [&] { return r.final.finish == FinishReason::kCancelled; });
  ASSERT_TRUE(before.ok());
  ASSERT_EQ(r.final.finish, FinishReason::kCancelled);
  auto after = engine_->GetSession("", sid, true);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->tokens, before->tokens);
  EXPECT_EQ(after->dropped_tokens, 0);
  // The next turn answers as a fresh request over the restored history.
  const std::vector<int> p = Prompt(5, 4);
  auto now = engine_->GetSession("", sid, true);
  std::vector<int> full = now->tokens;
  full.insert(full.end(), p.begin(), p.end());
  EXPECT_EQ(Run(Greedy(p, 6, sid)).tokens, Run(Greedy(full, 6)).tokens);
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// With few state slots (a hybrid model), idle sessions' caches are evicted to admit new sequences, and an
// evicted session's next turn recomputes its history and answers as a fresh request would. Without state
// slots (other models) the same traffic simply runs.
TEST_P(EngineTest, StateSlotsEvictIdleSessions) {
  Start(256, 64, 16, true, /*state_slots=*/2);
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(engine_->CreateSession("", "s" + std::to_string(k), 0, 0, {}).ok());
    Run(Greedy(Prompt(20 + k, k), 4, "s" + std::to_string(k)));
  }
  for (int k = 0; k < 3; ++k) {
    const std::string sid = "s" + std::to_string(k);
    auto before = engine_->GetSession("", sid, true);
    ASSERT_TRUE(before.ok());
    std::vector<int> full = before->tokens;
    const std::vector<int> p = Prompt(6, 10 + k);
    full.insert(full.end(), p.begin(), p.end());
    EXPECT_EQ(Run(Greedy(p, 5, sid)).tokens, Run(Greedy(full, 5)).tokens) << sid;
  }
  const EngineStats st = CurrentStats();
  if (keeps_state()) {
    EXPECT_EQ(st.state_slots_used + st.state_slots_free, 2);
    EXPECT_LE(st.state_slots_used, 2);
    EXPECT_GT(st.session_evictions_memory, 0u);
  } else {
    EXPECT_EQ(st.state_slots_used + st.state_slots_free, 0);
  }
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// A shared system prompt followed by different questions: an attention model reuses its blocks from the
// second request on; a hybrid model reuses them once a state snapshot exists where the prompts part (the
// second request, finding the blocks without one, leaves it), from the third on. Outputs equal a request
// computed without the prefix cache.
TEST_P(EngineTest, SharedPrefixIsReusedThroughASnapshot) {
  Start();
  const std::vector<int> sys = Prompt(48, 7);
  auto with = [&](const std::vector<int>& q) {
    std::vector<int> p = sys;
    p.insert(p.end(), q.begin(), q.end());
    return p;
  };
  std::vector<int> cached;
  for (int k = 0; k < 4; ++k) {
    const std::vector<int> p = with(Prompt(20 + 7 * k, 20 + k));  // (a last block boundary past sys)
    const Result r = Run(Greedy(p, 4));
    cached.push_back(r.final.usage.cached_tokens);
    GenerateParams plain = Greedy(p, 4);
    plain.prompt_logprobs = true;  // (no prefix cache for such a request)
    EXPECT_EQ(r.tokens, Run(plain).tokens) << k;
  }
  EXPECT_EQ(cached[0], 0);
  EXPECT_EQ(cached[1], keeps_state() ? 0 : 48);
  EXPECT_EQ(cached[2], 48);
  EXPECT_EQ(cached[3], 48);
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// Prompt logprobs want a row of logits per token: with fewer rows than the batch limit (max_logit_rows), the
// scheduler cuts such a prompt into chunks of what is left of a step's rows. The bits are those of the
// uncut model, alone and among other requests; an engine that could not give each sequence a row is refused.
TEST_P(EngineTest, PromptLogprobsAreCutToTheLogitRows) {
  auto request = [&](int n, int salt) {
    GenerateParams p = Greedy(Prompt(n, salt), 3);
    p.prompt_logprobs = true;
    return p;
  };
  Start();  // 64 rows: the batch limit
  std::vector<Result> ref;
  for (int i = 0; i < 4; ++i) ref.push_back(Run(request(100 + 13 * i, i)));
  ASSERT_EQ(ref[0].prompt_logprobs.size(), 100u);
  engine_.reset();
  Start(256, 64, 16, true, 0, /*max_logit_rows=*/16);
  EXPECT_EQ(model_->max_logit_rows(), 16);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 4; ++i) {
    auto st = engine_->Submit(request(100 + 13 * i, i));
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    streams.push_back(*st);
  }
  for (int i = 0; i < 4; ++i) {
    const Result r = Drain(streams[static_cast<size_t>(i)]);
    // (bit patterns: the first prompt token has no logprob, a NaN)
    auto bits = [](const std::vector<float>& v) {
      std::vector<uint32_t> b(v.size());
      std::memcpy(b.data(), v.data(), sizeof(float) * v.size());
      return b;
    };
    EXPECT_EQ(bits(r.prompt_logprobs), bits(ref[static_cast<size_t>(i)].prompt_logprobs)) << i;
    EXPECT_EQ(r.logprobs, ref[static_cast<size_t>(i)].logprobs) << i;
    EXPECT_EQ(r.tokens, ref[static_cast<size_t>(i)].tokens) << i;
  }
  EXPECT_EQ(engine_->CheckConsistency(), "");
  EngineOptions eo;
  eo.max_num_batched_tokens = 64;
  eo.max_num_seqs = 17;  // more sequences than rows of logits
  auto refused = Engine::Create(*model_, eo);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("max_num_seqs"), std::string::npos) << refused.status().message();
  // The message names the smaller of the two limits.
  eo.max_num_batched_tokens = 17;
  eo.max_num_seqs = 64;
  refused = Engine::Create(*model_, eo);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("max_num_batched_tokens (17)"), std::string::npos)
      << refused.status().message();
}

TEST_P(EngineTest, NamespacesIsolateSessionsAndPrefixes) {
  Start();
  ASSERT_TRUE(engine_->CreateSession("alice", "x", 0, 0, {}).ok());
  EXPECT_EQ(engine_->GetSession("bob", "x", false).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(engine_->CreateSession("bob", "x", 0, 0, {}).ok());  // same name, another key
  GenerateParams p = Greedy(Prompt(64, 9), 2);
  p.ns = "alice";
  Run(p);
  p.ns = "bob";
  EXPECT_EQ(Run(p).final.usage.cached_tokens, 0);  // alice's prefix is invisible to bob
  p.ns = "alice";
  EXPECT_GT(Run(p).final.usage.cached_tokens, 0);
  EXPECT_EQ(engine_->ListSessions("alice").size(), 1u);
}

TEST_P(EngineTest, ErrorsNameTheField) {
  Start(32);
  EXPECT_EQ(engine_->Submit(Greedy({}, 4)).status().code(), StatusCode::kInvalidArgument);
  auto bad = engine_->Submit(Greedy({1, cfg_.vocab + 5}, 4));
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("prompt[1]"), std::string::npos);
  EXPECT_EQ(engine_->Submit(Greedy({1}, 4, "nope")).status().code(), StatusCode::kNotFound);
  auto overflow = engine_->Submit(Greedy(Prompt(250, 1), 20));
  EXPECT_EQ(overflow.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(overflow.status().message().find("context"), std::string::npos);
  GenerateParams p = Greedy({1, 2}, 4);
  p.sampling.top_p = 2;
  EXPECT_NE(engine_->Submit(p).status().message().find("top_p"), std::string::npos);
  EXPECT_EQ(engine_->CreateSession("", "bad id!", 0, 0, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->TruncateSession("", "none", 1).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(engine_->CreateSession("", "ok", 0, 0, {1, 2, 3}).ok());
  EXPECT_EQ(engine_->CreateSession("", "ok", 0, 0, {}).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(engine_->TruncateSession("", "ok", 4).status().code(), StatusCode::kInvalidArgument);
  GenerateParams lp = Greedy({1, 2}, 2);
  lp.logprobs = 21;
  EXPECT_NE(engine_->Submit(lp).status().message().find("logprobs"), std::string::npos);
}

TEST_P(EngineTest, RefusesWhatCannotFitInAnEmptyCache) {
  Start(4);  // 4 blocks x 16 = 64 tokens
  auto r = engine_->Submit(Greedy(Prompt(60, 1), 10));
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(engine_->Submit(Greedy(Prompt(40, 1), 10)).ok());
}

// Memory pressure: idle sessions lose their KV first, then running requests are preempted by
// recompute; outputs stay exactly those of solo runs.
TEST_P(EngineTest, PressureEvictsSessionsThenPreemptsWithoutChangingOutputs) {
  Start(12, 64);  // 192 token slots
  std::map<int, std::vector<int>> solo;
  for (int k = 0; k < 6; ++k) solo[k] = Run(Greedy(Prompt(40, k), 20)).tokens;
  ASSERT_TRUE(engine_->CreateSession("", "idle", 0, 0, {}).ok());
  Run(Greedy(Prompt(60, 50), 4, "idle"));
  // All six arrive between two steps (the engine thread is held while they are queued), so that they
  // compete for the cache whatever the machine's speed: submitted one by one, a fast CPU could finish
  // the first ones before the last arrive, and nothing would need preempting.
  std::promise<void> held, release;
  std::thread holder([&] {
    engine_->RunOnEngineThread([&] {
      held.set_value();
      release.get_future().wait();
    });
  });
  held.get_future().wait();
  std::vector<std::promise<Engine::StreamOrError>> submitted(6);
  for (int k = 0; k < 6; ++k) {
    engine_->Submit(Greedy(Prompt(40, k), 20), [&, k](Engine::StreamOrError r) { submitted[k].set_value(r); });
  }
  release.set_value();
  holder.join();
  std::vector<std::shared_ptr<RequestStream>> st;
  for (int k = 0; k < 6; ++k) {
    auto r = submitted[k].get_future().get();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    st.push_back(*r);
  }
  for (int k = 0; k < 6; ++k) EXPECT_EQ(Drain(st[k]).tokens, solo[k]) << k;
  const EngineStats s = CurrentStats();
  EXPECT_GT(s.session_evictions_memory, 0u);
  EXPECT_GT(s.preemptions, 0u);
  auto info = engine_->GetSession("", "idle", false);
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->evicted);
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// Thousands of random operations against a small cache: after each, block accounting matches every
// owner; finished greedy requests produce the tokens of their solo run; at the end nothing leaks.
TEST_P(EngineTest, RandomizedStress) {
  Start(20, 48, 8);
  std::mt19937 rng(42);
  std::map<std::pair<int, int>, std::vector<int>> expected;  // (salt, len) -> solo tokens
  auto prompt_of = [&](int salt, int len) { return Prompt(len, salt); };
  struct Live {
    std::shared_ptr<RequestStream> s;
    int salt, len;
    bool session;
  };
  std::vector<Live> live;
  std::vector<std::string> sessions;
  int finished_checked = 0, ops = 0;
  for (int it = 0; it < 2000; ++it) {
    const int op = rng() % 10;
    ++ops;
    if (op < 4) {  // submit a one-off request
      const int salt = rng() % 4, len = 1 + rng() % 30;
      auto r = engine_->Submit(Greedy(prompt_of(salt, len), 1 + rng() % 6));
      if (r.ok()) live.push_back({*r, salt, len, false});
    } else if (op == 4 && !live.empty()) {  // cancel one
      live[rng() % live.size()].s->Cancel();
    } else if (op == 5) {  // create a session
      const std::string id = "s" + std::to_string(rng() % 6);
      if (engine_->CreateSession("", id, 0, 0, {}).ok()) sessions.push_back(id);
    } else if (op == 6 && !sessions.empty()) {  // a turn on a session
      auto r = engine_->Submit(
          Greedy(prompt_of(rng() % 4, 1 + rng() % 10), 1 + rng() % 4, sessions[rng() % sessions.size()]));
      if (r.ok()) live.push_back({*r, 0, 0, true});
    } else if (op == 7 && !sessions.empty()) {  // fork
      const std::string child = "s" + std::to_string(rng() % 6);
      if (engine_->ForkSession("", sessions[rng() % sessions.size()], child).ok()) sessions.push_back(child);
    } else if (op == 8 && !sessions.empty()) {  // truncate
      const std::string id = sessions[rng() % sessions.size()];
      auto info = engine_->GetSession("", id, false);
      if (info.ok() && info->n_tokens > 0) (void)engine_->TruncateSession("", id, rng() % (info->n_tokens + 1));
    } else if (op == 9 && !sessions.empty()) {  // close
      const size_t i = rng() % sessions.size();
      if (engine_->CloseSession("", sessions[i]).ok()) sessions.erase(sessions.begin() + i);
    }
    // Collect finished requests and check one-off greedy outputs against their solo run.
    for (size_t i = 0; i < live.size();) {
      if (!live[i].s->finished()) {
        ++i;
        continue;
      }
      Result r = Drain(live[i].s);
      if (!live[i].session && r.final.finish == FinishReason::kLength) {
        auto& exp = expected[{live[i].salt, live[i].len}];
        const size_t n = r.tokens.size();
        if (exp.size() < n) exp = r.tokens;  // first (longest) observation defines the reference
        EXPECT_TRUE(std::equal(r.tokens.begin(), r.tokens.end(), exp.begin()))
            << "salt " << live[i].salt << " len " << live[i].len;
        ++finished_checked;
      }
      live.erase(live.begin() + i);
    }
    const std::string c = engine_->CheckConsistency();
    ASSERT_EQ(c, "") << "after op " << ops;
  }
  for (auto& l : live) Drain(l.s);
  for (const auto& id : sessions) (void)engine_->CloseSession("", id);
  EXPECT_EQ(engine_->CheckConsistency(), "");
  EXPECT_EQ(CurrentStats().blocks_used, 0);
  EXPECT_GT(finished_checked, 50);
}

}  // namespace
}  // namespace qkv

namespace qkv {
namespace {

// While a turn runs, the session reports its history and the blocks it holds (it used to list as 0 tokens,
// 0 bytes because its context moves into the running request).
TEST_P(EngineTest, BusySessionReportsItsHistoryAndBlocks) {
  Start();
  ASSERT_TRUE(engine_->CreateSession("", "busy", 0, 0, {}).ok());
  Run(Greedy(Prompt(90, 1), 10, "busy"));
  auto idle = engine_->GetSession("", "busy", true);
  ASSERT_TRUE(idle.ok());
  ASSERT_EQ(idle->n_tokens, 100);
  ASSERT_GT(idle->resident_bytes, 0);
  // A long turn; engine calls are answered between steps, so it is still running when they are.
  auto st = engine_->Submit(Greedy(Prompt(30, 2), 120, "busy"));
  ASSERT_TRUE(st.ok());
  StreamEvent e;
  ASSERT_TRUE((*st)->Next(&e, std::chrono::seconds(60)));  // the turn has started
  // (On a loaded machine the 120 tokens can all be generated before a query is answered: what a busy
  // session reports is checked whenever it is still busy, which is nearly always.)
  auto busy = engine_->GetSession("", "busy", true);
  ASSERT_TRUE(busy.ok());
  if (busy->busy) {
    EXPECT_EQ(busy->n_tokens, 100);
    EXPECT_EQ(busy->tokens, idle->tokens);
  }
  EXPECT_GE(busy->resident_bytes, idle->resident_bytes);
  const auto list = engine_->ListSessions("");
  ASSERT_EQ(list.size(), 1u);
  if (list[0].busy) {
    EXPECT_EQ(list[0].n_tokens, 100);
  }
  EXPECT_GE(list[0].resident_blocks, idle->resident_blocks);
  EXPECT_GE(CurrentStats().session_kv_bytes, idle->resident_bytes);
  EXPECT_EQ(CurrentStats().sessions_resident, 1);
  (*st)->Cancel();
  const Result r = Drain(*st);
  auto after = engine_->GetSession("", "busy", true);
  ASSERT_TRUE(after.ok());
  if (r.final.finish == FinishReason::kCancelled) {
    EXPECT_EQ(after->tokens, idle->tokens);  // a cancelled turn leaves the history as it was
  } else {
    EXPECT_EQ(after->n_tokens, 250);  // it had finished: history + prompt + 120 tokens
  }
}

TEST_P(EngineTest, IdleSessionsPastTheirTtlAreClosed) {
  Start();
  ASSERT_TRUE(engine_->CreateSession("", "short", 0.2, 0, {}).ok());
  ASSERT_TRUE(engine_->CreateSession("", "long", 3600, 0, {}).ok());
  Run(Greedy(Prompt(20, 1), 2, "short"));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // the engine loop wakes at least every 250 ms
  engine_->RunOnEngineThread([] {});
  EXPECT_EQ(engine_->GetSession("", "short", false).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(engine_->GetSession("", "long", false).ok());
  EXPECT_EQ(CurrentStats().session_evictions_ttl, 1u);
  EXPECT_EQ(engine_->CheckConsistency(), "");
}

// The metrics of a quiet server must catch up: a snapshot that cost a lot (many sessions, or a thread that
// was descheduled in the middle of it) delays the next one by 50x its cost, but never by more than a second
// (a 30 s wait under TSan once kept kv_cache_blocks{state="used"} above 0 after the last request ended).
TEST(EngineStatsTest, PublishIntervalIsBounded) {
  using std::chrono::microseconds;
  EXPECT_EQ(Engine::StatsPublishInterval(microseconds(0)), Clock::duration::zero());
  EXPECT_EQ(Engine::StatsPublishInterval(microseconds(199)), Clock::duration::zero());
  EXPECT_EQ(Engine::StatsPublishInterval(microseconds(1000)), std::chrono::milliseconds(50));
  EXPECT_EQ(Engine::StatsPublishInterval(std::chrono::milliseconds(20)), std::chrono::seconds(1));
  EXPECT_EQ(Engine::StatsPublishInterval(std::chrono::seconds(2)), std::chrono::seconds(1));
}

INSTANTIATE_TEST_SUITE_P(Kv, EngineTest,
                         ::testing::Combine(::testing::Values(Arch::kQwen3, Arch::kDeepseek2, Arch::kQwen3Moe,
                                                              Arch::kQwen35),
                                            ::testing::Values(DType::kBF16, DType::kI8)),
                         [](const auto& info) {
                           const Arch a = std::get<0>(info.param);
                           // qwen3 keeps the suite's earlier names (bf16, int8)
                           return (a == Arch::kQwen3 ? std::string() : std::string(ArchName(a)) + "_") +
                                  DTypeName(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace qkv
