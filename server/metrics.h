// /metrics: Prometheus text built at scrape time from the engine's published stats snapshot (never the
// engine's lock). The metrics issue extends the families; names follow docs/metrics.md.
#pragma once

#include <memory>
#include <string>

#include "engine/engine.h"

namespace prometheus {
class Exposer;
}

namespace qkv::server {

class MetricsServer {
 public:
  // Listens on host:port (port 0 picks a free one). With `accounting` (--debug-accounting, for tests),
  // /debug/accounting runs the engine's block and state accounting check on every scrape:
  // qkvserve_debug_accounting_errors 0, or 1 with the first error as its label.
  static StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen, const Engine& engine,
                                                        const std::string& model_name, Engine* accounting = nullptr);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<void> collectable_, accounting_;
  int port_ = 0;
};

}  // namespace qkv::server
