// The attention kernel on every KV-cache dtype against a plain double-precision computation over the
// values the cache holds, and the int8 cache's quantization and accounting.
#include "engine/kernels/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/bf16.h"
#include "engine/kernels/cpu.h"
#include "test_util.h"

namespace qkv {
namespace {

// The value the cache holds for element d of token `slot`'s K (or V) of kv head h in block b, decoded
// from the layout kv_cache.h and attention.cc document: keys [hd][bs], values [bs][hd]; int8 regions
// end with bs bf16 scales.
double Held(const KvCache& kv, int layer, int b, int h, int slot, int d, bool key) {
  const KvCacheShape& s = kv.shape();
  const uint8_t* r = key ? kv.K(layer, b, h) : kv.V(layer, b, h);
  const size_t i = key ? static_cast<size_t>(d) * s.block_size + slot : static_cast<size_t>(slot) * s.head_dim + d;
  switch (s.dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, r + 4 * i, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t u;
      std::memcpy(&u, r + 2 * i, 2);
      return Bf16ToF32(u);
    }
    case DType::kI8: {
      uint16_t u;
      std::memcpy(&u, r + static_cast<size_t>(s.block_size) * s.head_dim + 2 * slot, 2);
      return static_cast<int8_t>(r[i]) * static_cast<double>(Bf16ToF32(u));
    }
  }
  return 0;
}

struct Case {
  DType dt;
  int n_heads, n_kv_heads, head_dim, block_size;
  bool sinks;
};

// AttendGroup over n_ctx positions against softmax(q·k/sqrt(d)) v in double over the held values.
void CheckAttention(const Case& c, int n_ctx, bool compare_levels = false) {
  const int blocks_needed = (n_ctx + c.block_size - 1) / c.block_size;
  KvCacheShape shape{1, c.n_kv_heads, c.head_dim, c.block_size, blocks_needed + 3, c.dt};
  auto kv = KvCache::Create(shape);
  ASSERT_TRUE(kv.ok());
  std::vector<int> blocks;  // not in order, to exercise the block table
  for (int b = 0; b < blocks_needed; ++b) blocks.push_back((b * 2 + 1) % (blocks_needed + 3));
  std::mt19937 rng(c.head_dim * 131 + c.n_heads * 7 + c.block_size + static_cast<int>(c.dt));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int kvd = c.n_kv_heads * c.head_dim;
  std::vector<float> k(kvd), v(kvd);
  for (int p = 0; p < n_ctx; ++p) {
    for (int i = 0; i < kvd; ++i) k[i] = nd(rng) * (1 + p % 3), v[i] = nd(rng);
    StoreKv(**kv, 0, blocks.data(), p, k.data(), v.data());
  }
  std::vector<float> q(static_cast<size_t>(c.n_heads) * c.head_dim), sinks(c.n_heads);
  for (float& x : q) x = nd(rng);
  for (float& x : sinks) x = nd(rng);
  AttentionShape as{c.n_heads, c.n_kv_heads, c.head_dim, c.sinks ? sinks.data() : nullptr};
  const int group = c.n_heads / c.n_kv_heads;
  auto attend = [&] {
    // Scratch full of NaNs: a kernel that reads a lane it did not write poisons its output.
    std::vector<float> scratch(AttentionScratchFloats(group, n_ctx, c.head_dim, c.block_size), NAN);
    std::vector<float> o(q.size(), 0.0f);
    for (int g = 0; g < c.n_kv_heads; ++g)
      AttendGroup(**kv, 0, blocks.data(), n_ctx, q.data(), o.data(), as, g, scratch.data());
    return o;
  };
  const std::vector<float> out = attend();
  if (compare_levels) {  // every level the CPU has above avx2 gives the avx2 kernel's bits
    testing::KernelLevelGuard guard;
    SetKernelIsaForTesting(KernelIsa::kAvx2);
    const std::vector<float> base = attend();
    for (KernelIsa isa : {KernelIsa::kAvx512, KernelIsa::kAmx}) {
      if (CpuKernelIsa() < isa) continue;
      SetKernelIsaForTesting(isa);
      const std::vector<float> o = attend();
      ASSERT_EQ(0, std::memcmp(o.data(), base.data(), sizeof(float) * o.size()))
          << KernelIsaName(isa) << " vs avx2: " << DTypeName(c.dt) << " heads " << c.n_heads << "/" << c.n_kv_heads
          << " hd " << c.head_dim << " bs " << c.block_size << " n_ctx " << n_ctx;
    }
  }
  double worst = 0;
  for (int h = 0; h < c.n_heads; ++h) {
    const int g = h / group;
    std::vector<double> w(n_ctx);
    double m = c.sinks ? sinks[h] : -INFINITY;
    for (int p = 0; p < n_ctx; ++p) {
      double dot = 0;
      for (int d = 0; d < c.head_dim; ++d)
        dot += q[h * c.head_dim + d] * Held(**kv, 0, blocks[p / c.block_size], g, p % c.block_size, d, true);
      w[p] = dot / std::sqrt(static_cast<double>(c.head_dim));
      m = std::max(m, w[p]);
    }
    double sum = c.sinks ? std::exp(sinks[h] - m) : 0.0;
    for (double& x : w) sum += (x = std::exp(x - m));
    for (int d = 0; d < c.head_dim; ++d) {
      double o = 0;
      for (int p = 0; p < n_ctx; ++p)
        o += w[p] / sum * Held(**kv, 0, blocks[p / c.block_size], g, p % c.block_size, d, false);
      worst = std::max(worst, std::fabs(o - out[h * c.head_dim + d]));
    }
  }
  EXPECT_LT(worst, 2e-5) << DTypeName(c.dt) << " heads " << c.n_heads << "/" << c.n_kv_heads << " hd " << c.head_dim
                         << " bs " << c.block_size << " n_ctx " << n_ctx;
}

// Every path of the kernel: group sizes 1-8 (the kernels take heads 1-8 at a time), head dims that are and
// are not multiples of 16 and 64, blocks of 16 (vector paths; f32/bf16 read in registers 1-8 blocks per tile
// when the head dim is a multiple of 16) and of 8 (generic path), sinks, and contexts that end inside a block
// (300: 19 blocks, whole multi-block tiles and their tail).
TEST(Attention, MatchesDoublePrecisionOnEveryCacheDtype) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI8}) {
    for (int hd : {8, 24, 32, 64, 128}) {
      for (auto [nh, nkv] : {std::pair{2, 2}, {4, 2}, {6, 2}, {8, 2}, {10, 2}, {16, 2}, {8, 1}}) {
        for (int bs : {16, 8}) {
          if (hd == 8 && dt != DType::kI8) continue;  // the f32/bf16 paths take any head dim too, but keep it short
          const Case c{dt, nh, nkv, hd, bs, nh == 6};
          for (int n : {1, 17, 40, 300}) CheckAttention(c, n);
        }
      }
    }
  }
}

