// Quantized block formats and the GEMM on them: encoders, the integer view, and the kernel's bits.
// (Dequantization against llama.cpp's own numpy code: tests/reference/check_dequant.py.)
#include "engine/quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/bf16.h"
#include "engine/kernels/cpu.h"
#include "engine/kernels/linear.h"
#include "engine/kernels/weights_arena.h"
#include "tests/test_util.h"

namespace qkv {
namespace {

const GgmlType kQuantTypes[] = {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0,   GgmlType::kQ5_1,
                                GgmlType::kQ8_0, GgmlType::kQ2_K, GgmlType::kQ3_K,   GgmlType::kQ4_K,
                                GgmlType::kQ5_K, GgmlType::kQ6_K, GgmlType::kIQ4_NL, GgmlType::kIQ4_XS};

std::vector<float> Normal(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

std::vector<uint8_t> Encode(GgmlType t, const std::vector<float>& w, int rows, int k) {
  std::vector<uint8_t> q(GgmlRowBytes(t, k) * rows);
  for (int r = 0; r < rows; ++r) QuantizeRow(t, &w[static_cast<size_t>(r) * k], k, &q[GgmlRowBytes(t, k) * r]);
  return q;
}

double RelRmse(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0, s = 0;
  for (size_t i = 0; i < a.size(); ++i) e += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), s += double(b[i]) * b[i];
  return std::sqrt(e / s);
}

// Encoding then decoding loses no more than the type's bits allow.
TEST(Quant, RoundTripErrorPerType) {
  const int k = 512, rows = 16;
  const auto x = Normal(static_cast<size_t>(k) * rows, 1);
  for (GgmlType t : kQuantTypes) {
    const auto q = Encode(t, x, rows, k);
    std::vector<float> back(x.size());
    for (int r = 0; r < rows; ++r) DequantizeRow(t, &q[GgmlRowBytes(t, k) * r], k, &back[static_cast<size_t>(r) * k]);
    const double e = RelRmse(back, x);
    const double bound = t == GgmlType::kQ8_0                                                     ? 0.006
                         : t == GgmlType::kQ6_K                                                   ? 0.025
                         : t == GgmlType::kQ2_K                                                   ? 0.40
                         : t == GgmlType::kQ3_K                                                   ? 0.20
                         : (t == GgmlType::kQ5_0 || t == GgmlType::kQ5_1 || t == GgmlType::kQ5_K) ? 0.05
                                                                                                  : 0.11;
    EXPECT_LT(e, bound) << GgmlTypeName(t);
    EXPECT_GT(e, 0.0) << GgmlTypeName(t);
  }
}

// GgmlValuesFinite reads only the blocks' f16 scales; it must agree with expanding the values. Every 2-byte
// position of a block in turn is set to +inf and then NaN as an f16 (a scale or a run of quantized bits):
// the check says "not finite" exactly when DequantizeRow gives a non-finite value. Also f32/f16/bf16.
TEST(Quant, FiniteCheckAgreesWithDequantize) {
  const int k = 512;
  const auto x = Normal(k, 7);
  auto all_finite = [&](GgmlType t, const std::vector<uint8_t>& q) {
    std::vector<float> y(k);
    DequantizeRow(t, q.data(), k, y.data());
    for (float v : y)
      if (!std::isfinite(v)) return false;
    return true;
  };
  std::vector<GgmlType> types(std::begin(kQuantTypes), std::end(kQuantTypes));
  types.insert(types.end(), {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16});
  for (GgmlType t : types) {
    SCOPED_TRACE(GgmlTypeName(t));
    const auto q = Encode(t, x, 1, k);
    ASSERT_TRUE(all_finite(t, q));
    EXPECT_TRUE(GgmlValuesFinite(t, q.data(), k));
    const uint64_t bb = GgmlBlockBytes(t);
    int non_finite_positions = 0;
    // the positions of the last block (the check must look at every block, not only the first)
    for (uint64_t at = q.size() - std::max<uint64_t>(bb, 4); at + 2 <= q.size(); at += 2) {
      for (uint16_t bad : {uint16_t{0x7c00}, uint16_t{0x7e00}, uint16_t{0x7f80}, uint16_t{0x7fc0}}) {
        std::vector<uint8_t> m = q;
        std::memcpy(&m[at], &bad, 2);
        const bool want = all_finite(t, m);
        EXPECT_EQ(GgmlValuesFinite(t, m.data(), k), want) << "byte " << at << " = " << bad;
        non_finite_positions += !want;
      }
    }
    EXPECT_GT(non_finite_positions, 0);
  }
}

// Our Q4_0 / Q5_0 encoders search scales that include ggml's reference choice (d = max / −8 or −16, values
// rounded half up), so no block is worse than the reference.
TEST(Quant, EncoderNoWorseThanGgmlReferencePerBlock) {
  const auto x = Normal(32 * 400, 2);
  for (GgmlType t : {GgmlType::kQ4_0, GgmlType::kQ5_0}) {
    const float half = t == GgmlType::kQ4_0 ? 8.0f : 16.0f;
    const int qmax = t == GgmlType::kQ4_0 ? 15 : 31;
    for (size_t b = 0; b < 400; ++b) {
      const float* xb = &x[b * 32];
      float mx = 0;
      for (int j = 0; j < 32; ++j)
        if (std::fabs(xb[j]) > std::fabs(mx)) mx = xb[j];
      const float d = mx / -half;
      const float dh = F16ToF32(F32ToF16(d));
      double ref = 0;
      for (int j = 0; j < 32; ++j) {
        const int q = std::min(qmax, static_cast<int>(xb[j] * (1.0f / d) + half + 0.5f));
        const double r = xb[j] - dh * (q - half);
        ref += r * r;
      }
      std::vector<uint8_t> enc(GgmlRowBytes(t, 32));
      QuantizeRow(t, xb, 32, enc.data());
      float back[32];
      DequantizeRow(t, enc.data(), 32, back);
      double ours = 0;
      for (int j = 0; j < 32; ++j) ours += (double(back[j]) - xb[j]) * (double(back[j]) - xb[j]);
      ASSERT_LE(ours, ref * (1 + 1e-6) + 1e-12) << GgmlTypeName(t) << " block " << b;
    }
  }
}

// The integer view (scale × q − offset) is the dequantized value.
TEST(Quant, IntegerViewMatchesDequantize) {
  const int k = 512;
  std::mt19937 g(3);
  for (GgmlType t : kQuantTypes) {
    // Encoded rows, and random bytes with finite scales (every quant bit pattern).
    std::vector<uint8_t> rows = Encode(t, Normal(k, 4), 1, k);
    std::vector<uint8_t> rnd(GgmlRowBytes(t, k));
    for (auto& b : rnd) b = static_cast<uint8_t>(g());
    const size_t bb = GgmlBlockBytes(t);
    std::vector<size_t> f16_at;  // the f16 fields of a block
    switch (t) {
      case GgmlType::kQ2_K: f16_at = {80, 82}; break;
      case GgmlType::kQ3_K: f16_at = {108}; break;
      case GgmlType::kQ6_K: f16_at = {208}; break;
      case GgmlType::kQ4_1:
      case GgmlType::kQ5_1:
      case GgmlType::kQ4_K:
      case GgmlType::kQ5_K: f16_at = {0, 2}; break;
      default: f16_at = {0}; break;
    }
    for (size_t blk = 0; blk < rnd.size() / bb; ++blk)
      for (size_t at : f16_at) {
        const uint16_t h = F32ToF16(std::uniform_real_distribution<float>(-0.1f, 0.1f)(g));
        std::memcpy(&rnd[blk * bb + at], &h, 2);
      }
    for (const auto* src : {&rows, &rnd}) {
      std::vector<float> deq(k), sc(k / 16), off(k / 16);
      std::vector<int8_t> q(k);
      DequantizeRow(t, src->data(), k, deq.data());
      DecodeRowI8(t, src->data(), k, q.data(), sc.data(), off.data());
      for (int i = 0; i < k; ++i) {
        const double v = double(sc[i / 16]) * q[i] - off[i / 16];
        ASSERT_NEAR(v, deq[i], 1e-6 * (std::fabs(deq[i]) + std::fabs(off[i / 16])) + 1e-12)
            << GgmlTypeName(t) << " value " << i;
      }
    }
  }
}

// What the kernel computes for one output, written out lane by lane with scalar operations: int8
// activations per 32-block (scale max|x| / 127, nearest even), lane i of a block covering values 4i..4i+3,
// acc[i] = fma(Σ w·a, w_scale × a_scale, acc[i]) then acc[i] −= w_offset × (a_scale × Σ a), and the lanes
// summed as ((0+4)+(2+6)) + ((1+5)+(3+7)).
float Emulate(GgmlType t, const uint8_t* row, const float* x, int k) {
  std::vector<int8_t> wq(k), aq(k);
  std::vector<float> sc(k / 16), off(k / 16), as(k / 32);
  DecodeRowI8(t, row, k, wq.data(), sc.data(), off.data());
  for (int b = 0; b < k / 32; ++b) {
    float mx = 0;
    for (int j = 0; j < 32; ++j) mx = std::max(mx, std::fabs(x[32 * b + j]));
    as[b] = mx / 127.0f;
    const float id = mx != 0 ? 127.0f / mx : 0.0f;
    for (int j = 0; j < 32; ++j) aq[32 * b + j] = static_cast<int8_t>(std::nearbyint(x[32 * b + j] * id));
  }
  float acc[8] = {};
  for (int b = 0; b < k / 32; ++b) {
    for (int i = 0; i < 8; ++i) {
      int dot = 0, sa = 0;
      for (int j = 0; j < 4; ++j) {
        dot += wq[32 * b + 4 * i + j] * aq[32 * b + 4 * i + j];
        sa += aq[32 * b + 4 * i + j];
      }
      const int g = 2 * b + i / 4;
      acc[i] = std::fma(static_cast<float>(dot), sc[g] * as[b], acc[i]);
      acc[i] = std::fma(-off[g], static_cast<float>(sa) * as[b], acc[i]);
    }
  }
  const float s0 = acc[0] + acc[4], s1 = acc[1] + acc[5], s2 = acc[2] + acc[6], s3 = acc[3] + acc[7];
  return (s0 + s2) + (s1 + s3);
}

// The same for a row kept in a panel (quant_panel.h): one accumulator and, per 32-block in order, the exact
// Σ w·a of the block (Q2_K, Q3_K, Q6_K: of each 16 values, with that 16's scale) added as acc = fma(Σ w·a,
// w_scale × a_scale, acc), each followed for the types with a minimum by acc = fma(−w_offset, float(Σ a) ×
// a_scale, acc).
float EmulatePanel(GgmlType t, const uint8_t* row, const float* x, int k) {
  std::vector<int8_t> wq(k), aq(k);
  std::vector<float> sc(k / 16), off(k / 16);
  DecodeRowI8(t, row, k, wq.data(), sc.data(), off.data());
  const bool per16 = t == GgmlType::kQ6_K || t == GgmlType::kQ2_K || t == GgmlType::kQ3_K;
  const bool has_off = t == GgmlType::kQ4_1 || t == GgmlType::kQ5_1 || t == GgmlType::kQ4_K || t == GgmlType::kQ5_K ||
                       t == GgmlType::kQ2_K;
  float acc = 0;
  for (int b = 0; b < k / 32; ++b) {
    float mx = 0;
    for (int j = 0; j < 32; ++j) mx = std::max(mx, std::fabs(x[32 * b + j]));
    const float as = mx / 127.0f;
    const float id = mx != 0 ? 127.0f / mx : 0.0f;
    int dot[2] = {}, sa[2] = {};
    for (int j = 0; j < 32; ++j) {
      aq[32 * b + j] = static_cast<int8_t>(std::nearbyint(x[32 * b + j] * id));
      dot[j / 16] += wq[32 * b + j] * aq[32 * b + j];
      sa[j / 16] += aq[32 * b + j];
    }
    if (per16) {
      for (int h = 0; h < 2; ++h) {
        acc = std::fma(static_cast<float>(dot[h]), sc[2 * b + h] * as, acc);
        if (has_off) acc = std::fma(-off[2 * b + h], static_cast<float>(sa[h]) * as, acc);
      }
    } else {
      acc = std::fma(static_cast<float>(dot[0] + dot[1]), sc[2 * b] * as, acc);
      if (has_off) acc = std::fma(-off[2 * b], static_cast<float>(sa[0] + sa[1]) * as, acc);
    }
  }
  return acc;
}

std::unique_ptr<Linear> MakeQuantLinear(GemmRuntime& rt, GgmlType t, const std::vector<uint8_t>& q, int n, int k,
                                        const float* bias) {
  auto w = std::make_shared<const QuantWeights>(std::vector<QuantWeights::Part>{{t, n, q.data()}}, k, bias);
  auto lin = Linear::CreateQuantized(rt, w);
  EXPECT_TRUE(lin.ok()) << lin.status().ToString();
  return lin.ok() ? std::move(*lin) : nullptr;
}

// The kernel levels this CPU has (kernels/cpu.h), lowest first; the ones it lacks are printed as skipped.
std::vector<KernelIsa> KernelLevels() {
  std::vector<KernelIsa> v;
  for (KernelIsa i : {KernelIsa::kAvx2, KernelIsa::kAvx512, KernelIsa::kAvx512Vnni}) {
    if (i <= CpuKernelIsa()) {
      v.push_back(i);
    } else {
      std::printf("kernel level %s: skipped (this CPU has up to %s)\n", KernelIsaName(i),
                  KernelIsaName(CpuKernelIsa()));
    }
  }
  return v;
}

// The kernel gives exactly the bits of the lane-by-lane scalar description, for every type, at every
// kernel level this CPU has (AVX2 maddubs; AVX-512 VNNI two columns per zmm), and for tiles of every shape
// (M = 1..9 covers the 1-, 2-, 4- and 8-row tiles and their remainders; N = 37 two panels of 16 for the
// types that have them, then the 4-, 2- and 1-column row-wise tiles).
TEST(QuantLinear, MatchesScalarDescriptionBitForBit) {
  const int k = 512, n = 37;
  GemmRuntime rt(2);
  testing::KernelLevelGuard guard;
  for (KernelIsa level : KernelLevels()) {
    SetKernelIsaForTesting(level);
    std::printf("kernel level %s: checked\n", KernelIsaName(level));
    for (GgmlType t : kQuantTypes) {
      const auto q = Encode(t, Normal(static_cast<size_t>(n) * k, 5, 0.05f), n, k);
      auto lin = MakeQuantLinear(rt, t, q, n, k, nullptr);
      ASSERT_TRUE(lin);
      for (int m = 1; m <= 9; ++m) {
        const auto x = Normal(static_cast<size_t>(m) * k, 10 + m);
        std::vector<float> y(static_cast<size_t>(m) * n);
        lin->Forward(x.data(), m, y.data());
        for (int r = 0; r < m; ++r)
          for (int c = 0; c < n; ++c) {
            const bool panel = lin->quantized()->InPanel(c);
            const float e =
                (panel ? EmulatePanel : Emulate)(t, &q[GgmlRowBytes(t, k) * c], &x[static_cast<size_t>(r) * k], k);
            const float got = y[static_cast<size_t>(r) * n + c];
            ASSERT_EQ(0, std::memcmp(&e, &got, 4))
                << KernelIsaName(level) << " " << GgmlTypeName(t) << " m " << m << " row " << r << " col " << c
                << (panel ? " (panel)" : "") << ": " << got << " vs " << e;
          }
      }
    }
  }
}

// Whole sixteens of rows are panels, the rest row-wise, part by part; every row expands
// to the file's values whatever its storage.
TEST(QuantLinear, PanelsHoldWholeSixteensAndExpandToTheFilesValues) {
  const int k = 256;
  for (GgmlType t : kQuantTypes) {
    const auto a = Encode(t, Normal(static_cast<size_t>(37) * k, 21, 0.05f), 37, k);
    const auto b = Encode(GgmlType::kQ8_0, Normal(static_cast<size_t>(18) * k, 22, 0.05f), 18, k);
    const QuantWeights w({{t, 37, a.data()}, {GgmlType::kQ8_0, 18, b.data()}}, k, nullptr);
    ASSERT_EQ(w.n(), 55);
    for (int r = 0; r < 55; ++r) {
      const bool expect = r < 37 ? r < 32 : r < 37 + 16;
      EXPECT_EQ(w.InPanel(r), expect) << GgmlTypeName(t) << " row " << r;
      const int unit = w.UnitStart(r);
      EXPECT_LE(unit, r);
      if (w.InPanel(r)) {
        EXPECT_EQ(unit, r < 37 ? r / 16 * 16 : 37) << GgmlTypeName(t) << " row " << r;
      }
      std::vector<float> got(k), want(k);
      w.DequantizeRow(r, got.data());
      if (r < 37) {
        DequantizeRow(t, &a[GgmlRowBytes(t, k) * r], k, want.data());
      } else {
        DequantizeRow(GgmlType::kQ8_0, &b[GgmlRowBytes(GgmlType::kQ8_0, k) * (r - 37)], k, want.data());
      }
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), sizeof(float) * k)) << GgmlTypeName(t) << " row " << r;
    }
    EXPECT_EQ(w.UnitStart(55), 55);
  }
}

