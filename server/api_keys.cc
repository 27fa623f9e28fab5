#include "server/api_keys.h"

#include <sstream>

namespace qkv::server {
namespace {

bool ParseInt(const std::string& s, int* out) {
  try {
    size_t used = 0;
    const long v = std::stol(s, &used);
    if (used != s.size() || v < INT32_MIN || v > INT32_MAX) return false;
    *out = static_cast<int>(v);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

Status ParsePriorityRange(const std::string& s, int* lo, int* hi) {
  const size_t dots = s.find("..");
  if (dots == std::string::npos || !ParseInt(s.substr(0, dots), lo) || !ParseInt(s.substr(dots + 2), hi) || *lo > *hi) {
    return InvalidArgument("priority range must be LO..HI with LO <= HI, got '" + s + "'");
  }
  return {};
}

StatusOr<std::map<std::string, TenantQuota>> ParseApiKeys(std::istream& in, const TenantQuota& defaults) {
  std::map<std::string, TenantQuota> keys;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    std::istringstream words(line);
    std::string key;
    if (!(words >> key) || key[0] == '#') continue;
    const std::string where = "line " + std::to_string(n) + ": ";
    TenantQuota q = defaults;
    std::string w;
    while (words >> w) {
      const size_t eq = w.find('=');
      const std::string name = eq == std::string::npos ? w : w.substr(0, eq);
      const std::string value = eq == std::string::npos ? "" : w.substr(eq + 1);
      int v = 0;
      if (name == "priority") {
        QKV_RETURN_IF_ERROR(ParsePriorityRange(value, &q.min_priority, &q.max_priority));
      } else if ((name == "sessions" || name == "waiting" || name == "running") && ParseInt(value, &v) && v >= 0) {
        (name == "sessions" ? q.max_sessions : name == "waiting" ? q.max_waiting : q.max_running) = v;
      } else {
        return InvalidArgument(where + "expected sessions=N, waiting=N, running=N or priority=LO..HI, got '" + w + "'");
      }
    }
    if (!keys.emplace(key, q).second) return InvalidArgument(where + "the key is listed twice");
  }
  return keys;
}

}  // namespace qkv::server
