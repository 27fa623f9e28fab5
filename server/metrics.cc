#include "server/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <limits>

#include "server/memory.h"
#include "server/service.h"

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
  if (f.type == MetricType::Counter)
    m.counter.value = v;
  else
    m.gauge.value = v;
  f.metric.push_back(std::move(m));
}

void AddHistogram(std::vector<MetricFamily>& out, const std::string& name, const std::string& help,
                  const Histogram& h) {
  MetricFamily f = Family(name, help, MetricType::Histogram);
  ClientMetric m;
  uint64_t cum = 0;
  for (size_t i = 0; i < h.counts.size(); ++i) {
    cum += h.counts[i];
    ClientMetric::Bucket b;
    b.cumulative_count = cum;
    b.upper_bound = i < h.bounds.size() ? h.bounds[i] : std::numeric_limits<double>::infinity();
    m.histogram.bucket.push_back(b);
  }
  m.histogram.sample_count = h.count;
  m.histogram.sample_sum = h.sum;
  f.metric.push_back(std::move(m));
  out.push_back(std::move(f));
}

class EngineCollectable final : public prometheus::Collectable {
 public:
  EngineCollectable(const Engine& e, std::string model) : engine_(e), model_(std::move(model)) {}
  std::vector<MetricFamily> Collect() const override {
    const EngineStats s = engine_.Stats();
    const MemoryBreakdown mem = MeasureMemory(engine_.model());
    const int64_t bpt = s.kv_bytes_per_token;
    std::vector<MetricFamily> out;
    auto gauge = [&](const std::string& n, const std::string& h, std::vector<std::pair<std::string, double>> values,
                     const std::string& label = "") {
      MetricFamily f = Family(n, h, MetricType::Gauge);
      for (auto& [lv, v] : values)
        Add(f, v, label.empty() ? std::vector<ClientMetric::Label>{} : std::vector<ClientMetric::Label>{{label, lv}});
      out.push_back(std::move(f));
    };
    auto counter = [&](const std::string& n, const std::string& h, std::vector<std::pair<std::string, double>> values,
                       const std::string& label = "") {
      MetricFamily f = Family(n, h, MetricType::Counter);
      for (auto& [lv, v] : values)
        Add(f, v, label.empty() ? std::vector<ClientMetric::Label>{} : std::vector<ClientMetric::Label>{{label, lv}});
      out.push_back(std::move(f));
    };
    auto d = [](auto v) { return static_cast<double>(v); };
    gauge("qkvserve_kv_cache_blocks",
          "KV blocks: used (referenced), cached (reusable prefix), free; they sum to the total",
          {{"used", d(s.blocks_used)}, {"cached", d(s.blocks_cached)}, {"free", d(s.blocks_free)}}, "state");
    gauge("qkvserve_kv_cache_tokens", "KV token slots",
          {{"capacity", d(s.tokens_capacity)}, {"used", d(s.tokens_used)}}, "state");
    gauge("qkvserve_kv_cache_bytes", "bytes of the KV arena",
          {{"capacity", d(s.tokens_capacity * bpt)}, {"used", d(s.tokens_used * bpt)}}, "state");
    gauge("qkvserve_kv_cache_usage_ratio", "used blocks / total blocks",
          {{"", s.blocks_total ? d(s.blocks_used) / d(s.blocks_total) : 0.0}});
    gauge("qkvserve_kv_cache_slack_tokens", "allocated KV slots not yet holding a token", {{"", d(s.slack_tokens)}});
    gauge("qkvserve_kv_bytes_per_token",
          "KV bytes per token (layers x 2 x kv heads x (head_dim x bytes + 2 for the scale of an int8 cache); MLA: "
          "layers x ((kv_lora_rank + rope dims) x bytes + 2 x 2 for int8's scales)",
          {{"", d(bpt)}});
    gauge("qkvserve_kv_block_size_tokens", "tokens per KV block", {{"", d(s.block_size)}});
    gauge("qkvserve_state_slots",
          "per-sequence state slots (Gated DeltaNet layers' conv window and matrices): used (by running requests "
          "and resident sessions) or free; both 0 for models without such layers",
          {{"used", d(s.state_slots_used)}, {"free", d(s.state_slots_free)}}, "state");
    gauge("qkvserve_state_snapshots",
          "states kept at block boundaries for prefix caching (models with Gated DeltaNet layers): held, and room for",
          {{"used", d(s.state_snapshots)}, {"capacity", d(s.state_snapshot_slots)}}, "state");
    gauge("qkvserve_state_bytes_per_sequence", "f32 bytes of state one sequence holds, whatever its length",
          {{"", d(s.state_bytes_per_slot)}});
    counter("qkvserve_prefix_cache_queries_tokens_total", "prompt tokens looked up in the prefix cache",
            {{"", d(s.prefix_queries_tokens)}});
    counter("qkvserve_prefix_cache_hits_tokens_total", "prompt tokens found in the prefix cache",
            {{"", d(s.prefix_hits_tokens)}});
    gauge("qkvserve_sessions", "sessions: resident (KV held) or evicted (history only)",
          {{"resident", d(s.sessions_resident)}, {"evicted", d(s.sessions_evicted)}}, "state");
    gauge("qkvserve_session_kv_bytes", "KV bytes held by sessions", {{"", d(s.session_kv_bytes)}});
    counter("qkvserve_session_evictions_total", "sessions that lost their KV (memory) or were closed (ttl, closed)",
            {{"memory", d(s.session_evictions_memory)},
             {"ttl", d(s.session_evictions_ttl)},
             {"closed", d(s.session_evictions_closed)}},
            "reason");
    counter("qkvserve_preemptions_total", "running requests preempted by recompute", {{"", d(s.preemptions)}});
    gauge("qkvserve_requests", "requests by state",
          {{"running", d(s.requests_running)}, {"waiting", d(s.requests_waiting)}}, "state");
    gauge("qkvserve_grpc_live_reactors", "Generate and Complete calls in progress (their reactors alive)",
          {{"", d(LiveStreamReactors())}});
    counter("qkvserve_requests_finished_total", "finished requests by reason",
            {{"stop", d(s.finished_stop)},
             {"length", d(s.finished_length)},
             {"cancelled", d(s.finished_cancelled)},
             {"error", d(s.finished_error)}},
            "reason");
    {
      MetricFamily f =
          Family("qkvserve_requests_by_front_total",
                 "finished requests by the front that took them (grpc, http) and reason", MetricType::Counter);
      for (const char* front : {"grpc", "http"}) {  // both fronts always present, so rates start at zero
        for (const char* reason : {"stop", "length", "cancelled", "error"}) {
          auto it = s.finished_by_front.find({front, reason});
          Add(f, it == s.finished_by_front.end() ? 0.0 : d(it->second), {{"front", front}, {"reason", reason}});
        }
      }
      out.push_back(std::move(f));
    }
    counter("qkvserve_prompt_tokens_total", "prompt tokens processed (whole context)", {{"", d(s.prompt_tokens)}});
    counter("qkvserve_cached_prompt_tokens_total", "prompt tokens reused without recompute",
            {{"", d(s.cached_prompt_tokens)}});
    counter("qkvserve_generated_tokens_total", "generated tokens", {{"", d(s.generated_tokens)}});
    if (!s.expert_tokens.empty()) {  // mixture of experts: how the router spreads tokens (skew shows here)
      MetricFamily f = Family("qkvserve_moe_expert_tokens_total",
                              "tokens routed to each expert of each mixture-of-experts layer (one per token and "
                              "chosen expert; prefill, decode and recompute alike)",
                              MetricType::Counter);
      for (const auto& [layer, counts] : s.expert_tokens) {
        for (size_t e = 0; e < counts.size(); ++e) {
          Add(f, d(counts[e]), {{"layer", std::to_string(layer)}, {"expert", std::to_string(e)}});
        }
      }
      out.push_back(std::move(f));
    }
    AddHistogram(out, "qkvserve_time_to_first_token_seconds", "submit to first token", s.ttft);
    AddHistogram(out, "qkvserve_inter_token_latency_seconds", "time between tokens of a request", s.itl);
    AddHistogram(out, "qkvserve_request_duration_seconds", "submit to end", s.e2e);
    AddHistogram(out, "qkvserve_queue_time_seconds", "submit to first scheduled", s.queue);
    AddHistogram(out, "qkvserve_step_duration_seconds", "engine step (forward pass and sampling)", s.step);
    AddHistogram(out, "qkvserve_batch_size_tokens", "tokens per engine step", s.batch_tokens);
    AddHistogram(out, "qkvserve_command_wait_seconds",
                 "time a command (submit, session call) waits for the engine thread", s.command_wait);
    gauge("qkvserve_memory_bytes", "resident memory by owner",
          {{"weights", d(mem.weights)},
           {"kv_arena", d(mem.kv_arena)},
           {"state", d(mem.state)},
           {"scratch", d(mem.scratch)},
           {"heap", d(mem.heap)},
           {"other", d(mem.other)}},
          "component");
    gauge("qkvserve_resident_memory_bytes", "process RSS", {{"", d(mem.rss)}});
    MetricFamily info =
        Family("qkvserve_build_info", "constant 1, labelled with the build and model", MetricType::Gauge);
    Add(info, 1.0,
        {{"version", QKV_VERSION},
         {"model", model_},
         {"architecture", ArchName(engine_.model().config().arch)},
         {"attention", engine_.model().config().AttentionKind()}});
    out.push_back(std::move(info));
    return out;
  }

