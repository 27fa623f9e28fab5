// qkvctl: the command-line client for qkvserve.
// Address and key come from --addr / --api-key or $QKVSERVE_ADDR / $QKVSERVE_API_KEY. Human-readable output
// by default, --json for scripts. Calls about a session send its affinity key as the x-session-id header
// (a session id up to its first '.'; qkvctl names forks "<parent-root>.<suffix>"), so a load balancer
// that hashes on the header keeps a session and its forks on one replica.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "engine/capacity_plan.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "qkvserve/v1/inference.grpc.pb.h"

namespace pb = qkvserve::v1;
using nlohmann::json;

namespace {

struct Common {
  std::string addr = "127.0.0.1:50051";
  std::string api_key;
  bool json_out = false;
  bool tls = false;
  double timeout_s = 0;
};

std::string Env(const char* name, const std::string& dflt) {
  const char* v = std::getenv(name);
  return v && *v ? v : dflt;
}

std::string RandomId(const char* prefix) {
  std::random_device rd;
  std::mt19937_64 rng((static_cast<uint64_t>(rd()) << 32) ^ rd());
  static const char* hex = "0123456789abcdef";
  std::string s = prefix;
  for (int i = 0; i < 12; ++i) s += hex[rng() % 16];
  return s;
}

std::string AffinityOf(const std::string& session_id) { return session_id.substr(0, session_id.find('.')); }

std::shared_ptr<grpc::Channel> Connect(const Common& c) {
  auto creds = c.tls ? grpc::SslCredentials(grpc::SslCredentialsOptions()) : grpc::InsecureChannelCredentials();
  return grpc::CreateChannel(c.addr, creds);
}

void Prepare(const Common& c, grpc::ClientContext& ctx, const std::string& session = "") {
  if (!c.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + c.api_key);
  if (!session.empty()) ctx.AddMetadata("x-session-id", AffinityOf(session));
  if (c.timeout_s > 0) {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(c.timeout_s * 1000)));
  }
}

int Report(const grpc::Status& s) {
  if (s.ok()) return 0;
  std::fprintf(
      stderr, "qkvctl: %s: %s\n",
      [&] {
        switch (s.error_code()) {
          case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
          case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
          case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
          case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
          case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
          case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
          case grpc::StatusCode::CANCELLED: return "CANCELLED";
          case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
          case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
          default: return "ERROR";
        }
      }(),
      s.error_message().c_str());
  return 1;
}

json SessionJson(const pb::Session& s) {
  json j = {{"session_id", s.session_id()},
            {"affinity_key", s.affinity_key()},
            {"num_tokens", s.num_tokens()},
            {"cached_tokens", s.cached_tokens()},
            {"resident_bytes", s.resident_bytes()},
            {"resident_blocks", s.resident_blocks()},
            {"state", s.state()},
            {"busy", s.busy()},
            {"ttl_seconds", s.ttl_seconds()},
            {"priority", s.priority()},
            {"overflow",
             {{"policy", s.overflow().policy() == pb::ContextOverflow::OVERFLOW_DROP_OLDEST ? "drop_oldest" : "error"},
              {"keep_tokens", s.overflow().keep_tokens()}}},
            {"dropped_tokens", s.dropped_tokens()}};
  if (s.token_ids_size()) j["token_ids"] = std::vector<int>(s.token_ids().begin(), s.token_ids().end());
  return j;
}

void PrintSession(const Common& c, const pb::Session& s) {
  if (c.json_out) {
    std::cout << SessionJson(s).dump() << "\n";
  } else {
    std::printf("%-24s %-8s tokens %-6d cached %-6d resident %lld B (%lld blocks)%s affinity %s%s\n",
                s.session_id().c_str(), s.state().c_str(), s.num_tokens(), s.cached_tokens(),
                static_cast<long long>(s.resident_bytes()), static_cast<long long>(s.resident_blocks()),
                s.busy() ? " busy" : "", s.affinity_key().c_str(),
                s.overflow().policy() == pb::ContextOverflow::OVERFLOW_DROP_OLDEST
                    ? (" drop_oldest (keep " + std::to_string(s.overflow().keep_tokens()) + ", dropped " +
                       std::to_string(s.dropped_tokens()) + ")")
                          .c_str()
                    : "");
  }
}

