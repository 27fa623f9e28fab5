// The OpenAI-style HTTP API (docs/http.md), in the same process as gRPC and over the same engine.
//
// Every generation is converted to the gRPC API's GenerateRequest and checked by the same
// InferenceService::ToParams (request limits, keys, quotas, draining), so both fronts refuse the same things
// with the same messages; only the status mapping and the JSON shapes are HTTP's.
//
// HTTP is civetweb's (Debian's libcivetweb, the library prometheus-cpp already links): no HTTP parsing here.
// Threads: civetweb serves a connection on one of `threads` worker threads while a request on it is in
// progress (a streaming response holds its worker until the stream ends); connections beyond that wait in
// civetweb's queue (`connection_queue`, 64) and listen backlog. The handlers block only their own worker:
// they submit to the engine (which answers within one step) and wait on the request's stream.
#pragma once

#include <memory>
#include <string>

#include "engine/status.h"

struct mg_context;

namespace qkv::server {

class InferenceService;
struct HttpHandler;

struct HttpOptions {
  std::string listen = "127.0.0.1:8000";  // host:port; port 0 picks a free port
  int threads = 16;                       // --http-threads: requests served at once (streams included)
  std::string tls_cert, tls_key;          // PEM files (both or neither): HTTPS
  double session_ttl_s = 3600;            // sessions created by x-session-id expire after this idle time
  int64_t max_body_bytes = 16 << 20;      // larger bodies get 413
};

class HttpServer {
 public:
  static StatusOr<std::unique_ptr<HttpServer>> Start(const HttpOptions& opt, InferenceService& service);
  ~HttpServer();  // stops accepting and waits for the handlers in progress
  int port() const { return port_; }
  bool tls() const { return tls_; }

 private:
  HttpServer() = default;
  mg_context* ctx_ = nullptr;
  int port_ = 0;
  bool tls_ = false;
  std::string pem_file_;  // key + certificate for civetweb, removed at stop
  std::unique_ptr<HttpHandler> handler_;
};

}  // namespace qkv::server
