#include "engine/kernels/amx_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "engine/bf16.h"

namespace qkv {
namespace {

constexpr int P = AmxWeights::kPanel, C = AmxWeights::kChunk, R = AmxWeights::kTileRows;
constexpr size_t kTileElems = static_cast<size_t>(R) * C;  // bf16 elements of one A or B tile (1 KiB)

// The tile instructions as inline assembly (tile numbers are immediates; the assembler knows AMX, so no
// target attribute is needed and the functions are only ever called on CPUs with AMX, see kernels/cpu.h).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void LoadConfig(const TileConfig& c) { asm volatile("ldtilecfg %0" ::"m"(c)); }
inline void Release() { asm volatile("tilerelease" ::); }
template <int T>
inline void Zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int T>
inline void Load(const void* p, size_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void Store(void* p, size_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
// tmm[Cd] += tmm[A] · tmm[B]
template <int Cd, int A, int B>
inline void Dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(Cd), "i"(A), "i"(B));
}

template <int N, typename F>
inline void For(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }
  (std::make_integer_sequence<int, N>{});
}

// MT M tiles × NT panels (one group) over every chunk. Tiles: for one M tile C[j] = j, A = 3 or 4 (even or
// odd chunk), B[j] = 5 + j; for two, C[i][j] = 2i + j, A[i] = 4 + i, B[j] = 6 + j. b: the group's first
// tile, whose NT panels' tiles of one chunk are adjacent. out: [MT * 16][NT * 16] f32.
// Each tile load is issued right before the product that reads it, and a one-tile block alternates two A
// tiles: a load into a tile waits until the products reading its old contents are done (loads issued
// first, or one A tile, measured 2-3x slower per weight tile). Decode reads the group's tiles as one
// sequential stream and prefetches 4 KiB ahead of it (+20-30% from memory; a prefetch for every block
// slowed prefill, whose weights are in L2).
constexpr int kAhead = 4096;

template <int MT, int NT>
void Block(const uint16_t* a, size_t a_tile_stride, const uint16_t* b, int chunks, float* out) {
  static_assert(MT >= 1 && MT <= 2 && NT >= 1 && NT <= AmxWeights::kGroup);
  For<MT * NT>([&](auto t) { Zero<t>(); });
  if constexpr (MT == 1) {
    const char* end = reinterpret_cast<const char*>(b + static_cast<size_t>(chunks) * NT * kTileElems);
    auto step = [&](int ch, auto at, auto bt) {
      const char* ahead = reinterpret_cast<const char*>(b + static_cast<size_t>(ch) * NT * kTileElems) + kAhead;
      for (int l = 0; l < NT * 1024 && ahead + l < end; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
      Load<at>(a + ch * kTileElems, C * 2);
      For<NT>([&](auto j) {
        Load<bt + j>(b + (static_cast<size_t>(ch) * NT + j) * kTileElems, C * 2);
        Dot<j, at, bt + j>();
      });
    };
    int ch = 0;
    for (; ch + 1 < chunks; ch += 2) {
      step(ch, std::integral_constant<int, 3>{}, std::integral_constant<int, 5>{});
      step(ch + 1, std::integral_constant<int, 4>{}, std::integral_constant<int, 5>{});
    }
    if (ch < chunks) step(ch, std::integral_constant<int, 3>{}, std::integral_constant<int, 5>{});
  } else {
    for (int ch = 0; ch < chunks; ++ch) {
      const uint16_t* bc = b + static_cast<size_t>(ch) * NT * kTileElems;
      const uint16_t* ac = a + ch * kTileElems;
      Load<4>(ac, C * 2);
      Load<6>(bc, C * 2);
      Dot<0, 4, 6>();
      if constexpr (NT == 2) {
        Load<7>(bc + kTileElems, C * 2);
        Dot<1, 4, 7>();
      }
      Load<5>(ac + a_tile_stride, C * 2);
      Dot<NT, 5, 6>();
      if constexpr (NT == 2) Dot<3, 5, 7>();
    }
  }
  For<MT>([&](auto i) {
    For<NT>([&](auto j) { Store<i * NT + j>(out + static_cast<size_t>(i) * R * NT * P + j * P, NT * P * 4); });
  });
}

using BlockFn = void (*)(const uint16_t*, size_t, const uint16_t*, int, float*);

BlockFn Pick(int mt, int nt) {
  if (mt == 1) return nt == 1 ? Block<1, 1> : Block<1, 2>;
  return nt == 1 ? Block<2, 1> : Block<2, 2>;
}

}  // namespace

size_t AmxWeights::TileOffset(int panel, int chunk) const {
  const int g = panel / kGroup, size = std::min(kGroup, panels() - g * kGroup);
  return ((static_cast<size_t>(g) * kGroup * chunks()) + static_cast<size_t>(chunk) * size + panel % kGroup) *
         kTileElems;
}

AmxWeights::AmxWeights(const float* w, const float* bias, int n, int k, std::shared_ptr<WeightsArena> arena)
    : n_(n), k_(k) {
  w_ = WeightsBuffer(std::move(arena), static_cast<size_t>(panels()) * chunks() * kTileElems * sizeof(uint16_t));
  std::memset(w_.data(), 0, w_.size());  // K past k and columns past n stay 0
  auto* const w16 = reinterpret_cast<uint16_t*>(w_.data());
  for (int c = 0; c < n; ++c) {
    const int p = c / P, col = c % P;
    for (int kk = 0; kk < k; ++kk) {
      const int ch = kk / C, pair = (kk % C) / 2, half = kk % 2;
      const size_t at = TileOffset(p, ch) + pair * C + col * 2 + half;
      w16[at] = F32ToBf16(w[static_cast<size_t>(c) * k + kk]);
    }
  }
  if (bias) {
    bias_.assign(static_cast<size_t>(panels()) * P, 0.0f);
    std::memcpy(bias_.data(), bias, sizeof(float) * n);
  }
}

uint16_t AmxWeights::Weight(int c, int kk) const {
  const int p = c / P, col = c % P, ch = kk / C, pair = (kk % C) / 2, half = kk % 2;
  return w()[TileOffset(p, ch) + pair * C + col * 2 + half];
}

void AmxWeights::PackRows(const float* x, int ldx, int m, int k, int tile0, int tile1, uint16_t* out) {
  const int kc = (k + C - 1) / C;
  for (int t = tile0; t < tile1; ++t) {
    // Rows past m are left as they are: their outputs are dropped, and no row enters another's result.
    for (int r = 0; r < R && t * R + r < m; ++r) {
      const float* src = x + static_cast<size_t>(t * R + r) * ldx;
      for (int ch = 0; ch < kc; ++ch) {
        uint16_t* dst = out + (static_cast<size_t>(t) * kc + ch) * kTileElems + r * C;
        const int len = std::min(C, k - ch * C);
        F32ToBf16Bulk(src + ch * C, dst, len);
        std::fill(dst + len, dst + C, uint16_t{0});  // zero, not stale: they meet the zero weights past k
      }
    }
  }
}

void AmxWeights::Compute(const uint16_t* rows, int m, int group0, int group1, float* y, int ldy) const {
  if (m <= 0 || group0 >= group1) return;
  const int kc = chunks();
  const int mtiles = (m + R - 1) / R;
  // One M tile: the C and A tiles (0-4) hold only the m rows there are (a shorter A load); a row's result
  // does not depend on how many rows its tile has (tests/linear_test.cc checks every M against M = 1).
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = C * 2;
    cfg.rows[t] = mtiles == 1 && t < 5 ? static_cast<uint8_t>(m) : R;
  }
  LoadConfig(cfg);
  const size_t a_stride = static_cast<size_t>(kc) * kTileElems;
  alignas(64) float out[2 * R * kGroup * P];  // the largest block: 2 M tiles x a group
  auto block = [&](int mt, int nm, int g) {
    const int p = g * kGroup, np = std::min(kGroup, panels() - p);
    Pick(nm, np)(rows + mt * a_stride, a_stride, w() + TileOffset(p, 0), kc, out);
    const int r0 = mt * R, nr = std::min(nm * R, m - r0);
    const int c0 = p * P, nc = std::min(np * P, n_ - c0);
    for (int r = 0; r < nr; ++r) {
      const float* src = out + static_cast<size_t>(r) * np * P;
      float* dst = y + static_cast<size_t>(r0 + r) * ldy + c0;
      if (bias_.empty()) {
        std::memcpy(dst, src, sizeof(float) * nc);
      } else {
        for (int c = 0; c < nc; ++c) dst[c] = src[c] + bias_[c0 + c];
      }
    }
  };
  // A group's weights (K × 32 values, in L2) against every pair of M tiles; decode streams them once.
  for (int g = group0; g < group1; ++g) {
    for (int mt = 0; mt < mtiles; mt += 2) block(mt, std::min(2, mtiles - mt), g);
  }
  Release();
}

}  // namespace qkv