struct GenOpts {
  std::string prompt, tokens, session, request_id;
  int max_tokens = 0;
  double temperature = -1, top_p = -1, min_p = -1, rep = -1;
  int top_k = -2;
  int64_t seed = -1;
  std::vector<std::string> stop;
  bool ignore_eos = false, parse_special = false;
};

void FillSampling(const GenOpts& g, pb::GenerateRequest& r) {
  if (g.max_tokens > 0) r.set_max_tokens(g.max_tokens);
  if (g.temperature >= 0) r.set_temperature(static_cast<float>(g.temperature));
  if (g.top_p >= 0) r.set_top_p(static_cast<float>(g.top_p));
  if (g.min_p >= 0) r.set_min_p(static_cast<float>(g.min_p));
  if (g.rep >= 0) r.set_repetition_penalty(static_cast<float>(g.rep));
  if (g.top_k >= -1) r.set_top_k(g.top_k);
  if (g.seed >= 0) r.set_seed(static_cast<uint64_t>(g.seed));
  for (const auto& s : g.stop) r.add_stop(s);
  r.set_ignore_eos(g.ignore_eos);
  r.set_parse_special(g.parse_special);
  if (!g.session.empty()) r.set_session_id(g.session);
  if (!g.request_id.empty()) r.set_request_id(g.request_id);
}

// Streams one request; prints text as it arrives (or one JSON object at the end). Returns the exit code.
int Stream(const Common& c, pb::Inference::Stub& stub, const pb::GenerateRequest& req, std::string* reply = nullptr,
           pb::Usage* usage_out = nullptr) {
  grpc::ClientContext ctx;
  Prepare(c, ctx, req.session_id());
  auto reader = stub.Generate(&ctx, req);
  pb::GenerateResponse r;
  std::string text, request_id, finish, stop_reason;
  std::vector<int> ids;
  pb::Usage usage;
  while (reader->Read(&r)) {
    if (!r.request_id().empty()) request_id = r.request_id();
    text += r.text();
    ids.insert(ids.end(), r.token_ids().begin(), r.token_ids().end());
    if (!c.json_out) {
      std::cout << r.text() << std::flush;
    }
    if (!r.finish_reason().empty()) {
      finish = r.finish_reason();
      stop_reason = r.stop_reason();
      usage = r.usage();
    }
  }
  const grpc::Status s = reader->Finish();
  if (reply) *reply = text;
  if (usage_out) *usage_out = usage;
  if (!s.ok()) {
    if (!c.json_out) std::cout << "\n" << std::flush;
    return Report(s);
  }
  if (c.json_out) {
    std::cout << json{{"request_id", request_id},
                      {"text", text},
                      {"token_ids", ids},
                      {"finish_reason", finish},
                      {"stop_reason", stop_reason},
                      {"usage",
                       {{"prompt_tokens", usage.prompt_tokens()},
                        {"cached_tokens", usage.cached_tokens()},
                        {"completion_tokens", usage.completion_tokens()},
                        {"dropped_tokens", usage.dropped_tokens()}}}}
                     .dump(-1, ' ', false, json::error_handler_t::replace)
              << "\n";
  } else if (!reply) {
    std::cout << "\n" << std::flush;  // before the summary on stderr, also when piped
    const std::string dropped =
        usage.dropped_tokens() ? ", " + std::to_string(usage.dropped_tokens()) + " tokens of history dropped" : "";
    // The stop reason quoted as JSON: a stop string may be a newline.
    const std::string why =
        stop_reason.empty() ? "" : ": " + json(stop_reason).dump(-1, ' ', false, json::error_handler_t::replace);
    std::fprintf(stderr, "[%s%s; prompt %d tokens (%d cached), %d generated%s]\n", finish.c_str(), why.c_str(),
                 usage.prompt_tokens(), usage.cached_tokens(), usage.completion_tokens(), dropped.c_str());
  }
  return 0;
}

void AddGenOptions(CLI::App* app, GenOpts& g) {
  app->add_option("--max-tokens,-n", g.max_tokens, "tokens to generate (default: the server's)");
  app->add_option("--temperature", g.temperature, "sampling temperature (0 = greedy; default 1.0)");
  app->add_option("--top-p", g.top_p, "top-p");
  app->add_option("--top-k", g.top_k, "top-k");
  app->add_option("--min-p", g.min_p, "min-p");
  app->add_option("--repetition-penalty", g.rep, "repetition penalty");
  app->add_option("--seed", g.seed, "sampling seed");
  app->add_option("--stop", g.stop, "stop string (repeatable)");
  app->add_flag("--ignore-eos", g.ignore_eos, "keep generating after EOS");
}

}  // namespace

