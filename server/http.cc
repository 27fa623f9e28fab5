#include "server/http.h"

#include <civetweb.h>
#include <dlfcn.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>

#include "engine/request_limits.h"
#include "server/service.h"

namespace qkv::server {
namespace pb = qkvserve::v1;
using json = nlohmann::json;

namespace {

// ----------------------------------------------------------------------------- errors

// The HTTP status and OpenAI error type of an engine/service status (docs/http.md has the table).
struct HttpStatus {
  int code;
  const char* type;
};
HttpStatus MapStatus(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange: return {400, "invalid_request_error"};
    case StatusCode::kUnauthenticated: return {401, "authentication_error"};
    case StatusCode::kNotFound: return {404, "not_found_error"};
    case StatusCode::kAlreadyExists:
    case StatusCode::kFailedPrecondition: return {409, "conflict_error"};
    case StatusCode::kResourceExhausted:
      return IsOverLimit(s) ? HttpStatus{413, "request_too_large"} : HttpStatus{429, "rate_limit_error"};
    case StatusCode::kCancelled: return {499, "cancelled"};
    case StatusCode::kUnimplemented: return {501, "not_implemented"};
    case StatusCode::kUnavailable: return {503, "service_unavailable"};
    default: return {500, "server_error"};
  }
}

json ErrorJson(const Status& s, const HttpStatus& h, const std::string& param, const std::string& code) {
  json e = {{"message", s.message()},
            {"type", h.type},
            {"param", nullptr},
            {"code", code.empty() ? Status::CodeName(s.code()) : code}};
  if (!param.empty()) e["param"] = param;
  return json{{"error", e}};
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Every response names the replica that answered (instance id), as GetModelInfo does over gRPC.
std::string g_instance;

void StartHeaders(mg_connection* c, int code, const char* content_type) {
  mg_response_header_start(c, code);
  mg_response_header_add(c, "Content-Type", content_type, -1);
  mg_response_header_add(c, "x-qkvserve-instance", g_instance.c_str(), -1);
}

void SendJson(mg_connection* c, int code, const json& j) {
  const std::string body = Dump(j);
  StartHeaders(c, code, "application/json");
  mg_response_header_add(c, "Content-Length", std::to_string(body.size()).c_str(), -1);
  mg_response_header_send(c);
  mg_write(c, body.data(), body.size());
}

int SendError(mg_connection* c, const Status& s, const std::string& param = "", const std::string& code = "") {
  const HttpStatus h = MapStatus(s);
  SendJson(c, h.code, ErrorJson(s, h, param, code));
  return h.code;
}

// The body as a JSON object, or the error to send: where the JSON breaks, or that it is not an object.
Status ParseBody(const std::string& body, json* out) {
  try {
    *out = json::parse(body);
  } catch (const json::parse_error& e) {
    return InvalidArgument("the body is not valid JSON (at byte " + std::to_string(e.byte) + ")");
  }
  if (!out->is_object()) return InvalidArgument("the body must be a JSON object");
  return Status::Ok();
}

// OpenAI's `param` for an error of the checks shared with gRPC (InferenceService::ToParams, Engine::Submit),
// whose messages start with the field they refuse ("top_p must be in (0, 1]", "messages[0].role must be
// ...", "stop strings must not be empty"): that first word when it names a field of the body, else none.
// A context overflow (the prompt and max_tokens do not fit) is OpenAI's context_length_exceeded on the
// prompt or the messages.
bool IsContextOverflow(const Status& s) { return s.message().rfind("context overflow:", 0) == 0; }
std::string ParamOf(const Status& s, const json& body) {
  const std::string& m = s.message();
  if (IsContextOverflow(s)) return body.contains("messages") ? "messages" : "prompt";
  const std::string word = m.substr(0, m.find(' '));
  const std::string base = word.substr(0, word.find_first_of("[."));
  return !base.empty() && body.contains(base) ? word : "";
}

// A request error that names its field (OpenAI's `param`).
struct FieldError {
  Status status;
  std::string param;
};
FieldError Bad(const std::string& field, const std::string& what) {
  return {InvalidArgument(field + " " + what), field};
}

// ----------------------------------------------------------------------------- JSON request fields
// Reads a JSON object's fields by name, remembering which were read, so that every other field is refused
// by name (an unsupported option must not be silently ignored).
class Fields {
 public:
  explicit Fields(const json& j) : j_(j) {}
  // The value, or nullptr when absent or null.
  const json* Get(const std::string& name) {
    seen_.insert(name);
    auto it = j_.find(name);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  std::optional<FieldError> Number(const std::string& name, std::optional<double>* out) {
    const json* v = Get(name);
    if (!v) return std::nullopt;
    if (!v->is_number()) return Bad(name, "must be a number");
    *out = v->get<double>();
    return std::nullopt;
  }
  std::optional<FieldError> Int(const std::string& name, std::optional<int64_t>* out) {
    const json* v = Get(name);
    if (!v) return std::nullopt;
    if (!v->is_number_integer()) return Bad(name, "must be an integer");
    *out = v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX
                                                                                            : v->get<int64_t>();
    return std::nullopt;
  }
  std::optional<FieldError> Bool(const std::string& name, std::optional<bool>* out) {
    const json* v = Get(name);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) return Bad(name, "must be true or false");
    *out = v->get<bool>();
    return std::nullopt;
  }
  // The first field that was not read (and is not null), as an error.
  std::optional<FieldError> Unsupported() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (!seen_.count(it.key()) && !it->is_null()) return Bad(it.key(), "is not supported by this server");
    }
    return std::nullopt;
  }

