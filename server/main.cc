// qkvserve: the gRPC inference server. See `qkvserve --help` and docs/server.md.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <omp.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "engine/capacity_plan.h"
#include "engine/kernels/cpu.h"
#include "server/api_keys.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/service.h"

#ifndef QKV_SOURCE_DIR
#define QKV_SOURCE_DIR ""
#endif

namespace {

constexpr const char* kService = "qkvserve.v1.Inference";

int Fail(const std::string& msg) {
  spdlog::error("{}", msg);
  std::fprintf(stderr, "qkvserve: %s\n", msg.c_str());
  return 2;
}

// Where the default model is looked for, in order: $QKVSERVE_MODEL, the install's share directory next to
// the binary, the source tree's models/.
std::string ResolveDefaultModel(std::vector<std::string>* looked) {
  if (const char* env = std::getenv("QKVSERVE_MODEL"); env && *env) return env;
  std::error_code ec;
  const auto exe = std::filesystem::canonical("/proc/self/exe", ec);
  std::vector<std::filesystem::path> dirs;
  if (!ec) dirs.push_back(exe.parent_path().parent_path() / "share" / "qkvserve" / "models");
  if (*QKV_SOURCE_DIR) dirs.push_back(std::filesystem::path(QKV_SOURCE_DIR) / "models");
  for (const auto& d : dirs) {
    looked->push_back(d.string());
    if (!std::filesystem::is_directory(d, ec)) continue;
    std::vector<std::string> found;
    for (const auto& f : std::filesystem::directory_iterator(d, ec)) {
      if (f.path().extension() == ".gguf") found.push_back(f.path().string());
    }
    std::sort(found.begin(), found.end());
    if (!found.empty()) return found.front();
  }
  return "";
}

// SIGTERM/SIGINT at any time: one thread takes them (they are blocked everywhere else). While the server
// is starting, the first one ends the process at once (nothing is in flight); once serving, the first one
// starts the drain and a second one ends the process without waiting for the grace period.
class SignalWatcher {
 public:
  explicit SignalWatcher(const sigset_t& sigs) : sigs_(sigs) {
    std::thread([this] { Run(); }).detach();
  }
  void SetServing() { serving_.store(true); }
  // Blocks until the first signal once serving; returns it.
  int WaitForDrain() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [this] { return sig_ != 0; });
    return sig_;
  }

 private:
  void Run() {
    for (;;) {
      int sig = 0;
      if (sigwait(&sigs_, &sig) != 0) continue;
      if (!serving_.load()) {
        spdlog::warn("signal {} while starting: exiting", sig);
        std::_Exit(0);
      }
      std::lock_guard<std::mutex> l(mu_);
      if (sig_ != 0) {
        spdlog::warn("second signal {} while draining: exiting now", sig);
        std::_Exit(1);
      }
      sig_ = sig;
      cv_.notify_all();
    }
  }
  sigset_t sigs_;
  std::atomic<bool> serving_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int sig_ = 0;
};

// One tiny request through the whole path before readiness.
void Warmup(qkv::Engine& engine) {
  qkv::GenerateParams p;
  p.ns = "\x01warmup";
  p.prompt = {0};
  p.max_tokens = 1;
  auto st = engine.Submit(p);
  qkv::StreamEvent e;
  while (st.ok() && (*st)->Next(&e, std::chrono::seconds(120)) && !e.final) {
  }
}

// {"grpc": ADDR, "metrics": ADDR, "pid": N, "instance_id": ID}, written whole (rename) so readers never see
// half a file.
void WriteReadyFile(const std::string& path, const std::string& grpc_addr, const std::string& metrics_addr,
                    const std::string& http_addr, const std::string& instance_id) {
  const std::string tmp = path + ".tmp";
  nlohmann::json j{{"grpc", grpc_addr}, {"metrics", metrics_addr}, {"pid", getpid()}, {"instance_id", instance_id}};
  j["http"] = http_addr.empty() ? nlohmann::json(nullptr) : nlohmann::json(http_addr);
  std::ofstream(tmp) << j.dump() << "\n";
  std::filesystem::rename(tmp, path);
}