// A row's outputs have the same bits whatever M, whatever rows share the call, whatever the thread count.
TEST(QuantLinear, RowsAreIndependentOfMAndThreads) {
  const int k = 768, n = 203;  // k: three super-blocks; n: odd, so slices and tiles have remainders
  const auto bias = Normal(n, 6);
  GemmRuntime rt2(2), rt1(1);
  testing::KernelLevelGuard guard;
  for (KernelIsa level : KernelLevels()) {
    SetKernelIsaForTesting(level);
    for (GgmlType t :
         {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_K, GgmlType::kQ6_K, GgmlType::kQ5_1, GgmlType::kIQ4_XS}) {
      const auto q = Encode(t, Normal(static_cast<size_t>(n) * k, 7, 0.05f), n, k);
      auto lin2 = MakeQuantLinear(rt2, t, q, n, k, bias.data());
      auto lin1 = MakeQuantLinear(rt1, t, q, n, k, bias.data());
      const int max_m = 130;
      const auto x = Normal(static_cast<size_t>(max_m) * k, 8);
      std::vector<float> one(static_cast<size_t>(max_m) * n);
      for (int r = 0; r < max_m; ++r)
        lin1->Forward(&x[static_cast<size_t>(r) * k], 1, &one[static_cast<size_t>(r) * n]);
      for (int m : {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 100, 130}) {
        std::vector<float> y(static_cast<size_t>(m) * n);
        lin2->Forward(x.data(), m, y.data());
        ASSERT_EQ(0, std::memcmp(y.data(), one.data(), y.size() * sizeof(float)))
            << KernelIsaName(level) << " " << GgmlTypeName(t) << " M " << m;
      }
    }
  }
}

