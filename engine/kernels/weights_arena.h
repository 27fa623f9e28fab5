// Memory for a model's weights: 64 MiB regions, 2 MiB-aligned and advised for transparent huge pages
// (madvise(MADV_HUGEPAGE); THP is "madvise" on Debian's and most distributions' kernels), carved up by a
// bump pointer. A decoded token streams every active weight once, so with 4 KiB pages it walks the page
// tables for each 4 KiB and, at load, faults each one in; the MoE benchmark file's 1,152 expert matrices are
// 0.3–0.6 MB each, too small for the C allocator to hand out huge-page-backed chunks. Loading that file
// took a third less time with the arena (docs/performance.md, "Weights on huge pages").
//
// One arena per model (GemmRuntime owns it; every WeightsBuffer holds a reference, so it outlives them). A
// region is unmapped when its last buffer goes. Buffers larger than a quarter of a region get a mapping of
// their own. QKV_HUGE_PAGES=0 in the environment maps the same regions without the advice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace qkv {

class WeightsArena {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;
  static constexpr size_t kRegion = size_t{64} << 20;
  // huge_pages: advise the regions for transparent huge pages (default: unless QKV_HUGE_PAGES=0).
  explicit WeightsArena(bool huge_pages = HugePagesFromEnv());
  ~WeightsArena();
  WeightsArena(const WeightsArena&) = delete;
  WeightsArena& operator=(const WeightsArena&) = delete;

  // `bytes` of uninitialized memory, 64-byte aligned (never null; throws std::bad_alloc when the system
  // has no memory left, as operator new does). Release it with Free(p, the same bytes).
  uint8_t* Allocate(size_t bytes);
  void Free(const uint8_t* p, size_t bytes);

  bool huge_pages() const { return huge_pages_; }
  // Bytes of the live buffers.
  size_t used_bytes() const;
  // What the regions can hold resident: each region's high-water mark rounded up to a huge page (a page
  // partly written is resident whole). held − used is the arena's slack, counted with the weights in the
  // memory metrics.
  size_t held_bytes() const;
  // held − used, read at one instant.
  size_t slack_bytes() const;
  // Whether p lies in one of the arena's regions, and where they start.
  bool Contains(const void* p) const;
  std::vector<const uint8_t*> RegionStarts() const;

  static bool HugePagesFromEnv();

 private:
  struct Region {
    uint8_t* base = nullptr;
    size_t size = 0;  // mapped
    size_t top = 0;   // bytes handed out from base (bump pointer)
    size_t live = 0;  // bytes of live buffers
    int buffers = 0;  // live buffers
  };
  // The index of the region p lies in, or regions_.size().
  size_t Find(const void* p) const;
  uint8_t* Map(size_t size);
  const bool huge_pages_;
  mutable std::mutex mu_;  // buffers are made on the loading thread, but may be freed on any
  std::vector<Region> regions_;
  size_t current_ = SIZE_MAX;  // index of the region the bump pointer is in, if any
};

// The kernel's transparent huge page mode ("always", "madvise", "never"), or "unavailable" when the kernel
// has none (/sys/kernel/mm/transparent_hugepage/enabled).
std::string ThpMode();

// A weights buffer from an arena (or from operator new without one), freed on destruction. Move-only.
class WeightsBuffer {
 public:
  WeightsBuffer() = default;
  WeightsBuffer(std::shared_ptr<WeightsArena> arena, size_t bytes);
  ~WeightsBuffer() { Reset(); }
  WeightsBuffer(WeightsBuffer&& o) noexcept { *this = std::move(o); }
  WeightsBuffer& operator=(WeightsBuffer&& o) noexcept;
  WeightsBuffer(const WeightsBuffer&) = delete;
  WeightsBuffer& operator=(const WeightsBuffer&) = delete;
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const WeightsArena* arena() const { return arena_.get(); }

 private:
  void Reset();
  std::shared_ptr<WeightsArena> arena_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace qkv