// Liveness (health service "") follows the engine thread: NOT_SERVING while it has not finished a loop
// iteration (it wakes at least every 250 ms) for timeout_s, SERVING again once it does.
class LivenessWatchdog {
 public:
  LivenessWatchdog(const qkv::Engine& engine, grpc::HealthCheckServiceInterface& health, double timeout_s)
      : thread_([this, &engine, &health, timeout_s] {
          bool live = true;
          while (running_.load()) {
            const bool now_live = engine.SecondsSinceProgress() < timeout_s;
            if (now_live != live) {
              live = now_live;
              health.SetServingStatus("", live);
              if (live) {
                spdlog::warn("engine thread progressing again: liveness SERVING");
              } else {
                spdlog::error("engine thread made no progress for {} s: liveness NOT_SERVING", timeout_s);
              }
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
          }
        }) {}
  ~LivenessWatchdog() {
    running_.store(false);
    thread_.join();
  }

 private:
  std::atomic<bool> running_{true};
  std::thread thread_;
};

// The drain: waits until nothing runs or waits, at most grace_s. Asks the engine thread, not the stats
// snapshot: a stale snapshot (taken before an in-flight request was admitted) once cancelled that request.
void WaitForIdle(qkv::Engine& engine, double grace_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (engine.RequestsInFlight() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string ReadFile(const std::string& path, bool* ok) {
  std::ifstream in(path);
  *ok = static_cast<bool>(in);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Every command-line flag (and config-file key) of qkvserve, with its default.
struct Flags {
  std::string model, tokenizer_file, listen = "127.0.0.1:50051", metrics_listen = "127.0.0.1:9464", ready_file;
  std::string weights_dtype = "auto", kv_dtype = "bf16", kv_bytes, api_keys_file, tls_cert, tls_key;
  std::string log_level = "info", chat_template, instance_id;
  std::string http_listen = "127.0.0.1:8000";
  int http_threads = 16;
  double http_session_ttl = 3600;
  int threads = 0, block_size = 16, max_batched = 512, max_seqs = 64, max_model_len = 0, default_max_tokens = 256;
  int state_slots = 0;
  int max_logit_rows = 0;
  int max_waiting = 1024;
  double drain_grace = 30;
  bool no_prefix_caching = false;
  int max_sessions_per_key = 10000, max_waiting_per_key = 0, max_running_per_key = 0;
  std::string priority_range = "0..0";
  double liveness_timeout = 60;
  qkv::RequestLimits limits;
  bool debug_accounting = false;
};

void AddFlags(CLI::App& app, Flags& f) {
  app.set_config("--config", "", "read options from a TOML/INI config file (keys are the long flag names)");
  app.add_option("--model", f.model, "GGUF model (default: $QKVSERVE_MODEL, then the bundled model)");
  app.add_option("--tokenizer", f.tokenizer_file,
                 "Hugging Face tokenizer.json to use instead of the GGUF's (byte-level BPE)");
  app.add_option("--listen", f.listen, "gRPC address; port 0 picks a free port")
      ->capture_default_str()
      ->envname("QKVSERVE_LISTEN");
  app.add_option("--metrics-listen", f.metrics_listen, "Prometheus /metrics address; port 0 picks a free port")
      ->capture_default_str()
      ->envname("QKVSERVE_METRICS_LISTEN");
  app.add_option("--http-listen", f.http_listen,
                 "OpenAI-style HTTP API address (docs/http.md); port 0 picks a free port; empty turns it off")
      ->capture_default_str()
      ->envname("QKVSERVE_HTTP_LISTEN");
  app.add_option("--http-threads", f.http_threads,
                 "HTTP requests served at once (an open stream holds one); more wait in the connection queue")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--http-session-ttl-seconds", f.http_session_ttl,
                 "idle time after which a session created by an HTTP x-session-id header expires (0: never)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 315360000.0));
  app.add_option("--ready-file", f.ready_file,
                 "write {\"grpc\": ADDR, \"metrics\": ADDR, \"http\": ADDR or null, \"pid\": N} here once ready");
  app.add_option(
      "--threads", f.threads,
      "compute threads (default: the CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota)");
  app.add_option("--weights-dtype", f.weights_dtype,
                 "auto (quantized tensors stay quantized, others bf16), bf16 or f32")
      ->capture_default_str();
  app.add_option("--kv-dtype", f.kv_dtype,
                 "KV cache element type: bf16, f32 or int8 (int8: a bf16 scale per token and kv head)")
      ->capture_default_str();
  app.add_option("--kv-cache-bytes", f.kv_bytes,
                 "KV cache budget, e.g. 512MiB (default: a quarter of available memory after the weights, at most 8 "
                 "GiB and 256 full contexts)");
  app.add_option(
         "--state-slots", f.state_slots,
         "per-sequence state slots for models with Gated DeltaNet layers (qwen35), from the KV budget (default: "
         "up to half of it, 1..64 slots; each running request and resident session holds one; a quarter as many "
         "prefix snapshots come on top)")
      ->check(CLI::Range(0, 65536));
  app.add_option("--block-size", f.block_size, "tokens per KV block")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--max-num-batched-tokens", f.max_batched, "tokens per engine step")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  app.add_option("--max-num-seqs", f.max_seqs, "sequences per engine step")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--max-logit-rows", f.max_logit_rows,
                 "rows of logits one step may hold: a sequence takes one, a prompt-logprobs chunk one per token "
                 "(0: max(--max-num-seqs, 128), at most --max-num-batched-tokens)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65536));
  app.add_option("--max-model-len", f.max_model_len, "context limit (default: the model's)")
      ->check(CLI::Range(0, 1 << 22));
  app.add_option("--max-waiting", f.max_waiting, "queued requests before RESOURCE_EXHAUSTED")->capture_default_str();
  app.add_option("--default-max-tokens", f.default_max_tokens, "max_tokens when a request gives none")
      ->capture_default_str();
  app.add_flag("--no-prefix-caching", f.no_prefix_caching, "do not reuse KV blocks across requests by content");
  app.add_option("--api-keys", f.api_keys_file,
                 "file with one API key per line; then every call needs 'authorization: Bearer <key>'");
  app.add_option("--tls-cert", f.tls_cert, "PEM certificate chain (TLS)");
  app.add_option("--tls-key", f.tls_key, "PEM private key (TLS)");
  app.add_option("--chat-template", f.chat_template, "plain, chatml or llama3 (default: detected from the model)");
  app.add_option("--instance-id", f.instance_id, "names this replica in GetModelInfo (default: hostname-pid)");
  app.add_option("--drain-grace-seconds", f.drain_grace, "on SIGTERM/SIGINT, time in-flight requests get to finish")
      ->capture_default_str();
  app.add_option("--log-level", f.log_level, "trace, debug, info, warn, error")->capture_default_str();
  app.add_option("--max-sessions-per-key", f.max_sessions_per_key, "sessions one API key may hold (forks count)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-waiting-per-key", f.max_waiting_per_key, "queued requests per key (default: --max-waiting)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-running-per-key", f.max_running_per_key,
                 "sequences of one key in the running batch (default: --max-num-seqs)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--priority-range", f.priority_range, "LO..HI: the request priorities every key may use")
      ->capture_default_str();
  app.add_option("--liveness-timeout-seconds", f.liveness_timeout,
                 "liveness (health service \"\") turns NOT_SERVING when the engine thread makes no progress this long")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--debug-accounting", f.debug_accounting,
               "serve /debug/accounting on the metrics port: the engine's block and state accounting check (tests)");
  qkv::RequestLimits& l = f.limits;
  app.add_option("--max-prompt-bytes", l.max_prompt_bytes, "bytes of prompt text (or of all messages)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-prompt-tokens", l.max_prompt_tokens, "prompt tokens (0: the context length)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-messages", l.max_messages, "chat messages per request")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-stop-strings", l.max_stop_strings, "stop strings per request")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-stop-bytes", l.max_stop_bytes, "bytes of all stop strings of a request")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-stop-token-ids", l.max_stop_token_ids, "stop token ids per request")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

// The model's load options from the flags; the error names the flag.
qkv::StatusOr<qkv::ModelOptions> ModelOptionsFrom(const Flags& f) {
  qkv::ModelOptions mo;
  auto wd = qkv::ParseWeightsMode(f.weights_dtype);
  if (!wd.ok()) return qkv::InvalidArgument("--weights-dtype: " + wd.status().message());
  auto kd = qkv::ParseKvDType(f.kv_dtype);
  if (!kd.ok()) return qkv::InvalidArgument("--kv-dtype: " + kd.status().message());
  mo.tokenizer_path = f.tokenizer_file;
  mo.weights_dtype = wd->dtype;
  mo.keep_quantized = wd->keep_quantized;
  mo.kv_dtype = *kd;
  mo.n_threads = qkv::ComputeThreads(f.threads);
  mo.max_batch_tokens = f.max_batched;
  // Logits are rows × vocab floats (65.5 MB for 512 rows of 32,000, 311 MB of 152,000): a step wants one row
  // per sequence, and only prompt logprobs want more, so 128 rows serve it at the same GEMM tile.
  mo.max_logit_rows = f.max_logit_rows > 0 ? f.max_logit_rows : std::min(f.max_batched, std::max(f.max_seqs, 128));
  if (mo.max_logit_rows > f.max_batched || mo.max_logit_rows < std::min(f.max_seqs, f.max_batched)) {
    return qkv::InvalidArgument(
        "--max-logit-rows must be in min(--max-num-seqs, --max-num-batched-tokens)..--max-num-"
        "batched-tokens (" +
        std::to_string(std::min(f.max_seqs, f.max_batched)) + ".." + std::to_string(f.max_batched) + ")");
  }
  mo.max_context = f.max_model_len;
  mo.block_size = f.block_size;
  mo.state_slots = f.state_slots;
  mo.kv_cache_bytes = qkv::ModelOptions::kAutoKvBytes;
  if (!f.kv_bytes.empty()) {
    auto b = qkv::ParseByteSize(f.kv_bytes);
    if (!b.ok()) return qkv::InvalidArgument("--kv-cache-bytes: " + b.status().message());
    mo.kv_cache_bytes = *b;
  }
  return mo;
}

// The default per-key quota from the flags and, with --api-keys, the keys and their own quotas.
qkv::Status LoadQuotas(const Flags& f, qkv::TenantQuota* quota, std::set<std::string>* keys,
                       std::map<std::string, qkv::TenantQuota>* key_quotas) {
  quota->max_sessions = f.max_sessions_per_key;
  quota->max_waiting = f.max_waiting_per_key > 0 ? f.max_waiting_per_key : f.max_waiting;
  quota->max_running = f.max_running_per_key > 0 ? f.max_running_per_key : f.max_seqs;
  if (auto st = qkv::server::ParsePriorityRange(f.priority_range, &quota->min_priority, &quota->max_priority);
      !st.ok()) {
    return qkv::InvalidArgument("--priority-range: " + st.message());
  }
  if (f.api_keys_file.empty()) return {};
  std::ifstream in(f.api_keys_file);
  if (!in) return qkv::InvalidArgument("--api-keys: cannot read '" + f.api_keys_file + "'");
  auto parsed = qkv::server::ParseApiKeys(in, *quota);
  if (!parsed.ok()) return qkv::InvalidArgument("--api-keys: " + parsed.status().message());
  *key_quotas = std::move(*parsed);
  for (const auto& [k, q] : *key_quotas) keys->insert(k);
  if (keys->empty()) return qkv::InvalidArgument("--api-keys: '" + f.api_keys_file + "' holds no key");
  return {};
}

// The chat template: --chat-template if given, else detected from the GGUF's Jinja template.
qkv::StatusOr<qkv::ChatTemplateKind> ChatTemplateFor(const Flags& f, const std::string& model) {
  if (!f.chat_template.empty()) {
    auto t = qkv::ParseChatTemplate(f.chat_template);
    if (!t.ok()) return qkv::InvalidArgument("--chat-template: " + t.status().message());
    return *t;
  }
  std::string jinja;
  if (auto g = qkv::GgufFile::Open(model); g.ok()) jinja = (*g)->GetStringOr("tokenizer.chat_template", "");
  return qkv::DetectChatTemplate(jinja);
}

// The chat stop strings the model file declares (qkvserve.chat.stop).
qkv::StatusOr<std::vector<std::string>> ChatStopFor(const std::string& model) {
  QKV_ASSIGN_OR_RETURN(auto g, qkv::GgufFile::Open(model));
  return qkv::ChatStopStrings(*g);
}

// Builds and starts the gRPC server (TLS if configured); *port gets the port it listens on.
// The largest request message gRPC accepts: room for the largest valid request (a prompt of
// --max-prompt-bytes with stop strings, or token ids filling the context at 5 bytes each) and no more, so
// an oversized message is refused (RESOURCE_EXHAUSTED) before it is parsed into memory.
int MaxRequestBytes(const Flags& f, int max_context) {
  const int64_t text = 2 * f.limits.max_prompt_bytes + f.limits.max_stop_bytes;
  const int64_t ids = 5 * int64_t{max_context} + 5 * int64_t{f.limits.max_stop_token_ids};
  return static_cast<int>(std::min<int64_t>(std::max(text, ids) + (1 << 20), INT32_MAX));
}

qkv::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc(const Flags& f, grpc::Service& service, int max_request_bytes,
                                                       int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!f.tls_cert.empty() || !f.tls_key.empty()) {
    bool ok1 = false, ok2 = false;
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({ReadFile(f.tls_key, &ok1), ReadFile(f.tls_cert, &ok2)});
    if (!ok1 || !ok2) return qkv::InvalidArgument("--tls-cert and --tls-key must both be readable files");
    creds = grpc::SslServerCredentials(ssl);
  }
  builder.AddListeningPort(f.listen, creds, port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(max_request_bytes);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *port == 0) return qkv::FailedPrecondition("cannot listen on --listen " + f.listen);
  return server;
}

std::string WithPort(const std::string& addr, int port) {
  return addr.substr(0, addr.rfind(':')) + ":" + std::to_string(port);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkvserve: LLM inference over gRPC on CPUs (sessions, paged KV cache, continuous batching)"};
  Flags f;
  AddFlags(app, f);
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::from_str(f.log_level));

  // SIGTERM/SIGINT are taken by the watcher thread; block them before any other thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  // Never destroyed: its detached thread may still wake up while the process exits.
  SignalWatcher& signals = *new SignalWatcher(sigs);

  if (f.model.empty()) {
    std::vector<std::string> looked;
    f.model = ResolveDefaultModel(&looked);
    if (f.model.empty()) {
      std::string where;
      for (const auto& l : looked) where += " " + l;
      return Fail("no --model given, $QKVSERVE_MODEL is unset and no bundled model was found in:" + where);
    }
  }
  auto mo = ModelOptionsFrom(f);
  if (!mo.ok()) return Fail(mo.status().message());
  omp_set_num_threads(mo->n_threads);
  qkv::TenantQuota quota;  // every key's, unless its line in the key file says otherwise
  std::set<std::string> keys;
  std::map<std::string, qkv::TenantQuota> key_quotas;
  if (auto st = LoadQuotas(f, &quota, &keys, &key_quotas); !st.ok()) return Fail(st.message());

  spdlog::info("loading {}", f.model);
  auto loaded = qkv::Model::Load(f.model, *mo);
  if (!loaded.ok()) return Fail(loaded.status().ToString());
  qkv::Model& m = **loaded;
  auto tmpl = ChatTemplateFor(f, f.model);
  if (!tmpl.ok()) return Fail(tmpl.status().message());
  auto chat_stop = ChatStopFor(f.model);
  if (!chat_stop.ok()) return Fail(chat_stop.status().ToString());
  const auto& kvs = m.cache_layout().tokens;
  spdlog::info(
      "model {}: {}; weights {:.1f} MB; KV {} per token ({}), capacity {} blocks = {} tokens = {:.1f} MiB = "
      "{} full contexts of {} tokens",
      std::filesystem::path(f.model).filename().string(), m.config().Summary(), m.weight_bytes() / 1e6,
      kvs.bytes_per_token(), qkv::DTypeName(kvs.dtype), kvs.n_blocks, kvs.n_blocks * kvs.block_size,
      m.cache_layout().token_bytes() / 1048576.0,
      kvs.n_blocks * kvs.block_size / std::max<int64_t>(1, m.config().context_length), m.config().context_length);

  qkv::EngineOptions eo;
  eo.max_num_batched_tokens = f.max_batched;
  eo.max_num_seqs = f.max_seqs;
  eo.prefix_caching = !f.no_prefix_caching;
  eo.default_max_tokens = f.default_max_tokens;
  eo.max_waiting = f.max_waiting;
  eo.default_quota = quota;
  eo.quotas = key_quotas;
  auto engine = qkv::Engine::Create(m, eo);
  if (!engine.ok()) return Fail(engine.status().ToString());

  if (f.instance_id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    f.instance_id = std::string(host) + "-" + std::to_string(getpid());
  }
  qkv::server::ServiceOptions so;
  so.api_keys = keys;
  so.instance_id = f.instance_id;
  so.chat_template = *tmpl;
  so.chat_stop = *chat_stop;
  so.model_name = std::filesystem::path(f.model).stem().string();
  so.limits = f.limits;
  qkv::server::InferenceService service(**engine, so);
  int port = 0;
  const int max_request_bytes = MaxRequestBytes(f, m.max_context());
  spdlog::info("requests up to {:.1f} MiB (from --max-prompt-bytes and the context)", max_request_bytes / 1048576.0);
  auto server = StartGrpc(f, service, max_request_bytes, &port);
  if (!server.ok()) return Fail(server.status().message());
  auto* health = (*server)->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kService, false);

