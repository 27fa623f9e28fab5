// Loops over a step's rows or work items on the OpenMP team, with nothing spent when there is one.
//
// An OpenMP region costs even when its if clause makes it serial: libgomp still sets up a team of one,
// ~1.2 µs per region on a 2-core EPYC VM (2026-12-04), and at single-stream decode (T = 1) the layers ran
// four such regions per layer (64 a token on a 16-layer model) while the other thread waited. These
// helpers call f(0) directly when n is 1.
#pragma once

namespace qkv {

// f(i) for i in [0, n): statically split across nthr threads when n > 1.
template <class F>
inline void ParallelRows(int n, int nthr, const F& f) {
  if (n == 1) {
    f(0);
    return;
  }
#pragma omp parallel for num_threads(nthr) schedule(static)
  for (int i = 0; i < n; ++i) f(i);
}

// The same, one item at a time to whichever thread is free (items of uneven cost: attention heads).
template <class F>
inline void ParallelItems(int n, int nthr, const F& f) {
  if (n == 1) {
    f(0);
    return;
  }
#pragma omp parallel for num_threads(nthr) schedule(dynamic, 1)
  for (int i = 0; i < n; ++i) f(i);
}

}  // namespace qkv
