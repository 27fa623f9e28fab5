// The cgroup limits that apply to this process: a CPU quota (kernels/cpu.h: how many compute threads) and a
// memory limit (model.cc: how large a KV cache by default). A limit may sit on any cgroup between the
// process's own and the root of the hierarchy (a systemd unit's MemoryMax= or CPUQuota=, a parent slice, a
// container's cgroup), so each is the tightest on the way up. Both hierarchies are read: cgroup v2 (the
// `0::/path` line of /proc/self/cgroup, files under the mount itself) and v1 (a line naming the controller,
// files under the controller's mount, e.g. /sys/fs/cgroup/cpu,cpuacct).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace qkv {

// The directories of the process's cgroup and of its ancestors, innermost first, down to the hierarchy's
// mount (included): `root` for v2 (`v1_controller` empty), the mount of `v1_controller` under `root` for v1
// (root/<controller>, or a directory whose comma-joined name lists it, such as cpu,cpuacct). A path that is
// not under the mount (a cgroup namespace hides it, or it climbs out with ".."), or no line for the hierarchy,
// gives the mount alone (inside a container it is the container's own cgroup); nothing when the mount does
// not exist.
std::vector<std::filesystem::path> CgroupDirs(const std::string& proc_self_cgroup, const std::string& root,
                                              const std::string& v1_controller = "");

// /proc/self/cgroup's text.
std::string ProcSelfCgroup();
// Where the hierarchies are mounted: $QKV_CGROUP_ROOT (tests lay out a tree there) or /sys/fs/cgroup.
std::string CgroupRoot();

// The tightest CPU quota on the way up, in CPUs (v2 cpu.max "quota period", "max" for none; v1
// cpu.cfs_quota_us / cpu.cfs_period_us, -1 for none); 0 when there is none.
double CgroupCpuQuota(const std::string& proc_self_cgroup, const std::string& root);

// The least memory any cgroup on the way up may still take: its limit minus what it (with its descendants)
// uses now (v2 memory.max - memory.current; v1 memory.limit_in_bytes - memory.usage_in_bytes, where a limit
// of 2^60 or more means none); at least 0; INT64_MAX when there is no limit.
int64_t CgroupMemoryHeadroom(const std::string& proc_self_cgroup, const std::string& root);

}  // namespace qkv
