// The attention kernels (GQA and MLA) on every KV-cache dtype against a plain double-precision computation
// over the values the cache holds, and the int8 cache's quantization and accounting.
#include "engine/kernels/attention.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/bf16.h"
#include "engine/kernels/cpu.h"
#include "engine/kernels/mla_attention.h"
#include "test_util.h"

namespace qkv {
namespace {

// Element i of a cache region of dtype dt; int8 regions keep the bf16 scale of each vector at scale_at.
double Element(const uint8_t* r, DType dt, size_t i, size_t scale_at) {
  switch (dt) {
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
      std::memcpy(&u, r + scale_at, 2);
      return static_cast<int8_t>(r[i]) * static_cast<double>(Bf16ToF32(u));
    }
  }
  return 0;
}

// The value the cache holds for element d of token `slot`'s K (or V) of kv head h in block b, decoded
// from the layout kv_cache.h and attention.cc document: keys [hd][bs], values [bs][hd]; int8 regions
// end with bs bf16 scales.
double Held(const KvCache& kv, int layer, int b, int h, int slot, int d, bool key) {
  const KvCacheShape& s = kv.shape();
  const uint8_t* r = key ? kv.K(layer, b, h) : kv.V(layer, b, h);
  const size_t i = key ? static_cast<size_t>(d) * s.block_size + slot : static_cast<size_t>(slot) * s.head_dim + d;
  return Element(r, s.dtype, i, static_cast<size_t>(s.block_size) * s.head_dim + 2 * slot);
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

// The arena is resident, zeroed and writable when Create returns (MAP_POPULATE), to its last byte.
TEST(KvCacheArena, ResidentAndZero) {
  KvCacheShape s{3, 2, 64, 16, 37, DType::kI8};  // 37 blocks: not a whole number of pages
  auto kv = KvCache::Create(s);
  ASSERT_TRUE(kv.ok());
  uint8_t* base = (*kv)->K(0, 0, 0);
  const size_t bytes = static_cast<size_t>((*kv)->arena_bytes());
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  ASSERT_EQ(mincore(base, bytes, resident.data()), 0);
  EXPECT_EQ(std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1) == 0; }), 0);
  EXPECT_EQ(std::count(base, base + bytes, 0), static_cast<std::ptrdiff_t>(bytes));
  base[bytes - 1] = 7;
  EXPECT_EQ((*kv)->V(2, 36, 1)[static_cast<size_t>(16) * KvVectorBytes(DType::kI8, 64) - 1], 7);
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

// MLA (kernels/mla_attention.h): element d of token `slot`'s latent (K plane) or rope key (V plane) in
// block b, both row-major [bs][width]; int8 regions end with bs bf16 scales.
double HeldLatent(const KvCache& kv, int layer, int b, int slot, int d, bool latent) {
  const KvCacheShape& s = kv.shape();
  const int width = latent ? s.head_dim : s.value_dim();
  const uint8_t* r = latent ? kv.K(layer, b, 0) : kv.V(layer, b, 0);
  return Element(r, s.dtype, static_cast<size_t>(slot) * width + d,
                 static_cast<size_t>(s.block_size) * width + 2 * slot);
}

struct LatentCase {
  DType dt;
  int n_heads, latent_dim, rope_dim, block_size;
};