// The session subcommands' arguments.
struct SessionArgs {
  enum Cmd { kCreate, kList, kShow, kFork, kTruncate, kClose } cmd;
  std::string sid, child;
  double ttl = 0;
  int priority = 0, ntok = 0;
  bool with_tokens = false;
};

int PlanCmd(const Common& c, const std::string& plan_config, const std::string& plan_memory,
            const std::string& plan_dtype, int64_t plan_context) {
  std::ifstream in(plan_config);
  if (!in) {
    std::fprintf(stderr, "qkvctl: cannot read --config '%s'\n", plan_config.c_str());
    return 2;
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto mem = qkv::ParseByteSize(plan_memory);
  auto el = qkv::ParseKvElement(plan_dtype);
  if (!mem.ok() || !el.ok()) {
    std::fprintf(stderr, "qkvctl: %s\n",
                 (!mem.ok() ? "--memory: " + mem.status().message() : el.status().message()).c_str());
    return 2;
  }
  auto p = qkv::PlanCapacity(text, *mem, plan_context, *el);
  if (!p.ok()) {
    std::fprintf(stderr, "qkvctl: %s\n", p.status().message().c_str());
    return 2;
  }
  std::cout << (c.json_out ? p->ToJson() + "\n" : p->ToText());
  return 0;
}

int GenerateCmd(const Common& c, pb::Inference::Stub& stub, const GenOpts& g) {
  pb::GenerateRequest req;
  if (!g.tokens.empty()) {
    std::stringstream ss(g.tokens);
    std::string item;
    while (std::getline(ss, item, ',')) {
      try {
        req.mutable_token_ids()->add_ids(std::stoi(item));
      } catch (...) {
        std::fprintf(stderr, "qkvctl: --tokens: '%s' is not a token id\n", item.c_str());
        return 2;
      }
    }
  } else {
    req.set_text(g.prompt);
  }
  FillSampling(g, req);
  return Stream(c, stub, req);
}

// Each turn asks for drop_oldest, so that the chat keeps going past the context: the oldest history goes
// (whole KV blocks), except the first turn's prompt when it carries a system message on a session of our
// own. Replies stop at EOS, at --stop strings (default: those the model file declares), or after -n tokens
// (default 128).
int ChatCmd(const Common& c, pb::Inference::Stub& stub, GenOpts chat_g, const std::string& system_prompt) {
  if (chat_g.max_tokens <= 0) chat_g.max_tokens = 128;
  if (chat_g.stop.empty()) {  // the model file's chat stop strings (GetModelInfo.chat_stop)
    grpc::ClientContext ctx;
    Prepare(c, ctx, "");
    pb::ModelInfo info;
    if (int rc = Report(stub.GetModelInfo(&ctx, pb::GetModelInfoRequest(), &info))) return rc;
    chat_g.stop.assign(info.chat_stop().begin(), info.chat_stop().end());
  }
  int keep = 0;
  bool own = chat_g.session.empty();
  if (own) {
    chat_g.session = RandomId("chat-");
    grpc::ClientContext ctx;
    Prepare(c, ctx, chat_g.session);
    pb::CreateSessionRequest r;
    r.set_session_id(chat_g.session);
    pb::Session out;
    if (int rc = Report(stub.CreateSession(&ctx, r, &out))) return rc;
  }
  std::fprintf(stderr, "session %s; type a message, Ctrl-D to end\n", chat_g.session.c_str());
  std::string line;
  bool first = true;
  while (std::fprintf(stderr, "> "), std::getline(std::cin, line)) {
    if (line.empty()) continue;
    pb::GenerateRequest req;
    if (first && !system_prompt.empty()) {
      auto* m = req.mutable_messages()->add_messages();
      m->set_role("system");
      m->set_content(system_prompt);
    }
    auto* m = req.mutable_messages()->add_messages();
    m->set_role("user");
    m->set_content(line);
    FillSampling(chat_g, req);
    req.mutable_overflow()->set_policy(pb::ContextOverflow::OVERFLOW_DROP_OLDEST);
    req.mutable_overflow()->set_keep_tokens(keep);
    pb::Usage usage;
    if (int rc = Stream(c, stub, req, nullptr, &usage); rc != 0) return rc;
    if (first && own && !system_prompt.empty()) keep = usage.prompt_tokens();
    first = false;
  }
  if (own) {
    grpc::ClientContext ctx;
    Prepare(c, ctx, chat_g.session);
    pb::CloseSessionRequest r;
    r.set_session_id(chat_g.session);
    pb::CloseSessionResponse out;
    stub.CloseSession(&ctx, r, &out);
  }
  return 0;
}

int SessionCmd(const Common& c, pb::Inference::Stub& stub, const SessionArgs& a) {
  std::string sid = a.sid;
  const std::string& child = a.child;
  const double ttl = a.ttl;
  const int priority = a.priority, ntok = a.ntok;
  const bool with_tokens = a.with_tokens;
  grpc::ClientContext ctx;
  pb::Session out;
  if (a.cmd == SessionArgs::kCreate) {
    if (sid.empty()) sid = RandomId("s-");
    Prepare(c, ctx, sid);
    pb::CreateSessionRequest r;
    r.set_session_id(sid);
    r.set_ttl_seconds(ttl);
    r.set_priority(priority);
    if (int rc = Report(stub.CreateSession(&ctx, r, &out))) return rc;
    PrintSession(c, out);
  } else if (a.cmd == SessionArgs::kList) {
    Prepare(c, ctx);
    pb::ListSessionsResponse resp;
    if (int rc = Report(stub.ListSessions(&ctx, pb::ListSessionsRequest(), &resp))) return rc;
    if (c.json_out) {
      json arr = json::array();
      for (const auto& s : resp.sessions()) arr.push_back(SessionJson(s));
      std::cout << arr.dump() << "\n";
    } else {
      for (const auto& s : resp.sessions()) PrintSession(c, s);
    }
  } else if (a.cmd == SessionArgs::kShow) {
    Prepare(c, ctx, sid);
    pb::GetSessionRequest r;
    r.set_session_id(sid);
    r.set_include_token_ids(with_tokens);
    if (int rc = Report(stub.GetSession(&ctx, r, &out))) return rc;
    PrintSession(c, out);
    if (with_tokens && !c.json_out) {
      for (int t : out.token_ids()) std::printf("%d ", t);
      std::printf("\n");
    }
  } else if (a.cmd == SessionArgs::kFork) {
    Prepare(c, ctx, sid);
    pb::ForkSessionRequest r;
    r.set_session_id(sid);
    r.set_child_session_id(child.empty() ? AffinityOf(sid) + "." + RandomId("") : child);
    if (int rc = Report(stub.ForkSession(&ctx, r, &out))) return rc;
    PrintSession(c, out);
  } else if (a.cmd == SessionArgs::kTruncate) {
    Prepare(c, ctx, sid);
    pb::TruncateSessionRequest r;
    r.set_session_id(sid);
    r.set_num_tokens(ntok);
    if (int rc = Report(stub.TruncateSession(&ctx, r, &out))) return rc;
    PrintSession(c, out);
  } else if (a.cmd == SessionArgs::kClose) {
    Prepare(c, ctx, sid);
    pb::CloseSessionRequest r;
    r.set_session_id(sid);
    pb::CloseSessionResponse resp;
    if (int rc = Report(stub.CloseSession(&ctx, r, &resp))) return rc;
    if (c.json_out)
      std::cout << json{{"closed", sid}}.dump() << "\n";
    else
      std::printf("closed %s\n", sid.c_str());
  }
  return 0;
}

int TokenizeCmd(const Common& c, pb::Inference::Stub& stub, const std::string& text, bool parse_special) {
  grpc::ClientContext ctx;
  Prepare(c, ctx);
  pb::TokenizeRequest r;
  r.set_text(text);
  r.set_parse_special(parse_special);
  pb::TokenizeResponse resp;
  if (int rc = Report(stub.Tokenize(&ctx, r, &resp))) return rc;
  std::cout << json(std::vector<int>(resp.token_ids().begin(), resp.token_ids().end())).dump() << "\n";
  return 0;
}

int InfoCmd(const Common& c, pb::Inference::Stub& stub) {
  grpc::ClientContext ctx;
  Prepare(c, ctx);
  pb::ModelInfo m;
  if (int rc = Report(stub.GetModelInfo(&ctx, pb::GetModelInfoRequest(), &m))) return rc;
  json j = {{"architecture", m.architecture()},
            {"name", m.name()},
            {"hidden_size", m.hidden_size()},
            {"num_layers", m.num_layers()},
            {"num_heads", m.num_heads()},
            {"num_kv_heads", m.num_kv_heads()},
            {"head_dim", m.head_dim()},
            {"attention", m.attention()},
            {"vocab_size", m.vocab_size()},
            {"kv_bytes_per_token", m.kv_bytes_per_token()},
            {"context_length", m.context_length()},
            {"kv_cache_tokens", m.kv_cache_tokens()},
            {"kv_cache_bytes", m.kv_cache_bytes()},
            {"block_size", m.block_size()},
            {"weights_dtype", m.weights_dtype()},
            {"kv_dtype", m.kv_dtype()},
            {"cpu_isa", m.cpu_isa()},
            {"compute_dtype", m.compute_dtype()},
            {"gemm", m.gemm()},
            {"instance_id", m.instance_id()},
            {"chat_template", m.chat_template()},
            {"eos_token_id", m.eos_token_id()},
            {"eog_token_ids", std::vector<int>(m.eog_token_ids().begin(), m.eog_token_ids().end())},
            {"chat_stop", std::vector<std::string>(m.chat_stop().begin(), m.chat_stop().end())},
            {"rope_scaling", m.rope_scaling()},
            {"num_parameters", m.num_parameters()},
            {"active_parameters", m.active_parameters()},
            {"weight_bytes_per_token", m.weight_bytes_per_token()}};
  if (m.num_experts() > 0) {
    j["num_experts"] = m.num_experts();
    j["experts_per_token"] = m.experts_per_token();
  }
  if (m.rope_scaling() != "none") {
    j["rope_scaling_factor"] = m.rope_scaling_factor();
    j["rope_original_context"] = m.rope_original_context();
  }
  if (m.attention() == "MLA") {
    j["kv_lora_rank"] = m.kv_lora_rank();
    j["q_lora_rank"] = m.q_lora_rank();
    j["qk_nope_head_dim"] = m.qk_nope_head_dim();
    j["qk_rope_head_dim"] = m.qk_rope_head_dim();
    j["v_head_dim"] = m.v_head_dim();
  }
  if (c.json_out) {
    std::cout << j.dump() << "\n";
  } else {
    for (auto it = j.begin(); it != j.end(); ++it) std::cout << it.key() << ": " << it.value().dump() << "\n";
  }
  return 0;
}

int CancelCmd(const Common& c, pb::Inference::Stub& stub, const std::string& cancel_id) {
  grpc::ClientContext ctx;
  Prepare(c, ctx);
  pb::CancelRequest r;
  r.set_request_id(cancel_id);
  pb::CancelResponse resp;
  return Report(stub.Cancel(&ctx, r, &resp));
}

int StatsCmd(const Common& c, pb::Inference::Stub& stub, bool watch) {
  for (;;) {
    grpc::ClientContext ctx;
    Prepare(c, ctx);
    pb::GetStatsRequest r;
    pb::Stats st;
    if (int rc = Report(stub.GetStats(&ctx, r, &st))) return rc;
    if (c.json_out) {
      std::string js;
      google::protobuf::util::JsonPrintOptions o;
      o.always_print_primitive_fields = true;
      o.preserve_proto_field_names = true;
      (void)google::protobuf::util::MessageToJsonString(st, &js, o);
      std::cout << js << "\n";
    } else {
      if (watch) std::cout << "\x1b[H\x1b[2J";
      auto mib = [](int64_t b) { return static_cast<double>(b) / 1048576.0; };
      std::printf("KV cache  %5.1f%% used: %lld used + %lld cached + %lld free of %lld blocks (%d tokens each)\n",
                  100 * st.kv_cache_usage_ratio(), (long long)st.kv_blocks_used(), (long long)st.kv_blocks_cached(),
                  (long long)st.kv_blocks_free(), (long long)st.kv_blocks_total(), st.kv_block_size_tokens());
      std::printf("          %lld of %lld token slots hold tokens (%lld slack), %.1f of %.1f MiB\n",
                  (long long)st.kv_tokens_used(), (long long)st.kv_tokens_capacity(),
                  (long long)st.kv_cache_slack_tokens(), mib(st.kv_bytes_used()), mib(st.kv_bytes_capacity()));
      std::printf("prefix    %llu of %llu looked-up prompt tokens hit\n",
                  (unsigned long long)st.prefix_cache_hits_tokens_total(),
                  (unsigned long long)st.prefix_cache_queries_tokens_total());
      std::printf("sessions  %lld resident, %lld evicted, %.1f MiB of KV; evictions memory %llu ttl %llu closed %llu\n",
                  (long long)st.sessions_resident(), (long long)st.sessions_evicted(), mib(st.session_kv_bytes()),
                  (unsigned long long)st.session_evictions_memory_total(),
                  (unsigned long long)st.session_evictions_ttl_total(),
                  (unsigned long long)st.session_evictions_closed_total());
      std::printf(
          "requests  %lld running, %lld waiting; finished stop %llu length %llu cancelled %llu error %llu; "
          "preemptions %llu\n",
          (long long)st.requests_running(), (long long)st.requests_waiting(),
          (unsigned long long)st.requests_finished_stop_total(),
          (unsigned long long)st.requests_finished_length_total(),
          (unsigned long long)st.requests_finished_cancelled_total(),
          (unsigned long long)st.requests_finished_error_total(), (unsigned long long)st.preemptions_total());
      std::printf("tokens    prompt %llu (cached %llu), generated %llu\n", (unsigned long long)st.prompt_tokens_total(),
                  (unsigned long long)st.cached_prompt_tokens_total(), (unsigned long long)st.generated_tokens_total());
      std::printf("memory    RSS %.1f MiB = weights %.1f + kv arena %.1f + scratch %.1f + heap %.1f + other %.1f\n",
                  mib(st.resident_memory_bytes()), mib(st.memory_weights_bytes()), mib(st.memory_kv_arena_bytes()),
                  mib(st.memory_scratch_bytes()), mib(st.memory_heap_bytes()), mib(st.memory_other_bytes()));
      if (st.top_sessions_size()) std::printf("your sessions by resident bytes:\n");
      for (const auto& u : st.top_sessions()) {
        std::printf("  %-24s %-8s %8lld B %6lld blocks %7d tokens\n", u.session_id().c_str(), u.state().c_str(),
                    (long long)u.resident_bytes(), (long long)u.resident_blocks(), u.num_tokens());
      }
    }
    if (!watch) return 0;
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  return 0;
}

int HealthCmd(const Common& c, const std::shared_ptr<grpc::Channel>& channel, const std::string& health_service) {
  auto hs = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  Prepare(c, ctx);
  if (c.timeout_s <= 0) ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest r;
  r.set_service(health_service);
  grpc::health::v1::HealthCheckResponse resp;
  if (int rc = Report(hs->Check(&ctx, r, &resp))) return rc;
  const char* name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()).c_str();
  if (c.json_out)
    std::cout << json{{"service", health_service}, {"status", name}}.dump() << "\n";
  else
    std::printf("%s\n", name);
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

int main(int argc, char** argv) {
  CLI::App app{"qkvctl: command-line client for qkvserve"};
  app.require_subcommand(1);
  app.fallthrough();  // global flags (--json, --addr, ...) may also follow the subcommand
  Common c;
  c.addr = Env("QKVSERVE_ADDR", c.addr);
  c.api_key = Env("QKVSERVE_API_KEY", "");
  app.add_option("--addr", c.addr, "server address (env QKVSERVE_ADDR)")->capture_default_str();
  app.add_option("--api-key", c.api_key, "API key (env QKVSERVE_API_KEY)");
  app.add_flag("--json", c.json_out, "machine-readable output");
  app.add_flag("--tls", c.tls, "connect with TLS (system roots)");
  app.add_option("--timeout", c.timeout_s, "deadline per call in seconds (0 = none)");

  GenOpts g;
  auto* gen = app.add_subcommand("generate", "generate from a prompt, streaming the text as it arrives");
  gen->add_option("--prompt,-p", g.prompt, "prompt text");
  gen->add_option("--tokens", g.tokens, "prompt as comma-separated token ids");
  gen->add_option("--session", g.session, "append to this session");
  gen->add_option("--request-id", g.request_id, "request id (for cancel)");
  gen->add_flag("--parse-special", g.parse_special, "treat special-token text in the prompt as special tokens");
  AddGenOptions(gen, g);

  GenOpts chat_g;
  std::string system_prompt;
  auto* chat = app.add_subcommand("chat",
                                  "interactive multi-turn chat on a session (one line per turn; Ctrl-D ends); the "
                                  "oldest history is dropped when the context is full; -n defaults to 128");
  chat->add_option("--session", chat_g.session, "continue this session (default: a new one, closed at the end)");
  chat->add_option("--system", system_prompt, "system message for the first turn");
  AddGenOptions(chat, chat_g);

  auto* sess = app.add_subcommand("session", "manage sessions");
  sess->require_subcommand(1);
  sess->fallthrough();
  std::string sid, child;
  double ttl = 0;
  int priority = 0, ntok = 0;
  bool with_tokens = false;
  auto* s_create = sess->add_subcommand("create", "create a session");
  s_create->add_option("--id", sid, "session id (default: generated)");
  s_create->add_option("--ttl", ttl, "idle seconds before it is closed (0 = never)");
  s_create->add_option("--priority", priority, "priority");
  auto* s_list = sess->add_subcommand("list", "list your sessions");
  auto* s_show = sess->add_subcommand("show", "show one session");
  s_show->add_option("id", sid)->required();
  s_show->add_flag("--tokens", with_tokens, "include the token ids");
  auto* s_fork = sess->add_subcommand("fork", "fork a session (shares its KV copy-on-write)");
  s_fork->add_option("id", sid)->required();
  s_fork->add_option("--child", child, "child id (default: <parent-root>.<random>)");
  auto* s_trunc = sess->add_subcommand("truncate", "truncate a session to N tokens");
  s_trunc->add_option("id", sid)->required();
  s_trunc->add_option("n", ntok)->required();
  auto* s_close = sess->add_subcommand("close", "close a session and free its KV");
  s_close->add_option("id", sid)->required();

  std::string text;
  bool parse_special = false;
  auto* tok = app.add_subcommand("tokenize", "print the token ids of a text");
  tok->add_option("text", text)->required();
  tok->add_flag("--parse-special", parse_special, "treat special-token text as special tokens");
  auto* info = app.add_subcommand("info", "model and server information");
  std::string cancel_id;
  auto* cancel = app.add_subcommand("cancel", "cancel a request by id");
  cancel->add_option("request_id", cancel_id)->required();
  std::string health_service;
  auto* health =
      app.add_subcommand("health", "check health (exit 0 when SERVING): --service qkvserve.v1.Inference for readiness");
  health->add_option("--service", health_service, "service name (\"\" = liveness)");

  bool watch = false;
  auto* stats = app.add_subcommand("stats", "KV cache, sessions, requests and memory figures (the same as /metrics)");
  stats->add_flag("--watch", watch, "redraw once a second, like top (Ctrl-C ends)");
  auto* plan = app.add_subcommand(
      "plan", "offline: KV bytes per token and how many tokens and sessions fit (Hugging Face config.json)");
  std::string plan_config, plan_memory = "16GiB", plan_dtype = "bf16";
  int64_t plan_context = 4096;
  plan->add_option("--config", plan_config, "Hugging Face config.json")->required();
  plan->add_option("--memory", plan_memory, "memory for the KV cache")->capture_default_str();
  plan->add_option("--context", plan_context, "tokens per session")->capture_default_str();
  plan->add_option("--dtype", plan_dtype, "KV element type: bf16, f16, f32 or int8 (with its per-vector scales)")
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  if (plan->parsed()) return PlanCmd(c, plan_config, plan_memory, plan_dtype, plan_context);
  auto channel = Connect(c);
  auto stub = pb::Inference::NewStub(channel);
  if (gen->parsed()) return GenerateCmd(c, *stub, g);
  if (chat->parsed()) return ChatCmd(c, *stub, chat_g, system_prompt);
  if (sess->parsed()) {
    SessionArgs sa{SessionArgs::kClose, sid, child, ttl, priority, ntok, with_tokens};
    if (s_create->parsed()) sa.cmd = SessionArgs::kCreate;
    if (s_list->parsed()) sa.cmd = SessionArgs::kList;
    if (s_show->parsed()) sa.cmd = SessionArgs::kShow;
    if (s_fork->parsed()) sa.cmd = SessionArgs::kFork;
    if (s_trunc->parsed()) sa.cmd = SessionArgs::kTruncate;
    return SessionCmd(c, *stub, sa);
  }
  if (tok->parsed()) return TokenizeCmd(c, *stub, text, parse_special);
  if (info->parsed()) return InfoCmd(c, *stub);
  if (cancel->parsed()) return CancelCmd(c, *stub, cancel_id);
  if (stats->parsed()) return StatsCmd(c, *stub, watch);
  if (health->parsed()) return HealthCmd(c, channel, health_service);
  return 0;
}
