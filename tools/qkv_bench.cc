// qkv-bench: prefill and single-stream decode speed of one model, and decode as a percentage of the
// memory-bandwidth roofline (weight bytes read per token ÷ measured read bandwidth).
//   qkv-bench --model MODEL.gguf [--threads T] [--prompt 512] [--gen 128] [--profile] [--baseline OTHER.gguf]
// With --baseline, each repetition also runs OTHER right after MODEL and prints the decode speed of MODEL
// over OTHER's: a ratio taken seconds apart, which the drift of a shared machine's bandwidth (±20-30% over
// minutes) moves far less than a ratio of two separate runs.
#include <omp.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/block_manager.h"
#include "engine/kernels/cpu.h"
#include "engine/kernels/weights_arena.h"
#include "engine/model.h"
#include "engine/sampler.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Read bandwidth in GB/s over a buffer of n floats with `threads` threads (best of `passes` passes).
double MeasureBandwidth(const float* buf, size_t n, int threads, int passes) {
  double best = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = Clock::now();
    float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      // 64 independent lanes so that the loop is bound by memory, not by add latency.
      float acc[64] = {};
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const size_t chunk = n / nt / 64 * 64;
      const float* p = buf + chunk * t;
      for (size_t i = 0; i < chunk; i += 64) {
        for (int l = 0; l < 64; ++l) acc[l] += p[i + l];
      }
      for (float a : acc) total += a;
    }
    const double sec = Since(t0);
    if (total < 0) std::printf("impossible\n");
    best = std::max(best, static_cast<double>(n * sizeof(float)) / sec / 1e9);
  }
  return best;
}

void PrintProfile(const char* what, const qkv::Model::Profile& p) {
  const double t = p.total();
  auto pct = [&](double x) { return 100.0 * x / t; };
  std::printf(
      "  %s profile: qkv %.1f%%, attention %.1f%%, o %.1f%%, ffn gate/up %.1f%%, ffn act %.1f%%, "
      "ffn down %.1f%%, lm head %.1f%%, norms %.1f%%, rope+kv store %.1f%%, embed %.1f%%\n",
      what, pct(p.qkv), pct(p.attention), pct(p.o), pct(p.ffn_up), pct(p.ffn_act), pct(p.ffn_down), pct(p.lm_head),
      pct(p.norms), pct(p.rope_store), pct(p.embed));
}

// A model with its own cache, ready to run repetitions of one prompt + decode.
struct Bench {
  std::unique_ptr<qkv::Model> model;
  std::unique_ptr<qkv::CacheStores> cache;
  std::unique_ptr<qkv::KvBlockPool> pool;
  double load_s = 0;
};

qkv::StatusOr<Bench> LoadBench(const std::string& path, const qkv::ModelOptions& mo, int prompt, int gen) {
  Bench b;
  const auto tl = Clock::now();
  QKV_ASSIGN_OR_RETURN(b.model, qkv::Model::Load(path, mo));
  QKV_ASSIGN_OR_RETURN(b.cache, qkv::CacheStores::Create(b.model->cache_layout()));
  b.pool = std::make_unique<qkv::KvBlockPool>(b.model->cache_layout().tokens.n_blocks, b.model->options().block_size);
  if (prompt + gen > b.model->max_context()) {
    return qkv::Status(qkv::StatusCode::kOutOfRange, "--prompt " + std::to_string(prompt) + " + --gen " +
                                                         std::to_string(gen) + " exceeds the context of " + path +
                                                         " (" + std::to_string(b.model->max_context()) + " tokens)");
  }
  b.load_s = Since(tl);
  return b;
}