// AttendLatent over n_ctx positions at the current kernel level against softmax((q_lat·c + q_pe·k_pe) ×
// scale) c in double over the held values; and, within the level, the same bits whichever heads share a
// call (all heads at once, one by one, and in uneven groups), with the other heads' outputs untouched.
void CheckLatent(const LatentCase& c, int n_ctx) {
  const int R = c.latent_dim, P = c.rope_dim, W = R + P, nh = c.n_heads;
  const int blocks_needed = (n_ctx + c.block_size - 1) / c.block_size;
  KvCacheShape shape{1, 1, R, c.block_size, blocks_needed + 2, c.dt, P};
  auto kv = KvCache::Create(shape);
  ASSERT_TRUE(kv.ok());
  std::vector<int> blocks;  // not in order, to exercise the block table
  for (int b = 0; b < blocks_needed; ++b) blocks.push_back((b * 3 + 2) % (blocks_needed + 2));
  std::mt19937 rng(R * 131 + P * 17 + nh * 7 + c.block_size + static_cast<int>(c.dt));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> latent(R), rope(P);
  for (int p = 0; p < n_ctx; ++p) {
    for (float& x : latent) x = nd(rng) * (1 + p % 3);
    for (float& x : rope) x = nd(rng) * (1 + p % 2);
    StoreLatent(**kv, 0, blocks.data(), p, latent.data(), rope.data());
  }
  std::vector<float> q(static_cast<size_t>(nh) * W);
  for (float& x : q) x = nd(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(W));
  const std::string what = std::string(KernelIsaName(ActiveKernelIsa())) + " " + DTypeName(c.dt) + " heads " +
                           std::to_string(nh) + " R " + std::to_string(R) + " P " + std::to_string(P) + " bs " +
                           std::to_string(c.block_size) + " n_ctx " + std::to_string(n_ctx);
  // Heads in calls of the given sizes; scratch full of NaNs (a lane read before written poisons the output).
  auto attend = [&](const std::vector<int>& sizes) {
    std::vector<float> out(static_cast<size_t>(nh) * R, -7.0f);
    for (size_t i = 0, h0 = 0; h0 < static_cast<size_t>(nh); ++i) {
      const int n = std::min(sizes[i % sizes.size()], nh - static_cast<int>(h0));
      std::vector<float> scratch(LatentAttentionScratchFloats(n, n_ctx, c.block_size), NAN);
      std::vector<float> before = out;
      AttendLatent(**kv, 0, blocks.data(), n_ctx, q.data(), out.data(), static_cast<int>(h0), n, scale, scratch.data());
      for (size_t e = 0; e < out.size(); ++e) {
        if (e >= h0 * R && e < (h0 + n) * R) continue;
        EXPECT_EQ(out[e], before[e]) << what << ": heads from " << h0 << " wrote element " << e;
      }
      h0 += n;
    }
    return out;
  };
  const std::vector<float> out = attend({nh});
  for (const std::vector<int>& sizes : {std::vector<int>{1}, std::vector<int>{3, 2}, std::vector<int>{5}}) {
    const std::vector<float> o = attend(sizes);
    ASSERT_EQ(0, std::memcmp(o.data(), out.data(), sizeof(float) * o.size()))
        << what << ": heads in calls of " << sizes[0] << " give other bits";
  }
  double worst = 0;
  for (int h = 0; h < nh; ++h) {
    const float* qh = q.data() + static_cast<size_t>(h) * W;
    std::vector<double> w(n_ctx);
    double m = -INFINITY;
    for (int p = 0; p < n_ctx; ++p) {
      const int b = blocks[p / c.block_size], slot = p % c.block_size;
      double dot = 0;
      for (int d = 0; d < R; ++d) dot += qh[d] * HeldLatent(**kv, 0, b, slot, d, true);
      for (int d = 0; d < P; ++d) dot += qh[R + d] * HeldLatent(**kv, 0, b, slot, d, false);
      w[p] = dot * scale;
      m = std::max(m, w[p]);
    }
    double sum = 0;
    for (double& x : w) sum += (x = std::exp(x - m));
    for (int d = 0; d < R; ++d) {
      double o = 0;
      for (int p = 0; p < n_ctx; ++p)
        o += w[p] / sum * HeldLatent(**kv, 0, blocks[p / c.block_size], p % c.block_size, d, true);
      worst = std::max(worst, std::fabs(o - out[static_cast<size_t>(h) * R + d]));
    }
  }
  EXPECT_LT(worst, 2e-5) << what;
}

// Every path of the MLA kernel at every level the CPU has: 1-9 heads (tiles of up to 4 heads), latent widths
// with and without whole 16- and 64-value chunks and tails, rope widths below one vector and with a tail,
// odd and even token counts per block (tiles of two tokens), contexts that end inside a block.
TEST(LatentAttention, MatchesDoublePrecisionAtEveryLevel) {
  testing::KernelLevelGuard guard;
  for (KernelIsa isa : {KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (CpuKernelIsa() < isa) {
      std::printf("[ SKIPPED  ] level %s: the CPU has %s\n", KernelIsaName(isa), KernelIsaName(CpuKernelIsa()));
      continue;
    }
    SetKernelIsaForTesting(isa);
    for (DType dt : {DType::kF32, DType::kBF16, DType::kI8}) {
      for (auto [R, P] : {std::pair{64, 16}, {128, 8}, {80, 4}, {36, 20}}) {
        for (int nh : {1, 4, 6, 9}) {
          for (int bs : {16, 5}) {
            for (int n : {1, 2, 17, 40, 131}) CheckLatent({dt, nh, R, P, bs}, n);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace qkv