 private:
  const Engine& engine_;
  std::string model_;
};

// /debug/accounting: the engine's consistency check, run on the engine thread at scrape time.
class AccountingCollectable final : public prometheus::Collectable {
 public:
  explicit AccountingCollectable(Engine& engine) : engine_(engine) {}
  std::vector<MetricFamily> Collect() const override {
    const std::string err = engine_.CheckConsistency();
    MetricFamily f = Family("qkvserve_debug_accounting_errors",
                            "1 when the engine's block or state accounting is inconsistent (label: the first error)",
                            MetricType::Gauge);
    if (err.empty()) {
      Add(f, 0);
    } else {
      Add(f, 1, {{"error", err}});
    }
    return {f};
  }

 private:
  Engine& engine_;
};

}  // namespace

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen, const Engine& engine,
                                                              const std::string& model_name, Engine* accounting) {
  auto m = std::unique_ptr<MetricsServer>(new MetricsServer());
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(listen, 2);
  } catch (const std::exception& e) {
    return InvalidArgument("--metrics-listen " + listen + ": " + e.what());
  }
  auto coll = std::make_shared<EngineCollectable>(engine, model_name);
  m->exposer_->RegisterCollectable(coll);
  m->collectable_ = coll;
  if (accounting) {
    auto acc = std::make_shared<AccountingCollectable>(*accounting);
    m->exposer_->RegisterCollectable(acc, "/debug/accounting");
    m->accounting_ = acc;
  }
  const auto ports = m->exposer_->GetListeningPorts();
  m->port_ = ports.empty() ? 0 : ports.front();
  return m;
}

MetricsServer::~MetricsServer() = default;

}  // namespace qkv::server
