// The Inference service: validates requests, maps them to engine calls, streams tokens back, and maps
// engine Status codes to gRPC status codes (they share numbering). No inference logic lives here.
#pragma once

#include <atomic>
#include <set>
#include <string>

#include "engine/chat_template.h"
#include "engine/engine.h"
#include "engine/request_limits.h"
#include "qkvserve/v1/inference.grpc.pb.h"

namespace qkv::server {

struct ServiceOptions {
  std::set<std::string> api_keys;  // empty: no authentication
  std::string instance_id;
  ChatTemplateKind chat_template = ChatTemplateKind::kPlain;
  std::vector<std::string> chat_stop;  // the model file's qkvserve.chat.stop
  std::string model_name;
  RequestLimits limits;
};

grpc::Status ToGrpc(const Status& s);
// Generate and Complete calls whose reactor is alive (leak checks; qkvserve_grpc_live_reactors).
int64_t LiveStreamReactors();

class InferenceService final : public qkvserve::v1::Inference::CallbackService {
 public:
  InferenceService(Engine& engine, ServiceOptions opt);
  // New generations and sessions are refused with UNAVAILABLE from now on (graceful drain).
  void StartDraining() { draining_ = true; }

  grpc::ServerWriteReactor<qkvserve::v1::GenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                                     const qkvserve::v1::GenerateRequest* req) override;
  grpc::ServerUnaryReactor* Complete(grpc::CallbackServerContext* ctx, const qkvserve::v1::GenerateRequest* req,
                                     qkvserve::v1::CompleteResponse* resp) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* ctx, const qkvserve::v1::CancelRequest* req,
                                   qkvserve::v1::CancelResponse* resp) override;
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* ctx,
                                          const qkvserve::v1::CreateSessionRequest* req,
                                          qkvserve::v1::Session* resp) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* ctx, const qkvserve::v1::GetSessionRequest* req,
                                       qkvserve::v1::Session* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx, const qkvserve::v1::ListSessionsRequest* req,
                                         qkvserve::v1::ListSessionsResponse* resp) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* ctx, const qkvserve::v1::ForkSessionRequest* req,
                                        qkvserve::v1::Session* resp) override;
  grpc::ServerUnaryReactor* UpdateSession(grpc::CallbackServerContext* ctx,
                                          const qkvserve::v1::UpdateSessionRequest* req,
                                          qkvserve::v1::Session* resp) override;
  grpc::ServerUnaryReactor* TruncateSession(grpc::CallbackServerContext* ctx,
                                            const qkvserve::v1::TruncateSessionRequest* req,
                                            qkvserve::v1::Session* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx, const qkvserve::v1::CloseSessionRequest* req,
                                         qkvserve::v1::CloseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* ctx, const qkvserve::v1::TokenizeRequest* req,
                                     qkvserve::v1::TokenizeResponse* resp) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* ctx, const qkvserve::v1::DetokenizeRequest* req,
                                       qkvserve::v1::DetokenizeResponse* resp) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx, const qkvserve::v1::GetModelInfoRequest* req,
                                         qkvserve::v1::ModelInfo* resp) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const qkvserve::v1::GetStatsRequest* req,
                                     qkvserve::v1::Stats* resp) override;

  // Shared with the reactors.
  StatusOr<std::string> Authenticate(grpc::CallbackServerContext* ctx) const;
  // The same check on an `authorization` header's value (nullptr: absent); returns the key (namespace).
  StatusOr<std::string> AuthenticateHeader(const char* authorization) const;
  const ServiceOptions& options() const { return opt_; }
  StatusOr<GenerateParams> ToParams(const qkvserve::v1::GenerateRequest& req, const std::string& ns);
  Engine& engine() { return engine_; }
  bool draining() const { return draining_; }

 private:
  std::string NewId(const char* prefix);
  Engine& engine_;
  ServiceOptions opt_;
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> counter_{0};
};

}  // namespace qkv::server