// Compute's per-thread buffers (the packed activation rows, the output tile) are counted in the process's
// scratch while the thread lives, and no longer once it has exited.
TEST(QuantLinear, ComputeScratchIsCounted) {
  const int k = 512, n = 32, m = 16;
  const auto q = Encode(GgmlType::kQ4_0, Normal(static_cast<size_t>(n) * k, 31, 0.05f), n, k);
  const QuantWeights w({{GgmlType::kQ4_0, n, q.data()}}, k, nullptr);
  QuantizedRows a;
  a.Resize(m, k);
  const auto x = Normal(static_cast<size_t>(m) * k, 32);
  a.Quantize(x.data(), 0, m);
  std::vector<float> y(static_cast<size_t>(m) * n);
  const size_t before = QuantWeights::ScratchBytes();
  const size_t packed =
      static_cast<size_t>(m) * (k / 32) * 48;  // PanelRows: 48 bytes a row and 32-block (Q4_0: no scaled sums)
  size_t during = 0;
  std::thread t([&] {
    w.Compute(a, 0, n, y.data(), n);
    during = QuantWeights::ScratchBytes();
  });
  t.join();
  EXPECT_GE(during, before + packed);
  EXPECT_EQ(QuantWeights::ScratchBytes(), before);
}

// Close to the f32 product with the dequantized weights (the activations' 8 bits are the difference).
TEST(QuantLinear, CloseToF32OnDequantizedWeights) {
  const int k = 512, n = 64, m = 8;
  GemmRuntime rt(2);
  const auto x = Normal(static_cast<size_t>(m) * k, 9);
  for (GgmlType t : kQuantTypes) {
    const auto q = Encode(t, Normal(static_cast<size_t>(n) * k, 11, 0.05f), n, k);
    auto lin = MakeQuantLinear(rt, t, q, n, k, nullptr);
    std::vector<float> y(static_cast<size_t>(m) * n), ref(y.size()), w(k);
    lin->Forward(x.data(), m, y.data());
    for (int c = 0; c < n; ++c) {
      DequantizeRow(t, &q[GgmlRowBytes(t, k) * c], k, w.data());
      for (int r = 0; r < m; ++r) {
        double s = 0;
        for (int i = 0; i < k; ++i) s += double(w[i]) * x[static_cast<size_t>(r) * k + i];
        ref[static_cast<size_t>(r) * n + c] = static_cast<float>(s);
      }
    }
    EXPECT_LT(RelRmse(y, ref), 0.01) << GgmlTypeName(t);
  }
}