 private:
  const json& j_;
  std::set<std::string> seen_;
};

std::optional<FieldError> IntInRange(Fields& f, const std::string& name, int64_t lo, int64_t hi,
                                     std::optional<int64_t>* out) {
  if (auto e = f.Int(name, out)) return e;
  if (*out && (**out < lo || **out > hi)) {
    return Bad(name, "must be in " + std::to_string(lo) + ".." + std::to_string(hi));
  }
  return std::nullopt;
}

// ----------------------------------------------------------------------------- responses
json UsageJson(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

const char* FinishName(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    default: return "error";
  }
}

std::string Piece(const Tokenizer& tok, int id) { return tok.Decode(std::span<const int>(&id, 1)); }

json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char ch : s) b.push_back(static_cast<int>(ch));
  return b;
}

}  // namespace

// ----------------------------------------------------------------------------- the handler
struct HttpHandler {
  InferenceService& svc;
  HttpOptions opt;
  std::time_t started = std::time(nullptr);

  int Handle(mg_connection* c);
  int Health(mg_connection* c);
  int Models(mg_connection* c, const std::string& id);
  int Tokenize(mg_connection* c, const std::string& body, bool detokenize);
  int Generate(mg_connection* c, const std::string& ns, const std::string& body, bool chat);
  json ModelJson() const;
};

namespace {

// civetweb 1.15 on OpenSSL 3 needs the two libraries of server/civetweb_tls (see ssl_shim.cc) loaded before
// it opens "libssl.so" and "libcrypto.so"; they are installed in ../lib beside the binary (build/lib in a
// build tree). Loaded once, never unloaded.
Status LoadCivetwebTlsShims() {
  static const Status loaded = [] {
    std::error_code ec;
    const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) return Status(StatusCode::kInternal, "cannot find the qkvserve binary: " + ec.message());
    for (const char* part : {"crypto", "ssl"}) {
      const std::string name = std::string("libqkvserve-civetweb-") + part + ".so";
      void* h = nullptr;
      for (const auto& dir : {exe.parent_path().parent_path() / "lib", exe.parent_path()}) {
        if (std::filesystem::exists(dir / name)) {
          h = dlopen((dir / name).c_str(), RTLD_NOW | RTLD_LOCAL);
          if (!h) return FailedPrecondition(std::string("HTTP TLS: ") + dlerror());
          break;
        }
      }
      if (!h) {
        return FailedPrecondition("HTTP TLS needs " + name + " in " +
                                  (exe.parent_path().parent_path() / "lib").string() +
                                  " (installed with qkvserve; it makes Debian's civetweb work with OpenSSL 3)");
      }
    }
    return Status();
  }();
  return loaded;
}

int HandleC(mg_connection* c, void* cbdata) { return static_cast<HttpHandler*>(cbdata)->Handle(c); }

