// libFuzzer target: a GenerateRequest as the server receives it (protobuf wire bytes), through the server's
// validation (InferenceService::ToParams: limits, ids, UTF-8, tokenization, chat template, sampling fields)
// and the engine's (Engine::Submit against engine state). An accepted request is cancelled at once. Every
// 64 inputs the engine's block and state accounting must check clean.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "engine/model.h"
#include "engine/random_model.h"
#include "server/service.h"

namespace {

void Check(bool ok, const std::string& what = "") {
  if (ok) return;
  std::fprintf(stderr, "fuzz_request: %s\n", what.c_str());
  __builtin_trap();
}

struct World {
  std::unique_ptr<qkv::Model> model;
  std::unique_ptr<qkv::Engine> engine;
  std::unique_ptr<qkv::server::InferenceService> service;
};

World& TheWorld() {
  static World w = [] {
    qkv::ModelConfig c;
    c.arch = qkv::Arch::kQwen3;
    c.hidden = 32;
    c.n_layers = 1;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 16;
    c.rotary_dim = 16;
    c.ffn = 48;
    c.vocab = 400;
    c.context_length = 256;
    c.qk_norm = true;
    // The model file is this process's own (fuzz jobs may run side by side) and is removed once loaded
    // (a mapping of it stays valid after the unlink).
    const char* tmp = std::getenv("TMPDIR");
    const std::string path =
        std::string(tmp && *tmp ? tmp : "/tmp") + "/qkv_fuzz_request." + std::to_string(getpid()) + ".gguf";
    Check(qkv::WriteRandomModel(c, {qkv::GgmlType::kF32, 1, "", {}}, path).ok(), "cannot write the model");
    qkv::ModelOptions mo;
    mo.weights_dtype = qkv::DType::kF32;
    mo.kv_dtype = qkv::DType::kF32;
    mo.n_threads = 1;
    mo.max_batch_tokens = 256;
    mo.kv_blocks = 64;
    auto m = qkv::Model::Load(path, mo);
    std::remove(path.c_str());
    Check(m.ok(), "cannot load the model");
    World out;
    out.model = std::move(*m);
    qkv::EngineOptions eo;
    eo.max_num_batched_tokens = 256;
    eo.max_waiting = 64;
    auto e = qkv::Engine::Create(*out.model, eo);
    Check(e.ok(), "cannot start the engine");
    out.engine = std::move(*e);
    qkv::server::ServiceOptions so;
    so.chat_template = qkv::ChatTemplateKind::kChatMl;
    so.limits.max_prompt_bytes = 4096;
    so.limits.max_stop_strings = 8;
    so.limits.max_stop_bytes = 256;
    so.limits.max_stop_token_ids = 16;
    out.service = std::make_unique<qkv::server::InferenceService>(*out.engine, so);
    return out;
  }();
  return w;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static uint64_t n = 0;
  World& w = TheWorld();
  qkvserve::v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto params = w.service->ToParams(req, "fuzz");
  if (params.ok()) {
    const std::vector<int> prompt = params->prompt;
    auto stream = w.engine->Submit(std::move(*params));
    if (stream.ok()) {
      // Token ids are the engine's to check (text was tokenized by the server): an accepted prompt is valid.
      for (int id : prompt)
        Check(id >= 0 && id < w.model->config().vocab, "accepted a prompt id outside the vocabulary");
      (*stream)->Cancel();
    } else {
      Check(!stream.status().message().empty(), "an engine error without a message");
    }
  } else {
    Check(!params.status().message().empty(), "a validation error without a message");
  }
  if (++n % 64 == 0) {
    const std::string err = w.engine->CheckConsistency();
    Check(err.empty(), "accounting: " + err);
  }
  return 0;
}