// The kernel's AVX-512 path (kernels/cpu.h levels avx512 and up) gives the AVX2 path's bits on every path of
// the kernel above, and longer contexts (whole and partial 16-lane exponentials). Skipped where the CPU has
// no AVX-512.
TEST(Attention, EveryKernelLevelGivesTheSameBits) {
  if (CpuKernelIsa() < KernelIsa::kAvx512) GTEST_SKIP() << "CPU kernel level " << KernelIsaName(CpuKernelIsa());
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI8}) {
    for (int hd : {8, 24, 64, 128}) {
      for (auto [nh, nkv] : {std::pair{2, 2}, {4, 2}, {6, 2}, {14, 2}, {8, 1}}) {
        for (int bs : {16, 8}) {
          if (hd == 8 && dt != DType::kI8) continue;
          const Case c{dt, nh, nkv, hd, bs, nh == 6};
          for (int n : {1, 9, 17, 40, 300}) CheckAttention(c, n, true);
        }
      }
    }
  }
}

// int8: per token and kv head, scale = bf16(max|x| / 127) and |held - x| <= scale / 2; the largest element
// maps to ±127; an all-zero vector stays zero; separate tokens and heads have separate scales.
TEST(KvInt8, QuantizesPerTokenAndKvHead) {
  KvCacheShape shape{2, 2, 32, 16, 4, DType::kI8};
  auto kv = KvCache::Create(shape);
  ASSERT_TRUE(kv.ok());
  const int blocks[] = {3, 1};
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int p = 0; p < 20; ++p) {
    std::vector<float> k(64), v(64);
    for (int i = 0; i < 64; ++i) k[i] = nd(rng) * (p + 1), v[i] = p == 7 && i < 32 ? 0.0f : nd(rng) / (p + 1);
    StoreKv(**kv, 1, blocks, p, k.data(), v.data());
    for (int h = 0; h < 2; ++h) {
      for (bool key : {true, false}) {
        const float* x = (key ? k.data() : v.data()) + h * 32;
        float amax = 0;
        for (int d = 0; d < 32; ++d) amax = std::max(amax, std::fabs(x[d]));
        const double scale = Bf16ToF32(F32ToBf16(amax / 127.0f));
        int top = 0;
        for (int d = 0; d < 32; ++d) {
          const double held = Held(**kv, 1, blocks[p / 16], h, p % 16, d, key);
          EXPECT_LE(std::fabs(held - x[d]), scale / 2 + 1e-12) << p << " " << h << " " << d;
          if (scale > 0) top = std::max(top, static_cast<int>(std::lround(std::fabs(held) / scale)));
        }
        if (amax > 0) {
          EXPECT_EQ(top, 127) << p << " " << h;
        } else {
          EXPECT_EQ(scale, 0.0);
        }
      }
    }
  }
  // The other layer was not touched.
  for (int d = 0; d < 32; ++d) EXPECT_EQ(Held(**kv, 0, 3, 0, 0, d, true), 0.0);
}

// Bytes: per token, layers × 2 × kv heads × (head_dim + 2 for the bf16 scale); the arena is exactly that.
TEST(KvInt8, AccountingCountsTheScales) {
  KvCacheShape s{3, 2, 64, 16, 10, DType::kI8};
  EXPECT_EQ(KvVectorBytes(DType::kI8, 64), 66);
  EXPECT_EQ(KvVectorBytes(DType::kBF16, 64), 128);
  EXPECT_EQ(s.bytes_per_token(), 3 * 2 * 2 * 66);
  auto kv = KvCache::Create(s);
  ASSERT_TRUE(kv.ok());
  EXPECT_EQ((*kv)->arena_bytes(), s.bytes_per_token() * 16 * 10);
  KvCacheShape b = s;
  b.dtype = DType::kBF16;
  EXPECT_GE(static_cast<double>(b.bytes_per_token()) / s.bytes_per_token(), 1.9);
  EXPECT_EQ(ParseKvDType("int8").value(), DType::kI8);
  EXPECT_FALSE(ParseKvDType("q4").ok());
  EXPECT_FALSE(ParseDType("int8").ok());  // not a weights dtype
}

}  // namespace
}  // namespace qkv
