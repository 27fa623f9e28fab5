// Where the process's resident memory goes, each part measured from its owner:
//   weights  - the converted weights the model holds (malloc'd by the engine and oneDNN);
//   kv_arena - the KV arena (an anonymous mapping touched at start-up);
//   scratch  - buffers sized at load (activations, logits, attention and oneDNN scratchpads);
//   heap     - the allocator's footprint (mallinfo2 arena + mmapped chunks) beyond weights and scratch;
//   other    - file-backed resident pages (the binary, shared libraries) from /proc/self/smaps_rollup.
// The parts sum to RSS up to what none of them sees (thread stacks, JIT code, allocator slack).
#pragma once

#include <cstdint>

#include "engine/model.h"

namespace qkv::server {

struct MemoryBreakdown {
  int64_t weights = 0, kv_arena = 0, state = 0, scratch = 0, heap = 0, other = 0;
  int64_t rss = 0;
  int64_t sum() const { return weights + kv_arena + state + scratch + heap + other; }
};

MemoryBreakdown MeasureMemory(const Model& model);

}  // namespace qkv::server