int LogMessage(const mg_connection*, const char* message) {
  spdlog::warn("http: {}", message);
  return 1;
}

// Reads the whole body; nullopt when it is larger than max (the caller answers 413).
std::optional<std::string> ReadBody(mg_connection* c, int64_t max) {
  const mg_request_info* ri = mg_get_request_info(c);
  if (ri->content_length > max) return std::nullopt;
  std::string body;
  char buf[1 << 16];
  int n;
  while ((n = mg_read(c, buf, sizeof(buf))) > 0) {
    body.append(buf, static_cast<size_t>(n));
    if (static_cast<int64_t>(body.size()) > max) return std::nullopt;
  }
  return body;
}

// One server-sent event as one HTTP chunk; false when the client is gone.
bool SendEvent(mg_connection* c, const std::string& data) {
  const std::string ev = "data: " + data + "\n\n";
  return mg_send_chunk(c, ev.data(), static_cast<unsigned>(ev.size())) > 0;
}

}  // namespace

json HttpHandler::ModelJson() const {
  const Model& m = svc.engine().model();
  return {{"id", svc.options().model_name},           {"object", "model"},
          {"created", static_cast<int64_t>(started)}, {"owned_by", "qkvserve"},
          {"max_model_len", m.max_context()},         {"architecture", ArchName(m.config().arch)}};
}

int HttpHandler::Handle(mg_connection* c) {
  const mg_request_info* ri = mg_get_request_info(c);
  const std::string method = ri->request_method ? ri->request_method : "";
  const std::string uri = ri->local_uri ? ri->local_uri : "";
  try {
    auto method_is = [&](const char* m) {
      if (method == m) return true;
      SendError(c, InvalidArgument(uri + " takes " + m + ", not " + method));
      return false;
    };
    if (uri == "/health") return method_is("GET") ? Health(c) : 405;
    auto ns = svc.AuthenticateHeader(mg_get_header(c, "Authorization"));
    if (!ns.ok()) return SendError(c, ns.status());
    if (uri == "/v1/models") return method_is("GET") ? Models(c, "") : 405;
    if (uri.rfind("/v1/models/", 0) == 0) return method_is("GET") ? Models(c, uri.substr(11)) : 405;
    const bool completions = uri == "/v1/completions", chat = uri == "/v1/chat/completions";
    const bool tokenize = uri == "/tokenize", detokenize = uri == "/detokenize";
    if (!completions && !chat && !tokenize && !detokenize) {
      return SendError(c, NotFound("no endpoint " + uri + " (docs/http.md lists them)"));
    }
    if (!method_is("POST")) return 405;
    auto body = ReadBody(c, opt.max_body_bytes);
    if (!body) {
      SendJson(c, 413,
               ErrorJson(ResourceExhausted("the request body exceeds the server's limit of " +
                                           std::to_string(opt.max_body_bytes) + " bytes (--max-prompt-bytes)"),
                         {413, "request_too_large"}, "", ""));
      return 413;
    }
    if (tokenize || detokenize) return Tokenize(c, *body, detokenize);
    return Generate(c, *ns, *body, chat);
  } catch (const std::exception& e) {  // a bug: answer 500 rather than drop the connection
    spdlog::error("http {} {}: {}", method, uri, e.what());
    return SendError(c, Status(StatusCode::kInternal, std::string("internal error: ") + e.what()));
  }
}

int HttpHandler::Health(mg_connection* c) {
  if (svc.draining()) {
    SendJson(c, 503, {{"status", "draining"}});
    return 503;
  }
  SendJson(c, 200, {{"status", "ok"}});
  return 200;
}

int HttpHandler::Models(mg_connection* c, const std::string& id) {
  if (id.empty()) {
    SendJson(c, 200, {{"object", "list"}, {"data", json::array({ModelJson()})}});
    return 200;
  }
  if (id != svc.options().model_name) {
    return SendError(c, NotFound("model '" + id + "' not found; this server serves '" + svc.options().model_name + "'"),
                     "model", "model_not_found");
  }
  SendJson(c, 200, ModelJson());
  return 200;
}

