// qkvserve: the gRPC inference server. See `qkvserve --help` and docs/server.md.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <omp.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "engine/capacity_plan.h"
#include "server/api_keys.h"
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
                    const std::string& instance_id) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << nlohmann::json{{"grpc", grpc_addr},
                                       {"metrics", metrics_addr},
                                       {"pid", getpid()},
                                       {"instance_id", instance_id}}
                            .dump()
                     << "\n";
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

// The drain: waits until nothing runs or waits, at most grace_s.
void WaitForIdle(const qkv::Engine& engine, double grace_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  while (std::chrono::steady_clock::now() < deadline) {
    const auto s = engine.Stats();
    if (s.requests_running == 0 && s.requests_waiting == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string ReadFile(const std::string& path, bool* ok) {
  std::ifstream in(path);
  *ok = static_cast<bool>(in);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkvserve: LLM inference over gRPC on CPUs (sessions, paged KV cache, continuous batching)"};
  app.set_config("--config", "", "read options from a TOML/INI config file (keys are the long flag names)");
  std::string model, tokenizer_file, listen = "127.0.0.1:50051", metrics_listen = "127.0.0.1:9464", ready_file;
  std::string weights_dtype = "bf16", kv_dtype = "bf16", kv_bytes_s, api_keys_file, tls_cert, tls_key;
  std::string log_level = "info", chat_template_s, instance_id;
  int threads = 0, block_size = 16, max_batched = 512, max_seqs = 64, max_model_len = 0, default_max_tokens = 256;
  int max_waiting = 1024;
  double drain_grace = 30;
  bool no_prefix_caching = false;
  app.add_option("--model", model, "GGUF model (default: $QKVSERVE_MODEL, then the bundled model)");
  app.add_option("--tokenizer", tokenizer_file,
                 "Hugging Face tokenizer.json to use instead of the GGUF's (byte-level BPE)");
  app.add_option("--listen", listen, "gRPC address; port 0 picks a free port")
      ->capture_default_str()
      ->envname("QKVSERVE_LISTEN");
  app.add_option("--metrics-listen", metrics_listen, "Prometheus /metrics address; port 0 picks a free port")
      ->capture_default_str()
      ->envname("QKVSERVE_METRICS_LISTEN");
  app.add_option("--ready-file", ready_file, "write {\"grpc\": ADDR, \"metrics\": ADDR, \"pid\": N} here once ready");
  app.add_option("--threads", threads, "compute threads (default: the number of cores)");
  app.add_option("--weights-dtype", weights_dtype, "bf16 or f32")->capture_default_str();
  app.add_option("--kv-dtype", kv_dtype, "bf16 or f32")->capture_default_str();
  app.add_option("--kv-cache-bytes", kv_bytes_s,
                 "KV cache budget, e.g. 512MiB (default: a quarter of available memory after the weights, at most 8 "
                 "GiB and 1024 full contexts)");
  app.add_option("--block-size", block_size, "tokens per KV block")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--max-num-batched-tokens", max_batched, "tokens per engine step")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  app.add_option("--max-num-seqs", max_seqs, "sequences per engine step")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--max-model-len", max_model_len, "context limit (default: the model's)")
      ->check(CLI::Range(0, 1 << 22));
  app.add_option("--max-waiting", max_waiting, "queued requests before RESOURCE_EXHAUSTED")->capture_default_str();
  app.add_option("--default-max-tokens", default_max_tokens, "max_tokens when a request gives none")
      ->capture_default_str();
  app.add_flag("--no-prefix-caching", no_prefix_caching, "do not reuse KV blocks across requests by content");
  app.add_option("--api-keys", api_keys_file,
                 "file with one API key per line; then every call needs 'authorization: Bearer <key>'");
  app.add_option("--tls-cert", tls_cert, "PEM certificate chain (TLS)");
  app.add_option("--tls-key", tls_key, "PEM private key (TLS)");
  app.add_option("--chat-template", chat_template_s, "plain, chatml or llama3 (default: detected from the model)");
  app.add_option("--instance-id", instance_id, "names this replica in GetModelInfo (default: hostname-pid)");
  app.add_option("--drain-grace-seconds", drain_grace, "on SIGTERM/SIGINT, time in-flight requests get to finish")
      ->capture_default_str();
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")->capture_default_str();
  int max_sessions_per_key = 10000, max_waiting_per_key = 0, max_running_per_key = 0;
  std::string priority_range = "0..0";
  app.add_option("--max-sessions-per-key", max_sessions_per_key, "sessions one API key may hold (forks count)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-waiting-per-key", max_waiting_per_key, "queued requests per key (default: --max-waiting)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-running-per-key", max_running_per_key,
                 "sequences of one key in the running batch (default: --max-num-seqs)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--priority-range", priority_range, "LO..HI: the request priorities every key may use")
      ->capture_default_str();
  double liveness_timeout = 60;
  app.add_option("--liveness-timeout-seconds", liveness_timeout,
                 "liveness (health service \"\") turns NOT_SERVING when the engine thread makes no progress this long")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  qkv::RequestLimits limits;
  app.add_option("--max-prompt-bytes", limits.max_prompt_bytes, "bytes of prompt text (or of all messages)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-prompt-tokens", limits.max_prompt_tokens, "prompt tokens (0: the context length)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-messages", limits.max_messages, "chat messages per request")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-stop-strings", limits.max_stop_strings, "stop strings per request")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-stop-bytes", limits.max_stop_bytes, "bytes of all stop strings of a request")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-stop-token-ids", limits.max_stop_token_ids, "stop token ids per request")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::from_str(log_level));

  // SIGTERM/SIGINT are taken by the watcher thread; block them before any other thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  // Never destroyed: its detached thread may still wake up while the process exits.
  SignalWatcher& signals = *new SignalWatcher(sigs);

  if (model.empty()) {
    std::vector<std::string> looked;
    model = ResolveDefaultModel(&looked);
    if (model.empty()) {
      std::string where;
      for (const auto& l : looked) where += " " + l;
      return Fail("no --model given, $QKVSERVE_MODEL is unset and no bundled model was found in:" + where);
    }
  }
  qkv::ModelOptions mo;
  auto wd = qkv::ParseDType(weights_dtype);
  if (!wd.ok()) return Fail("--weights-dtype: " + wd.status().message());
  auto kd = qkv::ParseDType(kv_dtype);
  if (!kd.ok()) return Fail("--kv-dtype: " + kd.status().message());
  mo.tokenizer_path = tokenizer_file;
  mo.weights_dtype = *wd;
  mo.kv_dtype = *kd;
  mo.n_threads = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  mo.max_batch_tokens = max_batched;
  mo.max_context = max_model_len;
  mo.block_size = block_size;
  mo.kv_cache_bytes = qkv::ModelOptions::kAutoKvBytes;
  if (!kv_bytes_s.empty()) {
    auto b = qkv::ParseByteSize(kv_bytes_s);
    if (!b.ok()) return Fail("--kv-cache-bytes: " + b.status().message());
    mo.kv_cache_bytes = *b;
  }
  omp_set_num_threads(mo.n_threads);
  qkv::TenantQuota quota;  // every key's, unless its line in the key file says otherwise
  quota.max_sessions = max_sessions_per_key;
  quota.max_waiting = max_waiting_per_key > 0 ? max_waiting_per_key : max_waiting;
  quota.max_running = max_running_per_key > 0 ? max_running_per_key : max_seqs;
  if (auto st = qkv::server::ParsePriorityRange(priority_range, &quota.min_priority, &quota.max_priority); !st.ok()) {
    return Fail("--priority-range: " + st.message());
  }
  std::set<std::string> keys;
  std::map<std::string, qkv::TenantQuota> key_quotas;
  if (!api_keys_file.empty()) {
    std::ifstream in(api_keys_file);
    if (!in) return Fail("--api-keys: cannot read '" + api_keys_file + "'");
    auto parsed = qkv::server::ParseApiKeys(in, quota);
    if (!parsed.ok()) return Fail("--api-keys: " + parsed.status().message());
    key_quotas = std::move(*parsed);
    for (const auto& [k, q] : key_quotas) keys.insert(k);
    if (keys.empty()) return Fail("--api-keys: '" + api_keys_file + "' holds no key");
  }

  spdlog::info("loading {}", model);
  auto loaded = qkv::Model::Load(model, mo);
  if (!loaded.ok()) return Fail(loaded.status().ToString());
  qkv::Model& m = **loaded;
  std::string jinja;
  if (auto f = qkv::GgufFile::Open(model); f.ok()) jinja = (*f)->GetStringOr("tokenizer.chat_template", "");
  qkv::ChatTemplateKind tmpl = qkv::DetectChatTemplate(jinja);
  if (!chat_template_s.empty()) {
    auto t = qkv::ParseChatTemplate(chat_template_s);
    if (!t.ok()) return Fail("--chat-template: " + t.status().message());
    tmpl = *t;
  }
  const auto& kvs = m.kv().shape();
  spdlog::info(
      "model {}: {}; weights {:.1f} MB; KV {} per token, capacity {} blocks = {} tokens = {:.1f} MiB = {} sessions of "
      "4k tokens",
      std::filesystem::path(model).filename().string(), m.config().Summary(), m.weight_bytes() / 1e6,
      kvs.bytes_per_token(), kvs.n_blocks, kvs.n_blocks * kvs.block_size, m.kv().arena_bytes() / 1048576.0,
      kvs.n_blocks * kvs.block_size / 4096);

  qkv::EngineOptions eo;
  eo.max_num_batched_tokens = max_batched;
  eo.max_num_seqs = max_seqs;
  eo.prefix_caching = !no_prefix_caching;
  eo.default_max_tokens = default_max_tokens;
  eo.max_waiting = max_waiting;
  eo.default_quota = quota;
  eo.quotas = key_quotas;
  auto engine = qkv::Engine::Create(m, eo);
  if (!engine.ok()) return Fail(engine.status().ToString());

  if (instance_id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    instance_id = std::string(host) + "-" + std::to_string(getpid());
  }
  qkv::server::ServiceOptions so;
  so.api_keys = keys;
  so.instance_id = instance_id;
  so.chat_template = tmpl;
  so.model_name = std::filesystem::path(model).stem().string();
  so.limits = limits;
  qkv::server::InferenceService service(**engine, so);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!tls_cert.empty() || !tls_key.empty()) {
    bool ok1 = false, ok2 = false;
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({ReadFile(tls_key, &ok1), ReadFile(tls_cert, &ok2)});
    if (!ok1 || !ok2) return Fail("--tls-cert and --tls-key must both be readable files");
    creds = grpc::SslServerCredentials(ssl);
  }
  int port = 0;
  builder.AddListeningPort(listen, creds, &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(64 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) return Fail("cannot listen on --listen " + listen);
  auto* health = server->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kService, false);

  auto metrics = qkv::server::MetricsServer::Start(metrics_listen, **engine, so.model_name);
  if (!metrics.ok()) return Fail(metrics.status().message());

  Warmup(**engine);
  health->SetServingStatus(kService, true);
  const std::string host = listen.substr(0, listen.rfind(':'));
  const std::string grpc_addr = host + ":" + std::to_string(port);
  const std::string metrics_addr =
      metrics_listen.substr(0, metrics_listen.rfind(':')) + ":" + std::to_string((*metrics)->port());
  spdlog::info("ready: gRPC on {}, metrics on http://{}/metrics, instance {}", grpc_addr, metrics_addr, instance_id);
  if (!ready_file.empty()) WriteReadyFile(ready_file, grpc_addr, metrics_addr, instance_id);

  signals.SetServing();
  auto watchdog = std::make_unique<LivenessWatchdog>(**engine, *health, liveness_timeout);
  const int sig = signals.WaitForDrain();
  spdlog::info("signal {}: draining (readiness NOT_SERVING, new requests refused, {} s grace)", sig, drain_grace);
  service.StartDraining();
  health->SetServingStatus(kService, false);
  WaitForIdle(**engine, drain_grace);
  watchdog.reset();
  (*engine)->Shutdown();  // cancels whatever is still running
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  // Dependency order: the metrics exposer reads the engine, so it stops first.
  metrics->reset();
  engine->reset();
  spdlog::info("stopped");
  return 0;
}
