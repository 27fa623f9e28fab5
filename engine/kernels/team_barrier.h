// A barrier for the threads of one OpenMP team, between the phases of a one-token step that runs in one
// parallel region (Layer::ForwardTeam). libgomp's barrier costs the last thread to arrive ~1.5 µs on a
// 2-vCPU VM whose cross-core round trip is ~0.47 µs; this one costs it ~0.16 µs (docs/performance.md,
// "Decode synchronisation on a 2-vCPU VM"). A decoded token of the MoE benchmark model has 112 phase ends.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <thread>

namespace qkv {

class TeamBarrier {
 public:
  // Returns once `n` threads (the team's size, omp_get_num_threads()) have called Wait since the last
  // release. Writes made before Wait by any of them are visible after it to all of them. Spins, then
  // yields the CPU (an oversubscribed machine must not lose a time slice to a spinning waiter).
  void Wait(int n) {
    if (n <= 1) return;
    const unsigned g = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(g + 1, std::memory_order_release);
      return;
    }
    for (int i = 0; gen_.load(std::memory_order_acquire) == g; ++i) {
      if (i < kSpins) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 1 << 14;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<unsigned> gen_{0};
};

}  // namespace qkv