// Rows that are not whole blocks of their type (a K-quant row of 896 values) are refused, not misread.
TEST(QuantLinear, RefusesRowsOfPartialBlocks) {
  GemmRuntime rt(1);
  std::vector<uint8_t> bytes(GgmlRowBytes(GgmlType::kQ4_K, 1024) * 2);
  auto w = std::make_shared<const QuantWeights>(std::vector<QuantWeights::Part>{{GgmlType::kQ4_K, 2, bytes.data()}},
                                                896, nullptr);
  EXPECT_FALSE(Linear::CreateQuantized(rt, w).ok());
  auto ok = std::make_shared<const QuantWeights>(std::vector<QuantWeights::Part>{{GgmlType::kQ4_K, 2, bytes.data()}},
                                                 1024, nullptr);
  EXPECT_TRUE(Linear::CreateQuantized(rt, ok).ok());
}

// The weights arena (kernels/weights_arena.h): 64-byte aligned buffers in 2 MiB-aligned regions advised for
// huge pages (VmFlags "hg", the advice itself, whatever THP is set to), big buffers in mappings of their own,
// exact used/held accounting, regions unmapped with their last buffer.
TEST(WeightsArena, AdvisedAlignedAccountedAndUnmapped) {
  for (bool huge : {true, false}) {
    auto arena = std::make_shared<WeightsArena>(huge);
    const uint8_t* first = nullptr;
    {
      WeightsBuffer a(arena, 1000), b(arena, 3000), big(arena, 20u << 20);
      first = a.data();
      for (const WeightsBuffer* w : {&a, &b, &big}) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(w->data()) % 64, 0u);
        EXPECT_TRUE(arena->Contains(w->data()));
        const std::string flags = testing::VmFlagsOf(w->data());
        EXPECT_NE(flags, "");
        // A kernel without THP refuses the advice (madvise fails): nothing to see then.
        if (ThpMode() != "unavailable") {
          EXPECT_EQ(flags.find(" hg") != std::string::npos, huge) << flags;
        }
      }
      EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % WeightsArena::kHugePage, 0u);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % WeightsArena::kHugePage, 0u);
      EXPECT_EQ(b.data(), a.data() + 1024);  // bumped past a, rounded to 64
      EXPECT_EQ(arena->used_bytes(), 1024u + 3008u + (20u << 20));
      EXPECT_EQ(arena->held_bytes(), WeightsArena::kHugePage + (20u << 20));
      EXPECT_EQ(arena->slack_bytes(), WeightsArena::kHugePage - 1024u - 3008u);
      // Buffers move without being freed twice.
      WeightsBuffer moved = std::move(b);
      EXPECT_EQ(b.data(), nullptr);
      EXPECT_EQ(arena->used_bytes(), 1024u + 3008u + (20u << 20));
    }
    EXPECT_EQ(arena->used_bytes(), 0u);
    EXPECT_EQ(arena->held_bytes(), 0u);
    EXPECT_EQ(arena->slack_bytes(), 0u);
    EXPECT_FALSE(arena->Contains(first));
  }
}