  std::unique_ptr<qkv::server::HttpServer> http;
  if (!f.http_listen.empty()) {
    qkv::server::HttpOptions ho;
    ho.listen = f.http_listen;
    ho.threads = f.http_threads;
    ho.tls_cert = f.tls_cert;
    ho.tls_key = f.tls_key;
    ho.session_ttl_s = f.http_session_ttl;
    // JSON escapes a byte in at most 6 (\u00XX): room for the largest prompt, stop strings and token ids.
    ho.max_body_bytes = 6 * int64_t{max_request_bytes};
    auto started = qkv::server::HttpServer::Start(ho, service);
    if (!started.ok()) return Fail(started.status().message());
    http = std::move(*started);
  }

  auto metrics = qkv::server::MetricsServer::Start(f.metrics_listen, **engine, so.model_name,
                                                   f.debug_accounting ? engine->get() : nullptr);
  if (!metrics.ok()) return Fail(metrics.status().message());

  Warmup(**engine);
  health->SetServingStatus(kService, true);
  const std::string grpc_addr = WithPort(f.listen, port);
  const std::string metrics_addr = WithPort(f.metrics_listen, (*metrics)->port());
  const std::string http_addr = http ? WithPort(f.http_listen, http->port()) : "";
  spdlog::info("ready: gRPC on {}, metrics on http://{}/metrics, HTTP API {}, instance {}", grpc_addr, metrics_addr,
               http ? (http->tls() ? "on https://" : "on http://") + http_addr : std::string("off"), f.instance_id);
  if (!f.ready_file.empty()) WriteReadyFile(f.ready_file, grpc_addr, metrics_addr, http_addr, f.instance_id);

  signals.SetServing();
  auto watchdog = std::make_unique<LivenessWatchdog>(**engine, *health, f.liveness_timeout);
  const int sig = signals.WaitForDrain();
  spdlog::info("signal {}: draining (readiness NOT_SERVING, new requests refused, {} s grace)", sig, f.drain_grace);
  service.StartDraining();
  health->SetServingStatus(kService, false);
  WaitForIdle(**engine, f.drain_grace);
  watchdog.reset();
  (*engine)->Shutdown();  // cancels whatever is still running
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  (*server)->Wait();
  http.reset();  // waits for its handlers, which end with the engine's requests
  // Dependency order: the metrics exposer reads the engine, so it stops first.
  metrics->reset();
  engine->reset();
  spdlog::info("stopped");
  return 0;
}
