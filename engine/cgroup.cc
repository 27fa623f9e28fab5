#include "engine/cgroup.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

namespace qkv {
namespace {

namespace fs = std::filesystem;

// The first word of a small file, or "" when it cannot be read.
std::string FirstWord(const fs::path& p) {
  std::ifstream f(p);
  std::string w;
  f >> w;
  return w;
}

// A whole decimal number, or `fallback` ("max", empty, garbage).
int64_t ToInt64(const std::string& s, int64_t fallback) {
  if (s.empty()) return fallback;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  return end && *end == '\0' ? static_cast<int64_t>(v) : fallback;
}

// `mount` joined with `path`, or `mount` alone when the result would not lie under it or does not exist.
fs::path Under(const fs::path& mount, std::string path) {
  while (!path.empty() && path.front() == '/') path.erase(path.begin());
  const fs::path dir = (mount / path).lexically_normal();
  const fs::path rel = dir.lexically_relative(mount);
  std::error_code ec;
  if (rel.empty() || *rel.begin() == ".." || !fs::is_directory(dir, ec)) return mount;
  return dir;
}

// The mount of a v1 controller under `root`: root/<controller>, else a directory whose name lists it.
fs::path V1Mount(const fs::path& root, const std::string& controller) {
  std::error_code ec;
  if (fs::is_directory(root / controller, ec)) return root / controller;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    std::istringstream names(e.path().filename().string());
    for (std::string n; std::getline(names, n, ',');) {
      if (n == controller && e.is_directory(ec)) return e.path();
    }
  }
  return {};
}

}  // namespace

std::vector<fs::path> CgroupDirs(const std::string& proc_self_cgroup, const std::string& root,
                                 const std::string& v1_controller) {
  const fs::path top = fs::path(root).lexically_normal();
  const fs::path own_mount = v1_controller.empty() ? top : V1Mount(top, v1_controller);
  std::error_code ec;
  if (own_mount.empty() || !fs::is_directory(own_mount, ec)) return {};
  std::istringstream lines(proc_self_cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    // hierarchy-ID:controller-list:path
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (v1_controller.empty()) {
      if (id != "0" || !controllers.empty()) continue;
    } else {
      bool listed = false;
      std::istringstream names(controllers);
      for (std::string n; std::getline(names, n, ',');) listed = listed || n == v1_controller;
      if (!listed) continue;
    }
    std::vector<fs::path> dirs;
    for (fs::path dir = Under(own_mount, path);; dir = dir.parent_path()) {
      dirs.push_back(dir);
      if (dir == own_mount || !dir.has_parent_path() || dir.parent_path() == dir || dirs.size() >= 64) break;
    }
    return dirs;
  }
  return {own_mount};  // no line for this hierarchy: its mount is still the container's own cgroup
}

std::string ProcSelfCgroup() {
  std::ifstream f("/proc/self/cgroup");
  std::stringstream text;
  text << f.rdbuf();
  return text.str();
}

std::string CgroupRoot() {
  const char* env = std::getenv("QKV_CGROUP_ROOT");
  return env && *env ? env : "/sys/fs/cgroup";
}

double CgroupCpuQuota(const std::string& proc_self_cgroup, const std::string& root) {
  double best = 0;
  auto take = [&](double q) {
    if (q > 0 && (best == 0 || q < best)) best = q;
  };
  for (const fs::path& dir : CgroupDirs(proc_self_cgroup, root)) {
    std::ifstream f(dir / "cpu.max");
    std::string quota;
    double period = 0;
    if (!(f >> quota >> period) || period <= 0) continue;
    const int64_t q = ToInt64(quota, -1);  // "max": none
    if (q > 0) take(static_cast<double>(q) / period);
  }
  for (const fs::path& dir : CgroupDirs(proc_self_cgroup, root, "cpu")) {
    const int64_t q = ToInt64(FirstWord(dir / "cpu.cfs_quota_us"), -1);
    const int64_t p = ToInt64(FirstWord(dir / "cpu.cfs_period_us"), 0);
    if (q > 0 && p > 0) take(static_cast<double>(q) / static_cast<double>(p));
  }
  return best;
}

int64_t CgroupMemoryHeadroom(const std::string& proc_self_cgroup, const std::string& root) {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  int64_t best = kNone;
  auto take = [&](int64_t limit, int64_t used) {
    if (limit == kNone) return;
    best = std::min(best, std::max<int64_t>(limit - used, 0));
  };
  for (const fs::path& dir : CgroupDirs(proc_self_cgroup, root)) {
    take(ToInt64(FirstWord(dir / "memory.max"), kNone), ToInt64(FirstWord(dir / "memory.current"), 0));
  }
  for (const fs::path& dir : CgroupDirs(proc_self_cgroup, root, "memory")) {
    int64_t limit = ToInt64(FirstWord(dir / "memory.limit_in_bytes"), kNone);
    if (limit >= (int64_t{1} << 60)) limit = kNone;  // v1 reports "no limit" as a huge number
    take(limit, ToInt64(FirstWord(dir / "memory.usage_in_bytes"), 0));
  }
  return best;
}

}  // namespace qkv
