#include "server/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

namespace qkv::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(const std::string& name, const std::string& help, MetricType type) {
  MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

void Add(MetricFamily& f, double v, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  if (f.type == MetricType::Counter) m.counter.value = v;
  else m.gauge.value = v;
  f.metric.push_back(std::move(m));
}

class EngineCollectable final : public prometheus::Collectable {
 public:
  EngineCollectable(const Engine& e, std::string model) : engine_(e), model_(std::move(model)) {}
  std::vector<MetricFamily> Collect() const override {
    const EngineStats s = engine_.Stats();
    std::vector<MetricFamily> out;
    auto g = [&](const std::string& n, const std::string& h) { return Family(n, h, MetricType::Gauge); };
    auto c = [&](const std::string& n, const std::string& h) { return Family(n, h, MetricType::Counter); };
    auto blocks = g("qkvserve_kv_cache_blocks", "KV cache blocks by state (used + cached + free = total)");
    Add(blocks, static_cast<double>(s.blocks_used), {{"state", "used"}});
    Add(blocks, static_cast<double>(s.blocks_cached), {{"state", "cached"}});
    Add(blocks, static_cast<double>(s.blocks_free), {{"state", "free"}});
    out.push_back(blocks);
    auto tokens = g("qkvserve_kv_cache_tokens", "KV cache token slots");
    Add(tokens, static_cast<double>(s.tokens_capacity), {{"state", "capacity"}});
    Add(tokens, static_cast<double>(s.tokens_used), {{"state", "used"}});
    out.push_back(tokens);
    auto usage = g("qkvserve_kv_cache_usage_ratio", "used blocks / total blocks");
    Add(usage, s.blocks_total ? static_cast<double>(s.blocks_used) / static_cast<double>(s.blocks_total) : 0.0);
    out.push_back(usage);
    auto reqs = g("qkvserve_requests", "requests by state");
    Add(reqs, static_cast<double>(s.requests_running), {{"state", "running"}});
    Add(reqs, static_cast<double>(s.requests_waiting), {{"state", "waiting"}});
    out.push_back(reqs);
    auto sess = g("qkvserve_sessions", "sessions by state");
    Add(sess, static_cast<double>(s.sessions_resident), {{"state", "resident"}});
    Add(sess, static_cast<double>(s.sessions_evicted), {{"state", "evicted"}});
    out.push_back(sess);
    auto fin = c("qkvserve_requests_finished_total", "finished requests by reason");
    Add(fin, static_cast<double>(s.finished_stop), {{"reason", "stop"}});
    Add(fin, static_cast<double>(s.finished_length), {{"reason", "length"}});
    Add(fin, static_cast<double>(s.finished_cancelled), {{"reason", "cancelled"}});
    Add(fin, static_cast<double>(s.finished_error), {{"reason", "error"}});
    out.push_back(fin);
    auto gen = c("qkvserve_generated_tokens_total", "generated tokens");
    Add(gen, static_cast<double>(s.generated_tokens));
    out.push_back(gen);
    auto info = g("qkvserve_build_info", "constant 1, labelled with the build and model");
    Add(info, 1.0, {{"version", "0.1.0"}, {"model", model_},
                    {"architecture", ArchName(engine_.model().config().arch)},
                    {"attention", engine_.model().config().AttentionKind()}});
    out.push_back(info);
    return out;
  }

 private:
  const Engine& engine_;
  std::string model_;
};

}  // namespace

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen, const Engine& engine,
                                                              const std::string& model_name) {
  auto m = std::unique_ptr<MetricsServer>(new MetricsServer());
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(listen, 2);
  } catch (const std::exception& e) {
    return InvalidArgument("--metrics-listen " + listen + ": " + e.what());
  }
  auto coll = std::make_shared<EngineCollectable>(engine, model_name);
  m->exposer_->RegisterCollectable(coll);
  m->collectable_ = coll;
  const auto ports = m->exposer_->GetListeningPorts();
  m->port_ = ports.empty() ? 0 : ports.front();
  return m;
}

MetricsServer::~MetricsServer() = default;

}  // namespace qkv::server
