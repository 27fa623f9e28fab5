// Row independence of the oneDNN linear layers: every row of a call with M rows must have exactly the
// bits of the same row computed alone (M = 1), for each GEMM shape of a model and each dtype.
#include "engine/kernels/linear.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "engine/bf16.h"
#include "engine/cgroup.h"
#include "engine/kernels/amx_gemm.h"
#include "engine/kernels/cpu.h"
#include "engine/kernels/weights_arena.h"
#include "tests/test_util.h"

namespace qkv {
namespace {

struct Shape {
  int n, k;
};

void CheckRows(DType dt, Shape s, int threads, const std::vector<int>& ms) {
  GemmRuntime rt(threads);
  std::mt19937 rng(s.n * 31 + s.k);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> w(static_cast<size_t>(s.n) * s.k), b(s.n);
  for (auto& x : w) x = u(rng);
  for (auto& x : b) x = u(rng);
  auto lin = Linear::Create(rt, w.data(), b.data(), s.n, s.k, dt);
  ASSERT_TRUE(lin.ok()) << lin.status().ToString();
  int max_m = 0;
  for (int m : ms) max_m = std::max(max_m, m);
  const int cap = PaddedRows(max_m);
  std::vector<float> xf(static_cast<size_t>(cap) * s.k);
  for (auto& x : xf) x = u(rng);
  std::vector<uint16_t> xb(xf.size());
  F32ToBf16Bulk(xf.data(), xb.data(), static_cast<int64_t>(xf.size()));
  const DType in = (*lin)->input_dtype();
  const void* x = in == DType::kF32 ? static_cast<const void*>(xf.data()) : static_cast<const void*>(xb.data());
  const size_t esz = DTypeBytes(in);

  // Reference: each row alone.
  std::vector<float> alone(static_cast<size_t>(max_m) * s.n), y1(s.n);
  for (int r = 0; r < max_m; ++r) {
    (*lin)->Forward(static_cast<const uint8_t*>(x) + esz * r * s.k, 1, y1.data());
    std::memcpy(&alone[static_cast<size_t>(r) * s.n], y1.data(), sizeof(float) * s.n);
  }
  std::vector<float> y(static_cast<size_t>(max_m) * s.n);
  for (int m : ms) {
    (*lin)->Forward(x, m, y.data());
    for (int r = 0; r < m; ++r) {
      ASSERT_EQ(
          0, std::memcmp(&y[static_cast<size_t>(r) * s.n], &alone[static_cast<size_t>(r) * s.n], sizeof(float) * s.n))
          << DTypeName(dt) << " n=" << s.n << " k=" << s.k << " M=" << m << " row " << r << " differs from M=1";
    }
  }
}

std::vector<int> AllM() {
  std::vector<int> ms;
  for (int m = 1; m <= 64; ++m) ms.push_back(m);
  for (int m : {65, 100, 127, 128, 129, 200, 300}) ms.push_back(m);
  return ms;
}

// The GEMM shapes of the 0.4B benchmark model (hidden 896, 14 heads, 2 KV heads, FFN 4864) with the
// vocabulary cut to 4096 to keep the test short: fused QKV, O, fused gate/up, down, LM head.
const Shape kShapes[] = {{1152, 896}, {896, 896}, {9728, 896}, {896, 4864}, {4096, 896}};

TEST(Linear, RowsAreIndependentOfMF32) {
  for (Shape s : kShapes) CheckRows(DType::kF32, s, 2, AllM());
}

TEST(Linear, RowsAreIndependentOfMBf16) {
  for (Shape s : kShapes) CheckRows(DType::kBF16, s, 2, AllM());
}

TEST(Linear, OddShapesAndOneThread) {
  for (Shape s : {Shape{7, 5}, Shape{33, 17}, Shape{100, 64}}) {
    CheckRows(DType::kF32, s, 1, AllM());
    CheckRows(DType::kBF16, s, 2, AllM());
  }
}

// The engine's own GEMM, forced, so that it is checked on CPUs where oneDNN serves the model too.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }

