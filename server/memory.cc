#include "server/memory.h"

#include <malloc.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace qkv::server {

MemoryBreakdown MeasureMemory(const Model& model) {
  MemoryBreakdown m;
  m.weights = static_cast<int64_t>(model.weight_memory_bytes());
  // The stores the scheduler allocated from this layout: the KV arena and the state slots.
  m.kv_arena = model.cache_layout().token_bytes();
  m.state = model.cache_layout().state_bytes();
  m.scratch = static_cast<int64_t>(model.scratch_bytes());
  const struct mallinfo2 mi = mallinfo2();
  // The allocator's footprint: arena space obtained from the system (in use or free) plus mmapped chunks.
  const int64_t in_use = static_cast<int64_t>(mi.arena + mi.hblkhd);
  // The state slots are malloc'ed, and the weights outside the arena (kernels/weights_arena.h).
  m.heap = std::max<int64_t>(0, in_use - static_cast<int64_t>(model.weight_heap_bytes()) - m.scratch - m.state);
  int64_t rss_kb = 0, anon_kb = 0;
  std::ifstream in("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(in, line)) {  // the first line is the address range header
    long long kb = 0;
    if (std::sscanf(line.c_str(), "Rss: %lld kB", &kb) == 1)
      rss_kb = kb;
    else if (std::sscanf(line.c_str(), "Anonymous: %lld kB", &kb) == 1)
      anon_kb = kb;
  }
  m.rss = rss_kb * 1024;
  m.other = (rss_kb - anon_kb) * 1024;
  return m;
}

}  // namespace qkv::server
