#include "engine/kernels/weights_arena.h"

#include <sys/mman.h>

#include <cstdlib>
#include <fstream>
#include <new>
#include <string_view>
#include <utility>

namespace qkv {

namespace {

constexpr size_t kAlign = 64;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

bool WeightsArena::HugePagesFromEnv() {
  const char* e = std::getenv("QKV_HUGE_PAGES");
  return e == nullptr || std::string_view(e) != "0";
}

std::string ThpMode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(in, line)) return "unavailable";
  const size_t a = line.find('['), b = line.find(']');
  return a != std::string::npos && b > a ? line.substr(a + 1, b - a - 1) : line;
}

WeightsArena::WeightsArena(bool huge_pages) : huge_pages_(huge_pages) {}

WeightsArena::~WeightsArena() {
  for (const Region& r : regions_) munmap(r.base, r.size);
}

uint8_t* WeightsArena::Map(size_t size) {
  // Over-map by a huge page and trim, so that the region starts on a 2 MiB boundary.
  const size_t span = size + kHugePage;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  auto* raw = static_cast<uint8_t*>(p);
  const auto addr = reinterpret_cast<uintptr_t>(raw);
  uint8_t* base = raw + (RoundUp(addr, kHugePage) - addr);
  if (base > raw) munmap(raw, static_cast<size_t>(base - raw));
  const size_t tail = static_cast<size_t>(raw + span - (base + size));
  if (tail > 0) munmap(base + size, tail);
  // Advice only: a kernel without THP (or with it set to "never") maps 4 KiB pages, as without the arena.
  if (huge_pages_) madvise(base, size, MADV_HUGEPAGE);
  return base;
}

uint8_t* WeightsArena::Allocate(size_t bytes) {
  const size_t want = RoundUp(bytes == 0 ? 1 : bytes, kAlign);
  std::lock_guard<std::mutex> lock(mu_);
  if (want > kRegion / 4) {  // a mapping of its own, not counted as the bump region
    Region r;
    r.size = RoundUp(want, kHugePage);
    r.base = Map(r.size);
    r.top = r.live = want;
    r.buffers = 1;
    regions_.push_back(r);
    return r.base;
  }
  if (current_ == SIZE_MAX || regions_[current_].top + want > regions_[current_].size) {
    Region r;
    r.size = kRegion;
    r.base = Map(r.size);
    regions_.push_back(r);
    current_ = regions_.size() - 1;
  }
  Region& r = regions_[current_];
  uint8_t* p = r.base + r.top;
  r.top += want;
  r.live += want;
  ++r.buffers;
  return p;
}

size_t WeightsArena::Find(const void* p) const {
  const auto* b = static_cast<const uint8_t*>(p);
  size_t i = 0;
  while (i < regions_.size() && !(b >= regions_[i].base && b < regions_[i].base + regions_[i].size)) ++i;
  return i;
}

void WeightsArena::Free(const uint8_t* p, size_t bytes) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  const size_t i = Find(p);
  if (i == regions_.size()) std::abort();  // not ours: a bug, never a silent leak or a double unmap
  Region* r = &regions_[i];
  const size_t size = RoundUp(bytes == 0 ? 1 : bytes, kAlign);
  r->live -= size;
  // The last buffer handed out gives its space back (a layer that tries a GEMM and drops it at load).
  if (p + size == r->base + r->top) r->top -= size;
  if (--r->buffers > 0) return;
  munmap(r->base, r->size);
  regions_.erase(regions_.begin() + static_cast<std::ptrdiff_t>(i));
  if (current_ == i) {
    current_ = SIZE_MAX;
  } else if (current_ != SIZE_MAX && current_ > i) {
    --current_;
  }
}

size_t WeightsArena::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const Region& r : regions_) n += r.live;
  return n;
}

size_t WeightsArena::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const Region& r : regions_) n += RoundUp(r.top, kHugePage);
  return n;
}

size_t WeightsArena::slack_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const Region& r : regions_) n += RoundUp(r.top, kHugePage) - r.live;
  return n;
}

bool WeightsArena::Contains(const void* p) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Find(p) < regions_.size();
}

std::vector<const uint8_t*> WeightsArena::RegionStarts() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const uint8_t*> v;
  for (const Region& r : regions_) v.push_back(r.base);
  return v;
}

WeightsBuffer::WeightsBuffer(std::shared_ptr<WeightsArena> arena, size_t bytes)
    : arena_(std::move(arena)), size_(bytes) {
  data_ = arena_ ? arena_->Allocate(bytes)
                 : static_cast<uint8_t*>(::operator new (bytes == 0 ? 1 : bytes, std::align_val_t{kAlign}));
}

WeightsBuffer& WeightsBuffer::operator=(WeightsBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    arena_ = std::move(o.arena_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void WeightsBuffer::Reset() {
  if (data_ != nullptr) {
    if (arena_) {
      arena_->Free(data_, size_);
    } else {
      ::operator delete (data_, std::align_val_t{kAlign});
    }
  }
  data_ = nullptr;
  size_ = 0;
  arena_.reset();
}

}  // namespace qkv