// One repetition: the prompt's prefill, then `gen` greedy tokens one at a time; {prefill s, decode s}.
qkv::StatusOr<std::pair<double, double>> RunRep(Bench& b, const std::vector<int>& tokens, int gen, bool profile,
                                                qkv::Model::Profile* prefill_prof, qkv::Model::Profile* decode_prof) {
  qkv::Model& m = *b.model;
  const int V = m.config().vocab;
  qkv::SeqKv seq;
  QKV_RETURN_IF_ERROR(qkv::ReserveBlocks(seq, static_cast<int>(tokens.size()) + gen, m.options().block_size, *b.pool));
  QKV_RETURN_IF_ERROR(qkv::ReserveStateSlot(seq, b.cache->states()));
  m.set_profiling(profile);
  auto t0 = Clock::now();
  qkv::BatchChunk ch{&seq, tokens, false};
  QKV_RETURN_IF_ERROR(m.Forward(std::span<const qkv::BatchChunk>(&ch, 1), *b.cache));
  const double pre = Since(t0);
  if (prefill_prof) *prefill_prof = m.profile();
  m.set_profiling(profile);
  int next = qkv::ArgMax(m.logits(), V);
  t0 = Clock::now();
  for (int i = 0; i < gen; ++i) {
    qkv::BatchChunk d{&seq, std::span<const int>(&next, 1), false};
    if (auto s = m.Forward(std::span<const qkv::BatchChunk>(&d, 1), *b.cache); !s.ok()) {
      return qkv::Status(s.code(), "decode step " + std::to_string(i) + ": " + s.message());
    }
    next = qkv::ArgMax(m.logits(), V);
  }
  const double dec = Since(t0);
  if (decode_prof) *decode_prof = m.profile();
  qkv::ReleaseBlocks(seq, *b.pool);
  qkv::ReleaseStateSlot(seq, b.cache->states());
  return std::pair{pre, dec};
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkv-bench: prefill and decode throughput of a model"};
  std::string model, baseline, weights_dtype = "auto", kv_dtype = "bf16";
  int threads = 0, prompt = 512, gen = 128, reps = 3;
  bool profile = false;
  app.add_option("--model", model, "GGUF model file")->required();
  app.add_option("--threads", threads, "compute threads (0: the CPUs this process may use)")
      ->capture_default_str()
      ->check(CLI::Range(0, 256));
  app.add_option("--prompt", prompt, "prompt tokens for the prefill measurement")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  app.add_option("--gen", gen, "tokens to decode")->capture_default_str()->check(CLI::Range(1, 65536));
  app.add_option("--reps", reps, "repetitions (the best is reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_option("--weights-dtype", weights_dtype, "auto (quantized tensors stay quantized, others bf16), bf16 or f32")
      ->capture_default_str();
  app.add_option("--kv-dtype", kv_dtype, "bf16, f32 or int8")->capture_default_str();
  app.add_flag("--profile", profile, "print where the time goes");
  app.add_option("--baseline", baseline,
                 "another GGUF file, run right after the model in every repetition (decode ratio per repetition)");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);
  threads = qkv::ComputeThreads(threads);
  omp_set_num_threads(threads);

  qkv::ModelOptions mo;
  auto wd = qkv::ParseWeightsMode(weights_dtype);
  auto kd = qkv::ParseKvDType(kv_dtype);
  if (!wd.ok() || !kd.ok()) {
    std::fprintf(stderr, "qkv-bench: --weights-dtype must be auto, bf16 or f32 and --kv-dtype bf16, f32 or int8\n");
    return 1;
  }
  mo.weights_dtype = wd->dtype;
  mo.keep_quantized = wd->keep_quantized;
  mo.kv_dtype = *kd;
  mo.n_threads = threads;
  mo.max_batch_tokens = prompt;
  mo.max_context = prompt + gen + 1;
  mo.state_slots = 1;  // one sequence
  auto loaded = LoadBench(model, mo, prompt, gen);
  if (!loaded.ok()) {
    std::fprintf(stderr, "qkv-bench: %s\n", loaded.status().ToString().c_str());
    return loaded.status().code() == qkv::StatusCode::kOutOfRange ? 2 : 1;
  }
  Bench& main_bench = *loaded;
  qkv::Model& m = *main_bench.model;
  const double load_s = main_bench.load_s;
  std::optional<Bench> base;
  if (!baseline.empty()) {
    auto b = LoadBench(baseline, mo, prompt, gen);
    if (!b.ok()) {
      std::fprintf(stderr, "qkv-bench: --baseline: %s\n", b.status().ToString().c_str());
      return b.status().code() == qkv::StatusCode::kOutOfRange ? 2 : 1;
    }
    base = std::move(*b);
  }
  const int V = m.config().vocab;
  std::printf("model: %s\n", m.config().Summary().c_str());
  std::printf("weights %s, kv %s, threads %d; load %.2f s; weight bytes %.1f MB (read per decoded token %.1f MB)\n",
              weights_dtype.c_str(), kv_dtype.c_str(), threads, load_s, m.weight_bytes() / 1e6,
              m.weight_bytes_per_token() / 1e6);
  std::printf("gemm: cpu isa %s (own kernels %s, kv prefetch into %s); compute dtype %s; %s\n",
              qkv::GemmRuntime::CpuIsa().c_str(), qkv::KernelIsaName(qkv::ActiveKernelIsa()),
              qkv::KvPrefetchL2() ? "l2" : "l1", qkv::DTypeName(m.compute_dtype()), m.gemm().Summary().c_str());
  std::printf("one-token steps: %s\n", m.team_step() ? "one parallel region per step" : "a region per layer phase");
  for (const auto& k : m.gemm().KernelLog()) {
    if (k.rfind("M=1 ", 0) == 0 || k.rfind("M=128 ", 0) == 0) std::printf("  kernel %s\n", k.c_str());
  }

  std::vector<int> tokens(prompt);
  for (int i = 0; i < prompt; ++i) tokens[i] = (i * 7919 + 13) % V;
  double best_prefill = 1e30, best_decode = 1e30;
  // The VM's read bandwidth drifts by 2x within minutes (docs/performance.md), so besides the best decode
  // against the best bandwidth, each repetition's decode is set against a bandwidth measured right after it.
  // 1 GiB on the pages the weights are on (the model's arena: huge pages unless QKV_HUGE_PAGES=0), so that
  // the roofline compares like with like.
  const size_t bw_n = (1ull << 30) / sizeof(float);
  qkv::WeightsBuffer bw_mem(std::make_shared<qkv::WeightsArena>(), bw_n * sizeof(float));
  auto* bw_buf = reinterpret_cast<float*>(bw_mem.data());
  std::fill(bw_buf, bw_buf + bw_n, 1.0f);
  // A decoded token also reads its sequence's cache: K/V of every earlier position (on average the
  // context in the middle of the decode) and the fixed state. rep_ratio counts weights only, rep_ratio_all
  // weights and cache.
  const qkv::CacheLayout& cl = m.cache_layout();
  const double mean_ctx = prompt + (gen - 1) / 2.0;
  const double cache_read =
      mean_ctx * static_cast<double>(cl.tokens.bytes_per_token()) + static_cast<double>(cl.state_bytes_per_seq);
  const double bytes_all = static_cast<double>(m.weight_bytes_per_token()) + cache_read;
  std::vector<double> rep_ratio, rep_ratio_all;
  qkv::Model::Profile prefill_prof, decode_prof;
  std::vector<double> base_tps, ratio;
  for (int r = 0; r < reps; ++r) {
    qkv::Model::Profile pp, dp;
    auto rep = RunRep(main_bench, tokens, gen, profile, &pp, &dp);
    if (!rep.ok()) {
      std::fprintf(stderr, "qkv-bench: %s\n", rep.status().ToString().c_str());
      return 1;
    }
    const auto [pre, dec] = *rep;
    if (pre < best_prefill) {
      best_prefill = pre;
      prefill_prof = pp;
    }
    const double rep_bw = MeasureBandwidth(bw_buf, bw_n, threads, 3);
    rep_ratio.push_back(gen / dec / (rep_bw * 1e9 / static_cast<double>(m.weight_bytes_per_token())));
    rep_ratio_all.push_back(gen / dec / (rep_bw * 1e9 / bytes_all));
    std::printf(
        "rep %d: decode %.1f tok/s, read bandwidth right after it %.1f GB/s: %.0f%% of that roofline (%.0f%% with the "
        "cache)\n",
        r + 1, gen / dec, rep_bw, 100.0 * rep_ratio.back(), 100.0 * rep_ratio_all.back());
    if (dec < best_decode) {
      best_decode = dec;
      decode_prof = dp;
    }
    if (base) {
      auto b = RunRep(*base, tokens, gen, false, nullptr, nullptr);
      if (!b.ok()) {
        std::fprintf(stderr, "qkv-bench: --baseline: %s\n", b.status().ToString().c_str());
        return 1;
      }
      base_tps.push_back(gen / b->second);
      ratio.push_back(gen / dec / base_tps.back());
      std::printf("rep %d: baseline decode %.1f tok/s; the model decodes %.2fx the baseline\n", r + 1, base_tps.back(),
                  ratio.back());
    }
  }
  const double bw = MeasureBandwidth(bw_buf, bw_n, threads, 5);
  const double prefill_tps = prompt / best_prefill;
  const double decode_tps = gen / best_decode;
  const double roofline = bw * 1e9 / static_cast<double>(m.weight_bytes_per_token());
  // What one sequence of this length holds in the cache: K/V per token of the attention layers (blocks
  // rounded up) plus the fixed state of the Gated DeltaNet layers.
  const int64_t ctx_tokens = (prompt + gen + mo.block_size - 1) / mo.block_size * mo.block_size;
  std::printf("cache per sequence at %d tokens: KV %.2f MiB (%lld B/token) + state %.2f MiB = %.2f MiB\n", prompt + gen,
              static_cast<double>(ctx_tokens * cl.tokens.bytes_per_token()) / (1 << 20),
              static_cast<long long>(cl.tokens.bytes_per_token()),
              static_cast<double>(cl.state_bytes_per_seq) / (1 << 20),
              static_cast<double>(ctx_tokens * cl.tokens.bytes_per_token() + cl.state_bytes_per_seq) / (1 << 20));
  std::printf("prefill: %d tokens in %.3f s = %.1f tok/s\n", prompt, best_prefill, prefill_tps);
  std::printf("decode:  %d tokens in %.3f s = %.1f tok/s (%.2f ms/token)\n", gen, best_decode, decode_tps,
              1e3 * best_decode / gen);
  std::printf("roofline: read bandwidth %.1f GB/s on %d threads -> %.1f tok/s; decode at %.0f%% of it\n", bw, threads,
              roofline, 100.0 * decode_tps / roofline);
  const auto [lo, hi] = std::minmax_element(rep_ratio.begin(), rep_ratio.end());
  std::printf(
      "roofline per repetition (decode against the bandwidth measured right after it): median %.0f%% (%.0f%%-%.0f%%)\n",
      100.0 * Median(rep_ratio), 100.0 * *lo, 100.0 * *hi);
  // The lines above count weights only.
  const double roofline_all = bw * 1e9 / bytes_all;
  std::printf(
      "roofline with the cache: weights %.1f MB + cache %.1f MB a token (mean context %.0f) -> %.1f tok/s; "
      "decode at %.0f%% of it\n",
      m.weight_bytes_per_token() / 1e6, cache_read / 1e6, mean_ctx, roofline_all, 100.0 * decode_tps / roofline_all);
  const auto [lo_all, hi_all] = std::minmax_element(rep_ratio_all.begin(), rep_ratio_all.end());
  std::printf("roofline with the cache per repetition: median %.0f%% (%.0f%%-%.0f%%)\n", 100.0 * Median(rep_ratio_all),
              100.0 * *lo_all, 100.0 * *hi_all);
  if (base) {
    std::printf(
        "baseline %s: decode median %.1f tok/s; the model over the baseline per repetition: median %.2fx "
        "(%.2fx-%.2fx)\n",
        baseline.c_str(), Median(base_tps), Median(ratio), *std::min_element(ratio.begin(), ratio.end()),
        *std::max_element(ratio.begin(), ratio.end()));
  }
  if (profile) {
    PrintProfile("prefill", prefill_prof);
    PrintProfile("decode", decode_prof);
  }
  return 0;
}