// Weights in the arena compute the bits of weights on the heap.
TEST(WeightsArena, QuantizedWeightsComputeTheSameBits) {
  const int k = 256, n = 40;
  auto arena = std::make_shared<WeightsArena>(true);
  for (GgmlType t : kQuantTypes) {
    const auto q = Encode(t, Normal(static_cast<size_t>(n) * k, 31, 0.05f), n, k);
    const QuantWeights heap({{t, n, q.data()}}, k, nullptr);
    const QuantWeights in({{t, n, q.data()}}, k, nullptr, arena);
    EXPECT_EQ(heap.arena(), nullptr);
    EXPECT_EQ(in.arena(), arena.get());
    EXPECT_GE(arena->used_bytes(), in.bytes());
    QuantizedRows x;
    x.Resize(3, k);
    const auto xf = Normal(static_cast<size_t>(3) * k, 32);
    x.Quantize(xf.data(), 0, 3);
    std::vector<float> y1(3 * n), y2(3 * n);
    heap.Compute(x, 0, n, y1.data(), n);
    in.Compute(x, 0, n, y2.data(), n);
    EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float))) << GgmlTypeName(t);
  }
  EXPECT_EQ(arena->used_bytes(), 0u);
}

TEST(Quant, TypeNamesAndFallbacks) {
  for (GgmlType t : kQuantTypes) EXPECT_EQ(GgmlTypeFromName(GgmlTypeName(t)), t);
  EXPECT_EQ(GgmlTypeFromName("Q4_K"), GgmlType::kQ4_K);
  EXPECT_FALSE(GgmlTypeFromName("q4_k_m").has_value());
  EXPECT_EQ(GgmlFallbackType(GgmlType::kQ4_K, 896), GgmlType::kQ5_0);
  EXPECT_EQ(GgmlFallbackType(GgmlType::kQ6_K, 896), GgmlType::kQ8_0);
  EXPECT_EQ(GgmlFallbackType(GgmlType::kQ5_K, 96), GgmlType::kQ5_1);
  EXPECT_EQ(GgmlFallbackType(GgmlType::kIQ4_XS, 160), GgmlType::kIQ4_NL);
  EXPECT_EQ(GgmlFallbackType(GgmlType::kQ2_K, 64), GgmlType::kQ4_0);
  EXPECT_EQ(GgmlFallbackType(GgmlType::kQ4_K, 100), GgmlType::kF16);
  EXPECT_EQ(GgmlFallbackType(GgmlType::kQ4_K, 1024), GgmlType::kQ4_K);
}

}  // namespace
}  // namespace qkv