 private:
  const char* name_;
};

TEST(Linear, PackedRowsAreIndependentOfM) {
  ScopedEnv env("QKV_GEMM", "packed");
  for (Shape s : kShapes) CheckRows(DType::kBF16, s, 2, AllM());
  for (Shape s : {Shape{7, 5}, Shape{33, 17}, Shape{100, 64}}) {
    CheckRows(DType::kF32, s, 1, AllM());
    CheckRows(DType::kBF16, s, 3, AllM());
  }
}

// QKV_KV_PREFETCH picks where decode attention's K/V asks go (kernels/cpu.h); any other value refuses the
// model's first Linear with a message naming the variable, as QKV_MAX_ISA does.
TEST(Linear, KvPrefetchEnvIsValidated) {
  {
    ScopedEnv env("QKV_KV_PREFETCH", "l2");
    auto v = KvPrefetchL2FromEnv();
    ASSERT_TRUE(v.ok());
    EXPECT_TRUE(*v);
  }
  {
    ScopedEnv env("QKV_KV_PREFETCH", "l1");
    auto v = KvPrefetchL2FromEnv();
    ASSERT_TRUE(v.ok());
    EXPECT_FALSE(*v);
  }
  EXPECT_TRUE(KvPrefetchL2FromEnv().ok());  // unset: the CPU's choice
  ScopedEnv env("QKV_KV_PREFETCH", "L3");
  EXPECT_EQ(KvPrefetchL2FromEnv().status().code(), StatusCode::kInvalidArgument);
  GemmRuntime rt(1);
  std::vector<float> w(16 * 16, 0.5f);
  auto lin = Linear::Create(rt, w.data(), nullptr, 16, 16, DType::kF32);
  ASSERT_FALSE(lin.ok());
  EXPECT_NE(lin.status().message().find("QKV_KV_PREFETCH must be l1 or l2, got 'L3'"), std::string::npos)
      << lin.status().message();
}

// The compute team's default size (kernels/cpu.h): the affinity mask's CPUs capped by the cgroup's CPU quota,
// read from a cgroup tree laid out in a temporary directory as v2 and v1 mount it.
class CgroupTree {
 public:
  CgroupTree() {
    char tmpl[] = "/tmp/qkv-cgroup.XXXXXX";
    root_ = mkdtemp(tmpl);
  }
  ~CgroupTree() { std::filesystem::remove_all(root_); }
  void Write(const std::string& rel, const std::string& text) {
    const std::filesystem::path p = std::filesystem::path(root_) / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text << "\n";
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

TEST(Cpu, CgroupV2QuotaIsTheTightestOnTheWayUp) {
  CgroupTree t;
  EXPECT_EQ(CgroupCpuQuota("0::/a/b\n", t.root()), 0.0);  // no cpu.max anywhere: no quota
  t.Write("cpu.max", "max 100000");
  t.Write("a/cpu.max", "200000 100000");
  t.Write("a/b/cpu.max", "max 100000");
  EXPECT_DOUBLE_EQ(CgroupCpuQuota("0::/a/b\n", t.root()), 2.0);  // the parent's limit holds for the child
  t.Write("a/b/cpu.max", "50000 100000");
  EXPECT_DOUBLE_EQ(CgroupCpuQuota("0::/a/b\n", t.root()), 0.5);
  // A path the cgroup namespace hides, or one that climbs out of the mount: the walk starts at the root.
  t.Write("cpu.max", "300000 100000");
  EXPECT_DOUBLE_EQ(CgroupCpuQuota("0::/not/here\n", t.root()), 3.0);
  EXPECT_DOUBLE_EQ(CgroupCpuQuota("0::/../../a/b\n", t.root()), 3.0);
  EXPECT_DOUBLE_EQ(CgroupCpuQuota("0::/\n", t.root()), 3.0);
  t.Write("cpu.max", "garbage");
  EXPECT_EQ(CgroupCpuQuota("0::/\n", t.root()), 0.0);
}

TEST(Cpu, CgroupV1QuotaOfTheCpuController) {
  CgroupTree t;
  t.Write("cpu,cpuacct/cpu.cfs_quota_us", "-1");
  t.Write("cpu,cpuacct/cpu.cfs_period_us", "100000");
  t.Write("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000");
  t.Write("cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000");
  const std::string hybrid = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n";
  EXPECT_DOUBLE_EQ(CgroupCpuQuota(hybrid, t.root()), 1.5);
  EXPECT_EQ(CgroupCpuQuota("3:cpu,cpuacct:/\n", t.root()), 0.0);       // -1: no quota
  EXPECT_EQ(CgroupCpuQuota("4:memory:/docker/abc\n", t.root()), 0.0);  // no cpu controller listed
  EXPECT_EQ(CgroupCpuQuota("", t.root()), 0.0);
}

TEST(Cpu, CgroupMemoryHeadroomIsTheLeastOnTheWayUp) {
  CgroupTree t;
  EXPECT_EQ(CgroupMemoryHeadroom("0::/a/b\n", t.root()), std::numeric_limits<int64_t>::max());  // no limit
  t.Write("memory.max", "max");                                                                 // v2
  t.Write("a/memory.max", "1000");
  t.Write("a/memory.current", "300");
  t.Write("a/b/memory.max", "max");
  t.Write("a/b/memory.current", "100");
  EXPECT_EQ(CgroupMemoryHeadroom("0::/a/b\n", t.root()), 700);  // a systemd slice's limit over the unit
  t.Write("a/b/memory.max", "500");
  EXPECT_EQ(CgroupMemoryHeadroom("0::/a/b\n", t.root()), 400);
  t.Write("a/b/memory.current", "900");
  EXPECT_EQ(CgroupMemoryHeadroom("0::/a/b\n", t.root()), 0);  // over its limit: nothing left, not negative
  EXPECT_EQ(CgroupMemoryHeadroom("0::/\n", t.root()), std::numeric_limits<int64_t>::max());
  t.Write("memory/memory.limit_in_bytes", "9223372036854771712");  // v1: "no limit"
  t.Write("memory/sys/memory.limit_in_bytes", "1000");
  t.Write("memory/sys/memory.usage_in_bytes", "900");
  EXPECT_EQ(CgroupMemoryHeadroom("4:memory:/sys\n0::/\n", t.root()), 100);
  // No memory line: the mount alone (a container's own cgroup), which has no limit here.
  EXPECT_EQ(CgroupMemoryHeadroom("0::/\n", t.root()), std::numeric_limits<int64_t>::max());
  const auto dirs = CgroupDirs("4:memory:/sys\n", t.root(), "memory");
  ASSERT_EQ(dirs.size(), 2u);
  EXPECT_EQ(dirs[0].filename(), "sys");
  EXPECT_EQ(dirs[1].filename(), "memory");
  EXPECT_TRUE(CgroupDirs("4:memory:/sys\n", t.root(), "blkio").empty());  // no such mount
}

TEST(Cpu, ThreadsAreTheAffinityMaskCappedByTheQuota) {
  EXPECT_EQ(ThreadsFor(2, 0), 2);
  EXPECT_EQ(ThreadsFor(2, 1.0), 1);
  EXPECT_EQ(ThreadsFor(2, 1.2), 1);
  EXPECT_EQ(ThreadsFor(2, 1.5), 2);
  EXPECT_EQ(ThreadsFor(8, 2.5), 3);
  EXPECT_EQ(ThreadsFor(1, 3.0), 1);
  EXPECT_EQ(ThreadsFor(2, 0.3), 1);
  EXPECT_EQ(ThreadsFor(0, 0), 1);
  const CpuBudget b = AvailableCpus();
  EXPECT_GE(b.affinity_cpus, 1);
  EXPECT_LE(b.affinity_cpus, b.online_cpus);
  EXPECT_EQ(b.threads, ThreadsFor(b.affinity_cpus, b.quota_cpus));
  EXPECT_EQ(ComputeThreads(3), 3);  // asked for: kept (with a warning where it is more than the CPUs)
  EXPECT_EQ(ComputeThreads(0), b.threads);
}

TEST(Linear, PackedBackendIsUsedWhenForced) {
  ScopedEnv env("QKV_GEMM", "packed");
  GemmRuntime rt(2);
  std::vector<float> w(40 * 24, 0.5f);
  auto lin = Linear::Create(rt, w.data(), nullptr, 40, 24, DType::kBF16);
  ASSERT_TRUE(lin.ok());
  EXPECT_EQ((*lin)->backend(), GemmBackend::kPacked);
  EXPECT_EQ((*lin)->input_dtype(), DType::kF32);
  const std::string form = ActiveKernelIsa() >= KernelIsa::kAvx512Bf16
                               ? std::string("packed avx512_bf16 bf16 x bf16")
                               : std::string("packed ") + KernelIsaName(PackedWeights::Level()) + " f32 x bf16";
  EXPECT_EQ(rt.Summary(), form);
}

// The packed GEMM gives the same bits at every kernel level this CPU has (AVX2: two ymm per panel; AVX-512:
// one zmm per panel, tiles up to 12 rows x 8 panels), for decode and prefill tile shapes, partial panels,
// bias or not. Levels the CPU lacks are printed as skipped.
TEST(Linear, PackedGivesTheSameBitsAtEveryKernelLevel) {
  ScopedEnv env("QKV_GEMM", "packed");
  testing::KernelLevelGuard guard;
  if (CpuKernelIsa() < KernelIsa::kAvx512) {
    std::printf("kernel level avx512: skipped (this CPU has up to %s)\n", KernelIsaName(CpuKernelIsa()));
    GTEST_SKIP() << "one kernel level only";
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (Shape s : {Shape{7, 5}, Shape{33, 17}, Shape{100, 64}, Shape{200, 96}, Shape{272, 40}}) {
      std::vector<float> w(static_cast<size_t>(s.n) * s.k), b(s.n);
      for (auto& v : w) v = u(rng);
      for (auto& v : b) v = u(rng);
      const int max_m = 130;
      std::vector<float> x(static_cast<size_t>(PaddedRows(max_m)) * s.k);
      for (auto& v : x) v = u(rng);
      for (bool with_bias : {false, true}) {
        GemmRuntime rt(2);
        SetKernelIsaForTesting(KernelIsa::kAvx512Vnni);  // the f32 form (above it, bf16 weights take the bf16 form)
        auto lin = Linear::Create(rt, w.data(), with_bias ? b.data() : nullptr, s.n, s.k, dt);
        ASSERT_TRUE(lin.ok()) << lin.status().ToString();
        ASSERT_EQ(rt.Summary().find("bf16 x bf16"), std::string::npos) << rt.Summary();
        for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 17, 24, 25, 37, 100, 130}) {
          std::vector<float> y2(static_cast<size_t>(m) * s.n), y5(y2.size());
          SetKernelIsaForTesting(KernelIsa::kAvx2);
          (*lin)->Forward(x.data(), m, y2.data());
          SetKernelIsaForTesting(KernelIsa::kAvx512);
          (*lin)->Forward(x.data(), m, y5.data());
          ASSERT_EQ(0, std::memcmp(y2.data(), y5.data(), y2.size() * sizeof(float)))
              << DTypeName(dt) << " " << s.n << "x" << s.k << " m " << m << " bias " << with_bias;
        }
      }
    }
  }
  std::printf("kernel levels avx2 and avx512: same bits\n");
}

// The AMX GEMM (kernels/amx_gemm.h), forced: same bits for every M, team size and tile block, and the product
// of the bf16-rounded inputs up to f32 accumulation. Skipped where the CPU (or QKV_MAX_ISA) has no AMX.
TEST(Linear, AmxRowsAreIndependentOfMAndMatchTheBf16Product) {
  if (ActiveKernelIsa() < KernelIsa::kAmx) {
    std::printf("AMX GEMM: skipped (kernel level %s)\n", KernelIsaName(ActiveKernelIsa()));
    GTEST_SKIP() << "no AMX";
  }
  ScopedEnv env("QKV_GEMM", "amx");
  {
    GemmRuntime rt(2);
    std::vector<float> w(40 * 24, 0.5f);
    auto lin = Linear::Create(rt, w.data(), nullptr, 40, 24, DType::kBF16);
    ASSERT_TRUE(lin.ok()) << lin.status().ToString();
    EXPECT_EQ((*lin)->backend(), GemmBackend::kAmx);
    EXPECT_EQ((*lin)->input_dtype(), DType::kF32);
    EXPECT_TRUE(rt.any_bf16_compute());
    EXPECT_FALSE(rt.any_bf16_input());
  }
  for (Shape s : kShapes) CheckRows(DType::kBF16, s, 2, AllM());
  for (Shape s : {Shape{7, 5}, Shape{33, 17}, Shape{100, 64}, Shape{49, 70}}) {
    CheckRows(DType::kF32, s, 1, AllM());
    CheckRows(DType::kBF16, s, 3, AllM());
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  for (Shape s : {Shape{7, 5}, Shape{100, 64}, Shape{49, 70}, Shape{300, 896}}) {
    for (int m : {1, 5, 16, 17, 40}) {
      std::vector<float> w(static_cast<size_t>(s.n) * s.k), b(s.n), x(static_cast<size_t>(m) * s.k);
      for (auto* v : {&w, &b, &x})
        for (float& e : *v) e = u(rng);
      GemmRuntime rt(2);
      auto lin = Linear::Create(rt, w.data(), b.data(), s.n, s.k, DType::kBF16);
      ASSERT_TRUE(lin.ok()) << lin.status().ToString();
      std::vector<float> y(static_cast<size_t>(m) * s.n);
      (*lin)->Forward(x.data(), m, y.data());
      for (int r = 0; r < m; ++r) {
        for (int c = 0; c < s.n; ++c) {
          double ref = 0, mag = 0;
          for (int i = 0; i < s.k; ++i) {
            const double p = static_cast<double>(Bf16ToF32(F32ToBf16(x[r * s.k + i]))) *
                             Bf16ToF32(F32ToBf16(w[static_cast<size_t>(c) * s.k + i]));
            ref += p;
            mag += std::fabs(p);
          }
          ASSERT_NEAR(y[static_cast<size_t>(r) * s.n + c], ref + b[c], 1e-6 * mag + 1e-6)
              << s.n << "x" << s.k << " m " << m << " (" << r << "," << c << ")";
        }
      }
    }
  }
}

void CheckNaiveProduct(DType dt);

// The packed GEMM's bf16 form (kernel level avx512_bf16: vdpbf16ps over k-pairs, activations rounded to
// bf16) is what bf16 weights run on at that level: every row has the bits of the same row alone at every M
// and team size, partial panels and odd K included, and equals the product of the bf16-rounded inputs up to
// f32 accumulation. Skipped where the CPU has no AVX512_BF16.
TEST(Linear, Bf16DotFormRowsAreIndependentOfMAndMatchTheBf16Product) {
  testing::KernelLevelGuard guard;
  if (CpuKernelIsa() < KernelIsa::kAvx512Bf16) {
    std::printf("kernel level avx512_bf16: skipped (this CPU has up to %s)\n", KernelIsaName(CpuKernelIsa()));
    GTEST_SKIP() << "no AVX512_BF16";
  }
  SetKernelIsaForTesting(KernelIsa::kAvx512Bf16);
  {
    GemmRuntime rt(2);
    std::vector<float> w(40 * 24, 0.5f);
    auto lin = Linear::Create(rt, w.data(), nullptr, 40, 24, DType::kBF16);
    ASSERT_TRUE(lin.ok()) << lin.status().ToString();
    EXPECT_EQ((*lin)->backend(), GemmBackend::kPacked);
    EXPECT_EQ(rt.Summary(), "packed avx512_bf16 bf16 x bf16");
    EXPECT_TRUE(rt.any_bf16_compute());
  }
  for (Shape s : kShapes) CheckRows(DType::kBF16, s, 2, AllM());
  for (Shape s : {Shape{7, 5}, Shape{33, 17}, Shape{100, 64}, Shape{272, 41}}) {
    CheckRows(DType::kBF16, s, 1, AllM());
    CheckRows(DType::kBF16, s, 3, AllM());
  }
  CheckNaiveProduct(DType::kBF16);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  for (Shape s : {Shape{33, 17}, Shape{272, 41}, Shape{96, 896}}) {
    std::vector<float> w(static_cast<size_t>(s.n) * s.k), b(s.n);
    for (auto& v : w) v = u(rng);
    for (auto& v : b) v = u(rng);
    const int m = 19;
    std::vector<float> x(static_cast<size_t>(PaddedRows(m)) * s.k), y(static_cast<size_t>(PaddedRows(m)) * s.n);
    for (auto& v : x) v = u(rng);
    GemmRuntime rt(2);
    auto lin = Linear::Create(rt, w.data(), b.data(), s.n, s.k, DType::kBF16);
    ASSERT_TRUE(lin.ok()) << lin.status().ToString();
    (*lin)->Forward(x.data(), m, y.data());
    for (int r = 0; r < m; ++r) {
      for (int c = 0; c < s.n; ++c) {
        double ref = 0, mag = 0;
        for (int i = 0; i < s.k; ++i) {
          const double p = static_cast<double>(Bf16ToF32(F32ToBf16(x[static_cast<size_t>(r) * s.k + i]))) *
                           Bf16ToF32(F32ToBf16(w[static_cast<size_t>(c) * s.k + i]));
          ref += p;
          mag += std::fabs(p);
        }
        ASSERT_NEAR(y[static_cast<size_t>(r) * s.n + c], ref + b[c], 1e-6 * mag + 1e-6)
            << s.n << "x" << s.k << " (" << r << "," << c << ")";
      }
    }
  }
  std::printf("kernel level avx512_bf16: bf16 form checked\n");
}

// The AMX GEMM's weight layout (amx_gemm.h) and where it lives, on any CPU (packing needs no AMX): each
// value at its place, zeros in the padding (K to whole chunks, columns to whole panels), the bytes in the
// arena it was given.
TEST(Linear, AmxWeightsLayoutInTheArena) {
  const int n = 40, k = 70;  // 3 panels (the last half empty), 3 chunks (the last 6 of 32)
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> w(static_cast<size_t>(n) * k), b(n);
  for (auto* v : {&w, &b})
    for (auto& x : *v) x = u(rng);
  auto arena = std::make_shared<WeightsArena>(false);
  const AmxWeights amx(w.data(), b.data(), n, k, arena);
  EXPECT_EQ(amx.arena(), arena.get());
  const size_t packed = size_t{3} * 3 * AmxWeights::kTileRows * AmxWeights::kChunk * sizeof(uint16_t);
  EXPECT_EQ(arena->used_bytes(), packed);
  EXPECT_EQ(amx.bytes(), packed + sizeof(float) * 48);
  int wrong = 0;
  for (int c = 0; c < 48; ++c)
    for (int kk = 0; kk < 96; ++kk) {
      const uint16_t want = c < n && kk < k ? F32ToBf16(w[static_cast<size_t>(c) * k + kk]) : 0;
      wrong += amx.Weight(c, kk) != want;
    }
  EXPECT_EQ(wrong, 0);
  const AmxWeights heap(w.data(), nullptr, n, k);
  EXPECT_EQ(heap.arena(), nullptr);
  EXPECT_EQ(heap.bytes(), packed);
  EXPECT_EQ(heap.Weight(n - 1, k - 1), amx.Weight(n - 1, k - 1));
}

// Below kernel level amx the AMX GEMM is not chosen, and forcing it is refused with a message naming the level.
TEST(Linear, AmxOnlyAtKernelLevelAmx) {
  testing::KernelLevelGuard guard;
  SetKernelIsaForTesting(KernelIsa::kAvx512Vnni);
  GemmRuntime rt(2);
  std::vector<float> w(40 * 24, 0.5f);
  auto lin = Linear::Create(rt, w.data(), nullptr, 40, 24, DType::kBF16);
  ASSERT_TRUE(lin.ok()) << lin.status().ToString();
  EXPECT_NE((*lin)->backend(), GemmBackend::kAmx);
  ScopedEnv env("QKV_GEMM", "amx");
  auto forced = Linear::Create(rt, w.data(), nullptr, 40, 24, DType::kBF16);
  ASSERT_FALSE(forced.ok());
  EXPECT_NE(forced.status().message().find("QKV_GEMM=amx needs kernel level amx"), std::string::npos)
      << forced.status().ToString();
}

void CheckNaiveProduct(DType dt) {
  GemmRuntime rt(2);
  const int n = 40, k = 24, m = 5;
  std::vector<float> w(n * k), b(n), x(PaddedRows(m) * k), y(PaddedRows(m) * n);
  for (int i = 0; i < n * k; ++i) w[i] = static_cast<float>((i * 7) % 11) - 5;
  for (int i = 0; i < n; ++i) b[i] = 0.5f * i;
  for (int i = 0; i < m * k; ++i) x[i] = static_cast<float>((i * 3) % 5) - 2;
  auto lin = Linear::Create(rt, w.data(), b.data(), n, k, dt);
  ASSERT_TRUE(lin.ok());
  std::vector<uint16_t> xb(x.size());
  F32ToBf16Bulk(x.data(), xb.data(), static_cast<int64_t>(x.size()));
  const bool bf16_in = (*lin)->input_dtype() == DType::kBF16;
  (*lin)->Forward(bf16_in ? static_cast<const void*>(xb.data()) : static_cast<const void*>(x.data()), m, y.data());
  for (int r = 0; r < m; ++r) {
    for (int c = 0; c < n; ++c) {
      double ref = b[c];
      for (int i = 0; i < k; ++i) ref += static_cast<double>(x[r * k + i]) * w[c * k + i];
      EXPECT_EQ(y[r * n + c], static_cast<float>(ref)) << r << "," << c;  // small integers: exact
    }
  }
}

TEST(Linear, MatchesNaiveProduct) {
  CheckNaiveProduct(DType::kF32);
  CheckNaiveProduct(DType::kBF16);  // small integers are exact in bf16 too
  ScopedEnv env("QKV_GEMM", "packed");
  CheckNaiveProduct(DType::kF32);
  CheckNaiveProduct(DType::kBF16);
}

}  // namespace
}  // namespace qkv

namespace qkv {
namespace {

TEST(Bf16, BulkConversionMatchesScalarIncludingTiesAndSpecials) {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          1.00390625f /* tie, rounds to even */,
                          1.01171875f /* tie, rounds up */,
                          3.14159f,
                          -2.5e-39f,
                          1e38f,
                          3.4e38f,
                          INFINITY,
                          -INFINITY,
                          NAN};
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1e4f, 1e4f);
  for (int i = 0; i < 1000; ++i) v.push_back(u(rng));
  std::vector<uint16_t> bulk(v.size());
  F32ToBf16Bulk(v.data(), bulk.data(), static_cast<int64_t>(v.size()));
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(bulk[i], F32ToBf16(v[i])) << v[i];
  EXPECT_EQ(F32ToBf16(1.00390625f), 0x3f80);
  EXPECT_EQ(F32ToBf16(1.01171875f), 0x3f82);
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(NAN))));
}

}  // namespace
}  // namespace qkv
