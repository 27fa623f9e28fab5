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
  // Listens on host:port (port 0 picks a free one).
  static StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen, const Engine& engine,
                                                        const std::string& model_name);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<void> collectable_;
  int port_ = 0;
};

}  // namespace qkv::server
