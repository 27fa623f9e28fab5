// qkv-run: generate from a prompt with one model, for checks and demos.
//   qkv-run --model MODEL.gguf (--prompt TEXT | --tokens 1,2,3) [-n N] [--temperature T] [--seed S]
//           [--threads T] [--weights-dtype auto|bf16|f32] [--kv-dtype bf16|f32|int8] [--no-cache] [--logits OUT]
// --no-cache recomputes the whole prefix at every step; --logits writes the teacher-forced logits of
// every prompt position as little-endian float32 [positions × vocab].
#include <omp.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "engine/block_manager.h"
#include "engine/kernels/cpu.h"
#include "engine/model.h"
#include "engine/output_processor.h"

namespace {

int Fail(const qkv::Status& s) {
  std::cerr << "qkv-run: " << s.ToString() << "\n";
  return 1;
}

qkv::StatusOr<std::vector<int>> ParseIds(const std::string& s) {
  std::vector<int> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<int>(v));
    } catch (const std::exception&) {
      return qkv::InvalidArgument("--tokens: '" + item + "' is not a token id");
    }
  }
  return ids;
}

// Prefills `tokens` into seq in chunks of the batch limit; with all_logits, copies every row out.
qkv::Status Prefill(qkv::Model& m, qkv::CacheStores& cache, qkv::KvBlockPool& pool, qkv::SeqKv& seq,
                    const std::vector<int>& tokens, bool all_logits, std::vector<float>* rows_out) {
  const int bs = m.options().max_batch_tokens;
  const int vocab = m.config().vocab;
  QKV_RETURN_IF_ERROR(
      qkv::ReserveBlocks(seq, seq.n_tokens + static_cast<int>(tokens.size()), m.options().block_size, pool));
  QKV_RETURN_IF_ERROR(qkv::ReserveStateSlot(seq, cache.states()));
  for (size_t i = 0; i < tokens.size(); i += bs) {
    const size_t n = std::min<size_t>(bs, tokens.size() - i);
    qkv::BatchChunk ch{&seq, std::span<const int>(tokens.data() + i, n), all_logits};
    QKV_RETURN_IF_ERROR(m.Forward(std::span<const qkv::BatchChunk>(&ch, 1), cache));
    if (rows_out && all_logits)
      rows_out->insert(rows_out->end(), m.logits(), m.logits() + static_cast<size_t>(m.logits_rows()) * vocab);
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  // stdout carries what the tool makes (text, JSON, model info): the engine's log lines go to stderr.
  spdlog::set_default_logger(spdlog::stderr_color_mt("qkv"));
  CLI::App app{"qkv-run: generate text from a GGUF model"};
  std::string model, prompt, token_list, logits_out, gen_logits_out, weights_dtype = "auto", kv_dtype = "bf16";
  int n_predict = 32, threads = 0, max_batch = 512, max_ctx = 0;
  float temperature = 1.0f, top_p = 1.0f, min_p = 0.0f, rep = 1.0f, presence = 0.0f, frequency = 0.0f;
  int top_k = 0;
  uint64_t seed = 0;
  bool have_seed = false, no_cache = false, print_ids = false, ignore_eos = false;
  std::vector<std::string> stops;
  app.add_option("--model", model, "GGUF model file")->required();
  std::string tokenizer_file;
  app.add_option("--tokenizer", tokenizer_file, "Hugging Face tokenizer.json to use instead of the GGUF's");
  auto* p_opt = app.add_option("--prompt", prompt,
                               "prompt text (encoded with the model's tokenizer; BOS added if the model asks)");
  auto* t_opt = app.add_option("--tokens", token_list, "prompt as comma-separated token ids (used as given)");
  p_opt->excludes(t_opt);
  app.add_option("-n,--n-predict", n_predict, "tokens to generate")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--temperature", temperature, "sampling temperature (0 = greedy)")->capture_default_str();
  app.add_option("--top-k", top_k, "top-k (0 = off)")->capture_default_str();
  app.add_option("--top-p", top_p, "top-p")->capture_default_str();
  app.add_option("--min-p", min_p, "min-p")->capture_default_str();
  app.add_option("--repetition-penalty", rep, "repetition penalty")->capture_default_str();
  app.add_option("--presence-penalty", presence, "presence penalty")->capture_default_str();
  app.add_option("--frequency-penalty", frequency, "frequency penalty")->capture_default_str();
  auto* seed_opt = app.add_option("--seed", seed, "sampling seed (default: random)");
  app.add_option("--stop", stops, "stop string (repeatable); excluded from the output");
  app.add_flag("--ignore-eos", ignore_eos, "keep generating after EOS");
  app.add_option("--threads", threads, "compute threads (0: the CPUs this process may use)")
      ->capture_default_str()
      ->check(CLI::Range(0, 256));
  app.add_option("--weights-dtype", weights_dtype, "auto (quantized tensors stay quantized, others bf16), bf16 or f32")
      ->capture_default_str();
  app.add_option("--kv-dtype", kv_dtype, "bf16, f32 or int8")->capture_default_str();
  app.add_option("--max-batch-tokens", max_batch, "tokens per forward pass (prefill chunk)")->capture_default_str();
  app.add_option("--ctx", max_ctx, "context limit (0 = the model's)")->capture_default_str();
  app.add_flag("--no-cache", no_cache, "recompute the whole prefix at every step");
  app.add_option("--logits", logits_out,
                 "write teacher-forced logits of every prompt position (f32 LE [positions × vocab])");
  app.add_option("--gen-logits", gen_logits_out, "write the logits each generated token was sampled from");
  app.add_flag("--print-ids", print_ids, "print the generated token ids on stderr at the end");
  std::string log_level = "warn";
  app.add_option("--log-level", log_level,
                 "trace, debug (shows the GEMM kernel oneDNN picked per M bucket), info, warn, error")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  have_seed = seed_opt->count() > 0;
  spdlog::set_level(spdlog::level::from_str(log_level));

  qkv::ModelOptions mo;
  auto wd = qkv::ParseWeightsMode(weights_dtype);
  if (!wd.ok()) return Fail(qkv::InvalidArgument("--weights-dtype: " + wd.status().message()));
  auto kd = qkv::ParseKvDType(kv_dtype);
  if (!kd.ok()) return Fail(qkv::InvalidArgument("--kv-dtype: " + kd.status().message()));
  mo.tokenizer_path = tokenizer_file;
  mo.weights_dtype = wd->dtype;
  mo.keep_quantized = wd->keep_quantized;
  mo.kv_dtype = *kd;
  threads = qkv::ComputeThreads(threads);
  mo.n_threads = threads;
  mo.max_batch_tokens = max_batch;
  mo.max_context = max_ctx;
  omp_set_num_threads(threads);
  auto loaded = qkv::Model::Load(model, mo);
  if (!loaded.ok()) return Fail(loaded.status());
  qkv::Model& m = **loaded;
  // One sequence, no scheduler: the cache stores and a pool over their blocks of its own.
  auto cache_or = qkv::CacheStores::Create(m.cache_layout());
  if (!cache_or.ok()) return Fail(cache_or.status());
  qkv::CacheStores& cache = **cache_or;
  qkv::KvBlockPool pool(m.cache_layout().tokens.n_blocks, m.options().block_size);
  const qkv::Tokenizer& tok = m.tokenizer();
  const int vocab = m.config().vocab;

  std::vector<int> tokens;
  if (t_opt->count()) {
    auto ids = ParseIds(token_list);
    if (!ids.ok()) return Fail(ids.status());
    tokens = *ids;
  } else {
    if (tok.add_bos() && tok.bos_id() >= 0) tokens.push_back(tok.bos_id());
    const auto enc = tok.Encode(prompt);
    tokens.insert(tokens.end(), enc.begin(), enc.end());
  }
  if (tokens.empty()) return Fail(qkv::InvalidArgument("the prompt is empty"));
  for (int t : tokens) {
    if (t >= vocab)
      return Fail(qkv::InvalidArgument("--tokens: id " + std::to_string(t) + " is outside the vocabulary of " +
                                       std::to_string(vocab)));
  }
  if (static_cast<int>(tokens.size()) + n_predict > m.max_context()) {
    return Fail(qkv::InvalidArgument("prompt (" + std::to_string(tokens.size()) + ") + -n (" +
                                     std::to_string(n_predict) + ") exceeds the context of " +
                                     std::to_string(m.max_context())));
  }
  qkv::SamplingParams sp;
  sp.temperature = temperature;
  sp.top_k = top_k;
  sp.top_p = top_p;
  sp.min_p = min_p;
  sp.repetition_penalty = rep;
  sp.presence_penalty = presence;
  sp.frequency_penalty = frequency;
  if (have_seed) sp.seed = seed;
  if (auto s = sp.Validate(); !s.ok()) return Fail(s);

  qkv::SeqKv seq;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<float> prompt_logits;
  qkv::Status s = Prefill(m, cache, pool, seq, tokens, !logits_out.empty(), &prompt_logits);
  if (!s.ok()) return Fail(s);
  std::vector<float> last(m.logits() + static_cast<size_t>(m.logits_rows() - 1) * vocab,
                          m.logits() + static_cast<size_t>(m.logits_rows()) * vocab);
  const auto t1 = std::chrono::steady_clock::now();
  if (!logits_out.empty()) {
    std::ofstream out(logits_out, std::ios::binary);
    out.write(reinterpret_cast<const char*>(prompt_logits.data()),
              static_cast<std::streamsize>(prompt_logits.size() * 4));
    if (!out) return Fail(qkv::Internal("cannot write --logits '" + logits_out + "'"));
  }
  std::ofstream gen_logits;
  if (!gen_logits_out.empty()) gen_logits.open(gen_logits_out, std::ios::binary);

  // The engine's own output processing: sampling, EOS, stop strings, the token limit.
  qkv::OutputOptions oo;
  oo.stop = stops;
  oo.ignore_eos = ignore_eos;
  oo.max_tokens = n_predict;
  oo.max_context = m.max_context();
  qkv::OutputProcessor output(tok, sp, tokens, oo);
  std::vector<int> all = tokens, generated;
  while (n_predict > 0) {
    if (gen_logits.is_open())
      gen_logits.write(reinterpret_cast<const char*>(last.data()), static_cast<std::streamsize>(vocab * 4));
    const qkv::OutputProcessor::Step step = output.Next(last.data(), vocab, static_cast<int>(all.size()) + 1);
    if (step.finish == qkv::FinishReason::kError) return Fail(step.error);
    generated.push_back(step.token);
    all.push_back(step.token);
    std::cout << step.text << std::flush;
    if (step.finish != qkv::FinishReason::kNone) break;
    if (no_cache) {
      qkv::ReleaseBlocks(seq, pool);
      qkv::ReleaseStateSlot(seq, cache.states());  // recompute from scratch: the state starts at zero too
      s = Prefill(m, cache, pool, seq, all, false, nullptr);
    } else {
      s = Prefill(m, cache, pool, seq, {step.token}, false, nullptr);
    }
    if (!s.ok()) return Fail(s);
    last.assign(m.logits(), m.logits() + vocab);
  }
  std::cout << output.Finish() << std::endl;
  const auto t2 = std::chrono::steady_clock::now();
  const double pre = std::chrono::duration<double>(t1 - t0).count();
  const double dec = std::chrono::duration<double>(t2 - t1).count();
  std::fprintf(stderr, "prompt %zu tokens in %.3f s (%.1f tok/s); generated %zu tokens in %.3f s (%.1f tok/s)\n",
               tokens.size(), pre, tokens.size() / pre, generated.size(), dec, generated.size() / std::max(dec, 1e-9));
  if (print_ids) {
    std::string ids;
    for (int t : generated) ids += (ids.empty() ? "" : ",") + std::to_string(t);
    std::fprintf(stderr, "ids: %s\n", ids.c_str());
  }
  return 0;
}