int HttpHandler::Tokenize(mg_connection* c, const std::string& body, bool detokenize) {
  json j;
  if (Status st = ParseBody(body, &j); !st.ok()) return SendError(c, st);
  Fields f(j);
  const Tokenizer& tok = svc.engine().model().tokenizer();
  if (detokenize) {
    const json* ids = f.Get("tokens");
    if (!ids || !ids->is_array())
      return SendError(c, InvalidArgument("tokens must be an array of token ids"), "tokens");
    std::vector<int> v;
    for (size_t i = 0; i < ids->size(); ++i) {
      const json& t = (*ids)[i];
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tok.vocab_size()) {
        return SendError(c, InvalidArgument("tokens[" + std::to_string(i) + "] is not a token id of this model"),
                         "tokens");
      }
      v.push_back(t.get<int>());
    }
    if (auto e = f.Unsupported()) return SendError(c, e->status, e->param);
    SendJson(c, 200, {{"content", tok.Decode(v)}});
    return 200;
  }
  const json* content = f.Get("content");
  if (!content || !content->is_string()) return SendError(c, InvalidArgument("content must be a string"), "content");
  std::optional<bool> add_special, parse_special, with_pieces;
  for (auto [name, out] : {std::pair{"add_special", &add_special}, std::pair{"parse_special", &parse_special},
                           std::pair{"with_pieces", &with_pieces}}) {
    if (auto e = f.Bool(name, out)) return SendError(c, e->status, e->param);
  }
  if (auto e = f.Unsupported()) return SendError(c, e->status, e->param);
  const std::string& text = content->get_ref<const std::string&>();
  if (Status st = CheckPromptBytes(svc.options().limits, "content", static_cast<int64_t>(text.size())); !st.ok()) {
    return SendError(c, st, "content");
  }
  std::vector<int> ids;
  if (add_special.value_or(false) && tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  for (int t : tok.Encode(text, parse_special.value_or(false))) ids.push_back(t);
  json out = json::array();
  for (int t : ids) {
    if (with_pieces.value_or(false)) {
      out.push_back({{"id", t}, {"piece", Piece(tok, t)}});
    } else {
      out.push_back(t);
    }
  }
  SendJson(c, 200, {{"tokens", out}});
  return 200;
}

