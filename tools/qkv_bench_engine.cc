// qkv-bench-engine: the continuous-batching engine's figures on one model.
//   * aggregate decode tokens/s at several concurrency levels;
//   * time to first token of a session's fourth turn (~2,000 tokens of history) versus the same request
//     sent fresh (in another namespace, so no prefix-cache hit);
//   * KV memory efficiency at steady state with mixed lengths: allocated slots ÷ slots holding tokens.
// Usage: qkv-bench-engine --model MODEL.gguf [--threads 2] [--concurrency 1,4,16,64] [--gen 64]
//        [--temperature T] [--idle-sessions N]
#include <omp.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>

#include "engine/engine.h"
#include "engine/kernels/cpu.h"

namespace {
using Clock = std::chrono::steady_clock;
// The session figure: three turns of history / 3 tokens (8 of them generated), then a turn of kTurn4.
constexpr int kMinHistory = 27, kTurn4 = 64;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::vector<int> Tokens(int n, int salt, int vocab) {
  std::vector<int> t(n);
  for (int i = 0; i < n; ++i) t[i] = static_cast<int>((i * 7919ull + salt * 104729ull + 13) % vocab);
  return t;
}

qkv::GenerateParams Greedy(std::vector<int> prompt, int max_tokens) {
  qkv::GenerateParams p;
  p.prompt = std::move(prompt);
  p.max_tokens = max_tokens;
  p.sampling.temperature = 0;
  p.ignore_eos = true;
  return p;
}

// The stream of a submitted request, or the engine's refusal on stderr and exit 2 (a request the options
// made that the engine or this model refuses, e.g. one past the context) or 1.
std::shared_ptr<qkv::RequestStream> SubmitOrExit(qkv::Engine& eng, qkv::GenerateParams p, const char* what) {
  auto s = eng.Submit(std::move(p));
  if (s.ok()) return *s;
  std::fprintf(stderr, "qkv-bench-engine: %s: %s\n", what, s.status().ToString().c_str());
  const qkv::StatusCode c = s.status().code();
  // The engine's thread is still running: leave without static destructors under it.
  std::fflush(nullptr);
  std::_Exit(c == qkv::StatusCode::kInvalidArgument || c == qkv::StatusCode::kOutOfRange ? 2 : 1);
}

// Drains a stream; returns the time its first token arrived.
Clock::time_point Drain(const std::shared_ptr<qkv::RequestStream>& s, int* tokens) {
  qkv::StreamEvent e;
  Clock::time_point first{};
  for (;;) {
    if (!s->Next(&e, std::chrono::seconds(600))) break;
    if (!e.token_ids.empty() && first == Clock::time_point{}) first = Clock::now();
    *tokens += static_cast<int>(e.token_ids.size());
    if (e.final) break;
  }
  return first;
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkv-bench-engine: batching, session and KV-efficiency figures"};
  std::string model;
  int threads = 0, gen = 64, history = 2000;
  std::vector<int> conc = {1, 4, 16, 64};
  app.add_option("--model", model, "GGUF model file")->required();
  app.add_option("--threads", threads, "compute threads (0: the CPUs this process may use)")
      ->capture_default_str()
      ->check(CLI::Range(0, 256));
  app.add_option("--concurrency", conc, "concurrent sequences for the decode figure")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--gen", gen, "tokens generated per sequence")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  auto* history_opt =
      app.add_option("--history", history,
                     "session history before the measured turn (default: 2000, or what the model's context leaves)")
          ->capture_default_str()
          ->check(CLI::Range(kMinHistory, 1 << 24));
  float temperature = 0;
  int idle_sessions = 0;
  std::string kv_dtype = "bf16";
  app.add_option("--kv-dtype", kv_dtype, "KV cache dtype: bf16, f32 or int8")->capture_default_str();
  app.add_option("--idle-sessions", idle_sessions,
                 "idle sessions (8 tokens each, TTL 1 h) created before the decode figure")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--temperature", temperature, "sampling temperature of the decode figure (0: greedy)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);
  threads = qkv::ComputeThreads(threads);
  omp_set_num_threads(threads);
  qkv::ModelOptions mo;
  auto kd = qkv::ParseKvDType(kv_dtype);
  if (!kd.ok()) {
    std::fprintf(stderr, "qkv-bench-engine: --kv-dtype: %s\n", kd.status().message().c_str());
    return 2;
  }
  mo.kv_dtype = *kd;
  mo.n_threads = threads;
  mo.max_batch_tokens = 512;
  mo.max_context = history + 512;
  mo.kv_blocks = std::max<int64_t>(64 * (32 + gen) / 16 + 64, 2 * (history + 512) / 16 + 64);
  auto m = qkv::Model::Load(model, mo);
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
    return 1;
  }
  const int V = (*m)->config().vocab, ctx = (*m)->max_context();
  // The fourth turn adds kTurn4 tokens and generates 4 after the history: without --history, as much of 2000
  // as the context leaves; a --history that does not fit is an error.
  if (history + kTurn4 + 4 > ctx) {
    if (history_opt->count() > 0 || ctx - kTurn4 - 4 < kMinHistory) {
      std::fprintf(stderr,
                   "qkv-bench-engine: --history %d + the measured turn's %d tokens exceed the context of %d tokens "
                   "of %s\n",
                   history, kTurn4 + 4, ctx, model.c_str());
      return 2;
    }
    history = ctx - kTurn4 - 4;
  }
  std::printf("model: %s, %d threads, %lld KV blocks of 16\n", (*m)->config().Summary().c_str(), threads,
              static_cast<long long>(mo.kv_blocks));
  std::printf("gemm: cpu isa %s (own kernels %s, kv prefetch into %s); compute dtype %s; %s\n",
              qkv::GemmRuntime::CpuIsa().c_str(), qkv::KernelIsaName(qkv::ActiveKernelIsa()),
              qkv::KvPrefetchL2() ? "l2" : "l1", qkv::DTypeName((*m)->compute_dtype()), (*m)->gemm().Summary().c_str());
  std::printf("one-token steps: %s\n", (*m)->team_step() ? "one parallel region per step" : "a region per layer phase");
  qkv::EngineOptions eo;
  eo.max_num_batched_tokens = 512;
  eo.max_num_seqs = 64;
  auto e = qkv::Engine::Create(**m, eo);
  if (!e.ok()) return 1;
  qkv::Engine& eng = **e;

  // Idle sessions: the per-step cost must not grow with them.
  for (int i = 0; i < idle_sessions; ++i) {
    auto r = eng.CreateSession("idle", "s" + std::to_string(i), 3600, 0, Tokens(8, i, V));
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return 1;
    }
  }
  if (idle_sessions > 0) std::printf("%d idle sessions\n", idle_sessions);

  // 1. Aggregate decode throughput.
  double single = 0;
  for (int c : conc) {
    std::vector<std::shared_ptr<qkv::RequestStream>> st;
    for (int i = 0; i < c; ++i) {
      auto p = Greedy(Tokens(16, 1000 + i, V), gen);
      p.sampling.temperature = temperature;
      p.sampling.seed = 1 + i;
      st.push_back(SubmitOrExit(eng, p, "decode figure (16-token prompts, --gen, --temperature)"));
    }
    // One reader thread per stream records when its first token arrives; the decode phase is timed from
    // the moment every sequence has its first token to the end.
    std::vector<int> tokens(c, 0);
    std::vector<Clock::time_point> firsts(c);
    const auto t0 = Clock::now();
    std::vector<std::thread> readers;
    for (int i = 0; i < c; ++i) readers.emplace_back([&, i] { firsts[i] = Drain(st[i], &tokens[i]); });
    for (auto& r : readers) r.join();
    const double total = Since(t0);
    Clock::time_point last_first = t0;
    for (auto f : firsts) last_first = std::max(last_first, f);
    const double decode_s = total - std::chrono::duration<double>(last_first - t0).count();
    const double tps = static_cast<double>(c) * (gen - 1) / std::max(decode_s, 1e-9);
    if (c == conc.front()) single = tps;
    std::printf("decode, %2d concurrent: %7.1f tok/s aggregate (%.2fx the first level)\n", c, tps, tps / single);
  }

  // 2. Session TTFT at the fourth turn versus fresh.
  {
    (void)eng.CreateSession("bench", "s", 0, 0, {});
    std::vector<int> full;
    const int per_turn = history / 3;
    for (int turn = 0; turn < 3; ++turn) {
      auto p = Greedy(Tokens(per_turn - 8, turn, V), 8);
      p.ns = "bench";
      p.session_id = "s";
      full.insert(full.end(), p.prompt.begin(), p.prompt.end());
      int n = 0;
      Drain(SubmitOrExit(eng, p, "session history"), &n);
    }
    auto info = eng.GetSession("bench", "s", true);
    auto p4 = Greedy(Tokens(kTurn4, 99, V), 4);
    p4.ns = "bench";
    p4.session_id = "s";
    int n = 0;
    auto t0 = Clock::now();
    const auto f1 = Drain(SubmitOrExit(eng, p4, "fourth turn"), &n);
    const double ttft_session = std::chrono::duration<double>(f1 - t0).count();
    std::vector<int> fresh = info->tokens;
    fresh.insert(fresh.end(), p4.prompt.begin(), p4.prompt.end());
    auto pf = Greedy(fresh, 4);
    pf.ns = "fresh";  // another namespace: no prefix-cache hit
    t0 = Clock::now();
    const auto f2 = Drain(SubmitOrExit(eng, pf, "fourth turn, fresh"), &n);
    const double ttft_fresh = std::chrono::duration<double>(f2 - t0).count();
    std::printf(
        "time to first token, turn 4 with %zu tokens of history: session %.1f ms, fresh %.1f ms (%.1fx faster)\n",
        info->tokens.size(), 1e3 * ttft_session, 1e3 * ttft_fresh, ttft_fresh / ttft_session);
    (void)eng.CloseSession("bench", "s");
  }

  // 3. KV efficiency with mixed lengths, sampled while 16 sequences run.
  {
    std::mt19937 rng(3);
    std::vector<std::shared_ptr<qkv::RequestStream>> st;
    for (int i = 0; i < 16; ++i) {
      // 20-319 prompt and 16-63 generated tokens, within the context of a small model.
      const int n_prompt = std::min<int>(20 + rng() % 300, ctx / 2), n_gen = std::min<int>(16 + rng() % 48, ctx / 4);
      st.push_back(SubmitOrExit(eng, Greedy(Tokens(n_prompt, 2000 + i, V), n_gen), "KV efficiency figure"));
    }
    double sum = 0;
    int samples = 0;
    for (int k = 0; k < 200; ++k) {
      const qkv::EngineStats s = eng.Stats();
      if (s.requests_running >= 8 && s.tokens_used > 0) {
        sum += static_cast<double>(s.blocks_used * s.block_size) / static_cast<double>(s.tokens_used);
        ++samples;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    int n = 0;
    for (auto& s : st) Drain(s, &n);
    std::printf("KV efficiency (allocated slots / slots holding tokens), mean of %d samples: %.3f\n", samples,
                samples ? sum / samples : 0.0);
  }
  return 0;
}