int HttpHandler::Generate(mg_connection* c, const std::string& ns, const std::string& body, bool chat) {
  json j;
  if (Status st = ParseBody(body, &j); !st.ok()) return SendError(c, st);
  Fields f(j);
  pb::GenerateRequest req;
  auto fail = [&](const FieldError& e) { return SendError(c, e.status, e.param); };

  if (const json* m = f.Get("model")) {
    if (!m->is_string()) return fail(Bad("model", "must be a string"));
    if (m->get_ref<const std::string&>() != svc.options().model_name) {
      return SendError(c,
                       NotFound("model '" + m->get<std::string>() + "' not found; this server serves '" +
                                svc.options().model_name + "'"),
                       "model", "model_not_found");
    }
  }
  // The input: a prompt (completions) or messages (chat).
  if (!chat) {
    const json* p = f.Get("prompt");
    if (!p) return fail(Bad("prompt", "is required"));
    const json* one = p;
    if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) one = &(*p)[0];
    if (one->is_string()) {
      if (one->get_ref<const std::string&>().empty()) return fail(Bad("prompt", "must not be empty"));
      req.set_text(one->get<std::string>());
    } else if (one->is_array() && !one->empty() && (*one)[0].is_number_integer()) {
      for (const json& t : *one) {
        if (!t.is_number_integer() || t.get<int64_t>() < INT32_MIN || t.get<int64_t>() > INT32_MAX) {
          return fail(Bad("prompt", "must be a string or an array of token ids"));
        }
        req.mutable_token_ids()->add_ids(t.get<int>());
      }
    } else if (p->is_array() && p->size() > 1 && (*p)[0].is_string()) {
      return fail(Bad("prompt", "holds several prompts; send one per request"));
    } else {
      return fail(Bad("prompt", "must be a string, an array of token ids, or an array of one of them"));
    }
    std::optional<bool> echo;
    if (auto e = f.Bool("echo", &echo)) return fail(*e);
    if (echo.value_or(false)) return fail(Bad("echo", "is not supported (the prompt is not returned)"));
    std::optional<int64_t> best_of;
    if (auto e = f.Int("best_of", &best_of)) return fail(*e);
    if (best_of && *best_of != 1) return fail(Bad("best_of", "must be 1"));
  } else {
    const json* ms = f.Get("messages");
    if (!ms || !ms->is_array() || ms->empty()) return fail(Bad("messages", "must be a non-empty array"));
    for (size_t i = 0; i < ms->size(); ++i) {
      const std::string at = "messages[" + std::to_string(i) + "]";
      const json& m = (*ms)[i];
      if (!m.is_object()) return fail(Bad(at, "must be an object"));
      Fields mf(m);
      const json* role = mf.Get("role");
      if (!role || !role->is_string()) return fail(Bad(at + ".role", "must be a string"));
      std::string r = role->get<std::string>();
      if (r == "developer") r = "system";  // OpenAI's newer name for the system role
      const json* content = mf.Get("content");
      std::string text;
      if (content && content->is_string()) {
        text = content->get<std::string>();
      } else if (content && content->is_array()) {
        for (size_t k = 0; k < content->size(); ++k) {
          const json& part = (*content)[k];
          const std::string pat = at + ".content[" + std::to_string(k) + "]";
          if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
            return fail(Bad(pat, "must be an object with a type"));
          }
          if (part["type"] != "text" || !part.contains("text") || !part["text"].is_string()) {
            return fail(Bad(pat + ".type", "'" + part["type"].get<std::string>() + "' is not supported (text only)"));
          }
          text += part["text"].get<std::string>();
        }
      } else {
        return fail(Bad(at + ".content", "must be a string or an array of text parts"));
      }
      mf.Get("name");  // accepted and not used
      if (auto e = mf.Unsupported()) return fail(Bad(at + "." + e->param, "is not supported by this server"));
      auto* pm = req.mutable_messages()->add_messages();
      pm->set_role(r);
      pm->set_content(text);
    }
  }
  // Sampling and limits.
  std::optional<int64_t> max_tokens, max_completion_tokens, top_k, seed, n;
  if (auto e = f.Int("max_tokens", &max_tokens)) return fail(*e);
  if (auto e = f.Int("max_completion_tokens", &max_completion_tokens)) return fail(*e);
  for (auto [name, v] :
       {std::pair{"max_tokens", &max_tokens}, std::pair{"max_completion_tokens", &max_completion_tokens}}) {
    if (*v && (**v < 1 || **v > INT32_MAX)) return fail(Bad(name, "must be at least 1"));
  }
  if (max_completion_tokens) max_tokens = max_completion_tokens;
  if (max_tokens) req.set_max_tokens(static_cast<int32_t>(*max_tokens));
  std::optional<double> temperature, top_p, min_p, presence, frequency, repetition;
  for (auto [name, v] : {std::pair{"temperature", &temperature}, std::pair{"top_p", &top_p}, std::pair{"min_p", &min_p},
                         std::pair{"presence_penalty", &presence}, std::pair{"frequency_penalty", &frequency},
                         std::pair{"repetition_penalty", &repetition}}) {
    if (auto e = f.Number(name, v)) return fail(*e);
  }
  if (temperature) req.set_temperature(static_cast<float>(*temperature));
  if (top_p) req.set_top_p(static_cast<float>(*top_p));
  if (min_p) req.set_min_p(static_cast<float>(*min_p));
  if (presence) req.set_presence_penalty(static_cast<float>(*presence));
  if (frequency) req.set_frequency_penalty(static_cast<float>(*frequency));
  if (repetition) req.set_repetition_penalty(static_cast<float>(*repetition));
  if (auto e = IntInRange(f, "top_k", -1, INT32_MAX, &top_k)) return fail(*e);
  if (top_k) req.set_top_k(static_cast<int32_t>(*top_k));
  if (auto e = IntInRange(f, "seed", 0, INT64_MAX, &seed)) return fail(*e);
  if (seed) req.set_seed(static_cast<uint64_t>(*seed));
  if (auto e = f.Int("n", &n)) return fail(*e);
  if (n && *n != 1) return fail(Bad("n", "must be 1 (one choice per request)"));
  if (const json* stop = f.Get("stop")) {
    if (stop->is_string()) {
      req.add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& s : *stop) {
        if (!s.is_string()) return fail(Bad("stop", "must be a string or an array of strings"));
        req.add_stop(s.get<std::string>());
      }
    } else {
      return fail(Bad("stop", "must be a string or an array of strings"));
    }
  }
  // Chat replies end where the model file says a reply ends (qkvserve.chat.stop), unless `stop` is given.
  if (chat && req.stop_size() == 0) {
    for (const std::string& st : svc.options().chat_stop) req.add_stop(st);
  }
  std::optional<bool> ignore_eos;
  if (auto e = f.Bool("ignore_eos", &ignore_eos)) return fail(*e);
  req.set_ignore_eos(ignore_eos.value_or(false));
  // Logprobs: an integer for completions, a flag with top_logprobs for chat.
  std::optional<int64_t> top_logprobs;
  if (!chat) {
    if (auto e = IntInRange(f, "logprobs", 0, 20, &top_logprobs)) return fail(*e);
    if (top_logprobs) req.set_logprobs(static_cast<int32_t>(*top_logprobs));
  } else {
    std::optional<bool> logprobs;
    if (auto e = f.Bool("logprobs", &logprobs)) return fail(*e);
    if (auto e = IntInRange(f, "top_logprobs", 0, 20, &top_logprobs)) return fail(*e);
    if (top_logprobs && !logprobs.value_or(false)) return fail(Bad("top_logprobs", "needs logprobs: true"));
    if (logprobs.value_or(false)) req.set_logprobs(static_cast<int32_t>(top_logprobs.value_or(0)));
  }
  const bool want_logprobs = req.has_logprobs();
  std::optional<bool> stream;
  if (auto e = f.Bool("stream", &stream)) return fail(*e);
  bool include_usage = false;
  if (const json* so = f.Get("stream_options")) {
    if (!so->is_object()) return fail(Bad("stream_options", "must be an object"));
    if (!stream.value_or(false)) return fail(Bad("stream_options", "needs stream: true"));
    Fields sf(*so);
    std::optional<bool> iu;
    if (auto e = sf.Bool("include_usage", &iu))
      return fail(Bad("stream_options.include_usage", "must be true or false"));
    if (auto e = sf.Unsupported()) return fail(Bad("stream_options." + e->param, "is not supported by this server"));
    include_usage = iu.value_or(false);
  }
  if (const json* lb = f.Get("logit_bias"); lb && !(lb->is_object() && lb->empty())) {
    return fail(Bad("logit_bias", "is not supported by this server"));
  }
  f.Get("user");  // OpenAI's end-user id: accepted, not used
  if (auto e = f.Unsupported()) return fail(*e);

  // The same conversion and checks as the gRPC front; then this front's own parts.
  auto params = svc.ToParams(req, ns);
  if (!params.ok()) {
    const Status& st = params.status();
    return SendError(c, st, ParamOf(st, j), IsContextOverflow(st) ? "context_length_exceeded" : "");
  }
  params->front = "http";
  if (const char* sid = mg_get_header(c, "x-session-id")) {
    if (Status st = CheckId("x-session-id", sid); !st.ok()) return SendError(c, st, "x-session-id");
    params->session_id = sid;
    params->prompt_is_context = true;
    params->create_ttl_s = opt.session_ttl_s;
  }
  auto submitted = svc.engine().Submit(std::move(*params));
  if (!submitted.ok()) {
    const Status& st = submitted.status();
    return SendError(c, st, ParamOf(st, j), IsContextOverflow(st) ? "context_length_exceeded" : "");
  }
  std::shared_ptr<RequestStream> rs = *submitted;

  const Tokenizer& tok = svc.engine().model().tokenizer();
  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + rs->request_id();
  const int64_t created = std::time(nullptr);
  const std::string& model = svc.options().model_name;
  // Logprobs of one event's tokens, in this endpoint's shape.
  auto logprobs_of = [&](const std::vector<TokenLogprob>& lps, size_t* text_offset) -> json {
    if (!want_logprobs) return nullptr;
    if (chat) {
      json content = json::array();
      for (const TokenLogprob& lp : lps) {
        const std::string piece = Piece(tok, lp.token);
        json top = json::array();
        for (const auto& [t, v] : lp.top) {
          const std::string tp = Piece(tok, t);
          top.push_back({{"token", tp}, {"logprob", v}, {"bytes", Bytes(tp)}});
        }
        content.push_back({{"token", piece}, {"logprob", lp.logprob}, {"bytes", Bytes(piece)}, {"top_logprobs", top}});
      }
      return {{"content", content}};
    }
    json tokens = json::array(), token_lps = json::array(), tops = json::array(), offsets = json::array();
    for (const TokenLogprob& lp : lps) {
      const std::string piece = Piece(tok, lp.token);
      tokens.push_back(piece);
      token_lps.push_back(lp.logprob);
      json top = json::object();
      for (const auto& [t, v] : lp.top) top[Piece(tok, t)] = v;
      tops.push_back(lp.top.empty() ? json(nullptr) : top);
      offsets.push_back(*text_offset);
      *text_offset += piece.size();
    }
    return {{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
  };

  if (!stream.value_or(false)) {
    // Collect the whole reply. (A client that goes away is noticed only when the reply is written: a
    // non-streaming request runs to its end, bounded by max_tokens; docs/http.md.)
    std::string text;
    std::vector<TokenLogprob> lps;
    StreamEvent e;
    while (true) {
      if (!rs->Next(&e, std::chrono::milliseconds(1000))) continue;
      if (e.final && e.finish == FinishReason::kError) return SendError(c, e.error);
      text += e.text;
      lps.insert(lps.end(), e.logprobs.begin(), e.logprobs.end());
      if (e.final) break;
    }
    size_t offset = 0;
    json choice = {{"index", 0}, {"logprobs", logprobs_of(lps, &offset)}, {"finish_reason", FinishName(e.finish)}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    } else {
      choice["text"] = text;
    }
    SendJson(c, 200,
             {{"id", id},
              {"object", chat ? "chat.completion" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", json::array({choice})},
              {"usage", UsageJson(e.usage)}});
    return 200;
  }

  // Streaming: server-sent events in chunked encoding. Headers go out once the engine has accepted the
  // request, so that refusals above keep their HTTP status; an error after this point is an `error` event.
  StartHeaders(c, 200, "text/event-stream");
  mg_response_header_add(c, "Cache-Control", "no-cache", -1);
  mg_response_header_add(c, "Transfer-Encoding", "chunked", -1);
  mg_response_header_send(c);
  auto chunk = [&](json choice) {
    return json{{"id", id},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created},
                {"model", model},
                {"choices", json::array({std::move(choice)})}};
  };
  bool alive = true;
  if (chat) {
    alive = SendEvent(
        c,
        Dump(chunk({{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"finish_reason", nullptr}})));
  }
  size_t offset = 0;
  StreamEvent e;
  while (alive) {
    // A comment every half second while nothing comes: it finds a client that went away (a write fails)
    // while the request waits or prefills.
    if (!rs->Next(&e, std::chrono::milliseconds(500))) {
      static constexpr char kPing[] = ": ping\n\n";
      alive = mg_send_chunk(c, kPing, sizeof(kPing) - 1) > 0;
      continue;
    }
    if (e.final && e.finish == FinishReason::kError) {
      const HttpStatus h = MapStatus(e.error);
      const std::string ev = "event: error\ndata: " + Dump(ErrorJson(e.error, h, "", "")) + "\n\n";
      mg_send_chunk(c, ev.data(), static_cast<unsigned>(ev.size()));
      mg_send_chunk(c, "", 0);
      return 200;
    }
    if (!e.text.empty() || !e.logprobs.empty() || e.final) {
      json choice = {{"index", 0},
                     {"logprobs", logprobs_of(e.logprobs, &offset)},
                     {"finish_reason", e.final ? json(FinishName(e.finish)) : json(nullptr)}};
      if (chat) {
        choice["delta"] = e.text.empty() ? json::object() : json{{"content", e.text}};
      } else {
        choice["text"] = e.text;
      }
      alive = SendEvent(c, Dump(chunk(std::move(choice))));
    }
    if (e.final) break;
  }
  if (!alive) {  // the client went away: the engine ends the request (and frees its blocks) within one step
    rs->Cancel();
    return 499;
  }
  if (include_usage) {
    json u = chunk(nullptr);
    u["choices"] = json::array();
    u["usage"] = UsageJson(e.usage);
    SendEvent(c, Dump(u));
  }
  SendEvent(c, "[DONE]");
  mg_send_chunk(c, "", 0);
  return 200;
}

// ----------------------------------------------------------------------------- start and stop
StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpOptions& opt, InferenceService& service) {
  std::unique_ptr<HttpServer> s(new HttpServer());
  g_instance = service.options().instance_id;
  s->handler_ = std::make_unique<HttpHandler>(HttpHandler{service, opt, std::time(nullptr)});
  const size_t colon = opt.listen.rfind(':');
  if (colon == std::string::npos || colon + 1 == opt.listen.size()) {
    return InvalidArgument("--http-listen must be host:port, got '" + opt.listen + "'");
  }
  std::string ports = opt.listen;
  if (!opt.tls_cert.empty() || !opt.tls_key.empty()) {
    if (!(mg_check_feature(MG_FEATURES_SSL) & MG_FEATURES_SSL)) {
      return FailedPrecondition("this civetweb build has no TLS; run HTTP without --tls-cert or turn it off");
    }
    QKV_RETURN_IF_ERROR(LoadCivetwebTlsShims());
    // civetweb reads the key and the certificate chain from one PEM file: written here, owner-only.
    std::ifstream key(opt.tls_key), cert(opt.tls_cert);
    if (!key || !cert) return InvalidArgument("--tls-cert and --tls-key must both be readable files");
    std::stringstream pem;
    pem << key.rdbuf() << "\n" << cert.rdbuf();
    std::error_code ec;  // TMPDIR when it names a directory, else /tmp
    std::filesystem::path dir = std::filesystem::temp_directory_path(ec);
    if (ec) dir = "/tmp";
    std::string path = (dir / "qkvserve-http-XXXXXX").string();
    const int fd = mkstemp(path.data());
    if (fd < 0) return Status(StatusCode::kInternal, "cannot create a temporary file for the TLS key");
    fchmod(fd, 0600);
    const std::string data = pem.str();
    const bool written = write(fd, data.data(), data.size()) == static_cast<ssize_t>(data.size());
    close(fd);
    s->pem_file_ = path;
    if (!written) return Status(StatusCode::kInternal, "cannot write the TLS key file");
    ports += "s";
    s->tls_ = true;
  }
  const std::string threads = std::to_string(opt.threads);
  const char* options[] = {"listening_ports",
                           ports.c_str(),
                           "num_threads",
                           threads.c_str(),
                           "connection_queue",
                           "64",
                           "enable_keep_alive",
                           "yes",
                           "request_timeout_ms",
                           "60000",
                           s->tls_ ? "ssl_certificate" : nullptr,
                           s->tls_ ? s->pem_file_.c_str() : nullptr,
                           nullptr};
  mg_callbacks cb{};
  cb.log_message = LogMessage;
  mg_init_library(s->tls_ ? MG_FEATURES_SSL : 0);
  s->ctx_ = mg_start(&cb, nullptr, options);
  // civetweb has read the key into its SSL context: the copy on disk goes now, not at exit (a crash or a
  // SIGKILL would otherwise leave the private key in $TMPDIR or /tmp).
  if (!s->pem_file_.empty()) {
    unlink(s->pem_file_.c_str());
    s->pem_file_.clear();
  }
  if (!s->ctx_) return FailedPrecondition("cannot serve HTTP on --http-listen " + opt.listen);
  mg_set_request_handler(s->ctx_, "/", HandleC, s->handler_.get());
  mg_server_port sp[4] = {};
  if (mg_get_server_ports(s->ctx_, 4, sp) < 1 || sp[0].port <= 0) {
    return FailedPrecondition("HTTP listener on " + opt.listen + " has no port");
  }
  s->port_ = sp[0].port;
  return s;
}

HttpServer::~HttpServer() {
  if (ctx_) mg_stop(ctx_);
  if (!pem_file_.empty()) unlink(pem_file_.c_str());
}

}  // namespace qkv::server
