#include "engine/kernels/linear.h"

#include <omp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "engine/bf16.h"
#include "engine/kernels/cpu.h"

namespace qkv {
namespace {

using dnnl::memory;
using tag = dnnl::memory::format_tag;

constexpr int kBuckets[] = {1, 2, 4, 8, 16, 32, 64, kTileRows};
constexpr int kNumBuckets = sizeof(kBuckets) / sizeof(kBuckets[0]);

int BucketIndex(int m) {
  for (int i = 0; i < kNumBuckets; ++i) {
    if (m <= kBuckets[i]) return i;
  }
  return kNumBuckets - 1;
}

memory::data_type Dt(DType d) { return d == DType::kF32 ? memory::data_type::f32 : memory::data_type::bf16; }

// Runs f with oneDNN seeing a single thread, so primitives are planned for one thread each.
template <typename F>
auto SingleThreaded(F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  auto r = f();
  omp_set_num_threads(saved);
  return r;
}

}  // namespace

// Smallest buckets a layer may be restricted to (see Linear::Create); PaddedRows covers the largest.
constexpr int kMinBuckets[] = {1, 16, 32};
// Largest buckets (the tile M runs in) a layer may be restricted to. A smaller tile never reads past
// PaddedRows(m): rows past the last whole tile are at most what a 128-row tile would read.
constexpr int kMaxBuckets[] = {kTileRows, 64, 32};

int PaddedRows(int m) {
  const int full = m / kTileRows * kTileRows;
  const int rem = m - full;
  return rem == 0 ? full : full + std::max(kBuckets[BucketIndex(rem)], 32);
}

const char* GemmBackendName(GemmBackend b) {
  switch (b) {
    case GemmBackend::kOneDnn: return "onednn";
    case GemmBackend::kPacked: return "packed";
    case GemmBackend::kQuant: return "quantized";
    case GemmBackend::kAmx: return "amx";
  }
  return "?";
}

StatusOr<std::optional<GemmBackend>> GemmBackendFromEnv() {
  const char* v = std::getenv("QKV_GEMM");
  if (!v || !*v || std::string(v) == "auto") return std::optional<GemmBackend>();
  if (std::string(v) == "packed") return std::optional<GemmBackend>(GemmBackend::kPacked);
  if (std::string(v) == "onednn") return std::optional<GemmBackend>(GemmBackend::kOneDnn);
  if (std::string(v) == "amx") return std::optional<GemmBackend>(GemmBackend::kAmx);
  return InvalidArgument(std::string("QKV_GEMM must be auto, packed, onednn or amx, got '") + v + "'");
}

std::string GemmRuntime::CpuIsa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: return "other";
  }
}

std::string GemmRuntime::Summary() const {
  std::string s;
  for (const auto& l : layers_) s += (s.empty() ? "" : " + ") + l;
  return s;
}

GemmRuntime::GemmRuntime(int n_threads) : n_threads_(std::max(1, n_threads)), engine_(dnnl::engine::kind::cpu, 0) {
  for (int t = 0; t < n_threads_; ++t) streams_.emplace_back(engine_);
  scratch_.resize(n_threads_);
  out_.resize(n_threads_);
  thread_qrows_.resize(n_threads_);
  own_bf16_.resize(n_threads_);
}

GemmRuntime::~GemmRuntime() = default;

StatusOr<dnnl::matmul::primitive_desc> GemmRuntime::MakePd(int rows, int n, int k, int ld_out, DType dt, bool bias,
                                                           const memory::desc& wei) {
  try {
    memory::desc src({rows, k}, Dt(dt), memory::dims{k, 1});
    // A dense destination: with a row stride other than n, oneDNN 2.6 falls back from brgemm to gemm:jit.
    memory::desc dst({rows, n}, memory::data_type::f32, memory::dims{n, 1});
    memory::desc b = bias ? memory::desc({1, n}, memory::data_type::f32, tag::ab) : memory::desc();
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    return SingleThreaded([&] {
      return bias ? dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, b, dst), attr, engine_)
                  : dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), attr, engine_);
    });
  } catch (const dnnl::error& e) {
    return Internal(std::string("oneDNN matmul ") + std::to_string(rows) + "x" + std::to_string(k) + "x" +
                    std::to_string(n) + ": " + e.what());
  }
}

StatusOr<memory::desc> GemmRuntime::PreferredWeights(int n, int k, int ld_out, DType dt, bool bias) {
  memory::desc any({k, n}, Dt(dt), tag::any);
  QKV_ASSIGN_OR_RETURN(auto pd, MakePd(kTileRows, n, k, ld_out, dt, bias, any));
  return pd.weights_desc();
}

StatusOr<std::string> GemmRuntime::KernelFor(int rows, int n, int k, int ld_out, DType dt, bool bias,
                                             const memory::desc& wei) {
  QKV_ASSIGN_OR_RETURN(auto pd, MakePd(rows, n, k, ld_out, dt, bias, wei));
  return std::string(pd.impl_info_str());
}

StatusOr<const GemmRuntime::Prim*> GemmRuntime::Get(int rows, int n, int k, int ld_out, DType dt, bool bias,
                                                    const memory::desc& wei) {
  std::string key = std::to_string(rows) + "/" + std::to_string(n) + "/" + std::to_string(k) + "/" +
                    std::to_string(ld_out) + "/" + DTypeName(dt) + (bias ? "/b/" : "/-/");
  // The weight layout is part of the key: its serialized blob differs between layouts.
  const dnnl_memory_desc_t& c = wei.data;
  key.append(reinterpret_cast<const char*>(&c.format_desc), sizeof(c.format_desc));
  key.append(reinterpret_cast<const char*>(&c.extra), sizeof(c.extra));
  auto it = prims_.find(key);
  if (it != prims_.end()) return it->second.get();
  QKV_ASSIGN_OR_RETURN(auto pd, MakePd(rows, n, k, ld_out, dt, bias, wei));
  if (pd.weights_desc() != wei) return Internal("oneDNN matmul rejected the shared weight layout");
  auto p = std::make_unique<Prim>(Prim{dnnl::matmul(pd), pd});
  const size_t need = pd.scratchpad_desc().get_size();
  for (auto& s : scratch_) {
    if (s.size() < need) s.resize(need);
  }
  const size_t out_need = static_cast<size_t>(rows) * n;
  for (auto& o : out_) {
    if (o.size() < out_need) o.resize(out_need);
  }
  const Prim* out = p.get();
  prims_.emplace(std::move(key), std::move(p));
  return out;
}

std::vector<std::string> GemmRuntime::KernelLog() const {
  std::vector<std::string> out;
  for (const auto& [key, p] : prims_) {
    const auto s = p->pd.src_desc().dims();
    const auto d = p->pd.dst_desc().dims();
    out.push_back("M=" + std::to_string(s[0]) + " K=" + std::to_string(s[1]) + " N=" + std::to_string(d[1]) + " " +
                  p->pd.impl_info_str());
  }
  return out;
}

StatusOr<std::unique_ptr<Linear>> Linear::Create(GemmRuntime& rt, const float* w, const float* bias, int n, int k,
                                                 DType dt) {
  if (n <= 0 || k <= 0) return InvalidArgument("linear: empty shape");
  QKV_ASSIGN_OR_RETURN(std::optional<GemmBackend> forced, GemmBackendFromEnv());
  QKV_RETURN_IF_ERROR(KernelIsaFromEnv().status());
  QKV_RETURN_IF_ERROR(KvPrefetchL2FromEnv().status());
  auto lin = std::unique_ptr<Linear>(new Linear());
  lin->rt_ = &rt;
  lin->n_ = n;
  lin->k_ = k;
  lin->dt_ = dt;
  const std::string shape = std::to_string(n) + "x" + std::to_string(k) + " " + DTypeName(dt);
  if (forced == GemmBackend::kOneDnn) {
    // Forced: oneDNN for every bucket even where its kernels differ (to measure it, or to show the tests fail).
    Status st = lin->CreateOneDnn(w, bias, 1, kTileRows, /*same_kernel=*/false);
    if (!st.ok()) return Internal("linear " + shape + ": QKV_GEMM=onednn: " + st.message());
    rt.NoteLayer(std::string("onednn ") + lin->slices_[0].buckets.back().p->pd.impl_info_str() + " (forced)", dt, dt);
    return lin;
  }
  const bool amx = ActiveKernelIsa() >= KernelIsa::kAmx;
  if (forced == GemmBackend::kAmx && !amx) {
    return FailedPrecondition("linear " + shape + ": QKV_GEMM=amx needs kernel level amx, this process runs at " +
                              KernelIsaName(ActiveKernelIsa()));
  }
  auto split = [&](int panels) {
    const int nthr = rt.n_threads();
    lin->panel_bounds_.resize(nthr + 1);
    for (int t = 0; t <= nthr; ++t) lin->panel_bounds_[t] = static_cast<int>(static_cast<int64_t>(panels) * t / nthr);
  };
  if (amx && (forced == GemmBackend::kAmx || (!forced && dt == DType::kBF16))) {
    lin->amx_ = std::make_unique<AmxWeights>(w, bias, n, k, rt.weights_arena());
    lin->weight_bytes_ = lin->amx_->bytes();
    split(lin->amx_->groups());
    rt.NoteLayer("amx bf16 x bf16", DType::kF32, DType::kBF16);
    return lin;
  }
  // bf16 weights at kernel level avx512_bf16: the packed GEMM's bf16 form, for every M (oneDNN's bf16 brgemm
  // read the weights at 71-82% of the bandwidth at M = 1; docs/performance.md, "bf16 weights on the packed
  // GEMM's vdpbf16ps form").
  const bool dot = dt == DType::kBF16 && ActiveKernelIsa() >= KernelIsa::kAvx512Bf16;
  if (!forced && !dot) {
    std::string why;
    bool no_kernel = false;
    // Largest tiles first (prefill speed), then the smallest padding (decode work).
    for (int max_bucket : kMaxBuckets) {
      for (int min_bucket : kMinBuckets) {
        if (min_bucket > max_bucket || no_kernel) continue;
        Status st = lin->CreateOneDnn(w, bias, min_bucket, max_bucket, /*same_kernel=*/true);
        if (st.ok()) {
          std::string note = std::string("onednn ") + lin->slices_[0].buckets[lin->last_bucket_].p->pd.impl_info_str();
          if (min_bucket > 1) note += " (M >= " + std::to_string(min_bucket) + ")";
          if (max_bucket < kTileRows) note += " (tiles of " + std::to_string(max_bucket) + ")";
          rt.NoteLayer(note, dt, dt);
          return lin;
        }
        why = st.message();
        // Last first, so that the arena takes their weights back (weights_arena.h).
        while (!lin->slices_.empty()) lin->slices_.pop_back();
        no_kernel = st.code() != StatusCode::kFailedPrecondition;  // no kernel at all: padding will not help
      }
    }
    spdlog::debug("linear {}: packed GEMM ({})", shape, why);
  }
  lin->packed_ = std::make_unique<PackedWeights>(w, bias, n, k, dt == DType::kBF16, rt.weights_arena(), dot);
  lin->weight_bytes_ = lin->packed_->bytes();
  split(lin->packed_->panels());
  if (lin->packed_->dot()) {
    rt.NoteLayer(std::string("packed ") + KernelIsaName(lin->packed_->level()) + " bf16 x bf16", DType::kF32,
                 DType::kBF16);
  } else {
    rt.NoteLayer(std::string("packed ") + KernelIsaName(PackedWeights::Level()) + " f32 x " + DTypeName(dt),
                 DType::kF32, DType::kF32);
  }
  return lin;
}

StatusOr<std::unique_ptr<Linear>> Linear::CreateQuantized(GemmRuntime& rt, std::shared_ptr<const QuantWeights> w) {
  if (!w || w->n() <= 0 || w->k() <= 0 || w->k() % 32 != 0 || !w->whole_blocks()) {
    return InvalidArgument("linear: quantized weights must be rows of whole blocks of a quantized type");
  }
  QKV_RETURN_IF_ERROR(KernelIsaFromEnv().status());
  QKV_RETURN_IF_ERROR(KvPrefetchL2FromEnv().status());
  auto lin = std::unique_ptr<Linear>(new Linear());
  lin->rt_ = &rt;
  lin->n_ = w->n();
  lin->k_ = w->k();
  lin->dt_ = DType::kF32;
  lin->weight_bytes_ = w->bytes();
  lin->quant_ = std::move(w);
  rt.NoteLayer(std::string("quantized ") + KernelIsaName(QuantWeights::Level()) + " int8 x " + lin->quant_->types(),
               DType::kF32, DType::kF32);
  return lin;
}

// oneDNN for buckets min_bucket..max_bucket (larger M runs as max_bucket-row tiles). With same_kernel,
// FailedPrecondition when the buckets' kernels differ (or are not brgemm), or when a probe run shows a
// bucket summing in another order than the smallest one (the same kernel name does not promise the same
// order: AMX brgemm blocks K differently at M = 128 for K = 4864); Internal when oneDNN has no kernel.
Status Linear::CreateOneDnn(const float* w, const float* bias, int min_bucket, int max_bucket, bool same_kernel) {
  GemmRuntime& rt = *rt_;
  const int n = n_, k = k_;
  const DType dt = dt_;
  weight_bytes_ = 0;
  first_bucket_ = BucketIndex(min_bucket);
  last_bucket_ = BucketIndex(max_bucket);
  const int nthr = rt.n_threads();
  // Slices are multiples of 16 columns (a full f32 vector) so that a column never straddles two threads.
  const int units = (n + 15) / 16;
  int unit0 = 0;
  std::string kernel;
  for (int t = 0; t < nthr; ++t) {
    const int u = units / nthr + (t < units % nthr ? 1 : 0);
    Slice s;
    s.n0 = std::min(n, unit0 * 16);
    s.n = std::min(n, (unit0 + u) * 16) - s.n0;
    unit0 += u;
    if (s.n <= 0) continue;
    try {
      QKV_ASSIGN_OR_RETURN(memory::desc wd, rt.PreferredWeights(s.n, k, n, dt, bias != nullptr));
      // Check every bucket's kernel before registering any primitive: a rejected layout must not leave
      // primitives, scratchpads and output buffers behind in the runtime.
      for (int b = first_bucket_; same_kernel && b <= last_bucket_; ++b) {
        QKV_ASSIGN_OR_RETURN(const std::string impl, rt.KernelFor(kBuckets[b], s.n, k, n, dt, bias != nullptr, wd));
        if (impl.rfind("brg:", 0) != 0 || (!kernel.empty() && impl != kernel)) {
          return FailedPrecondition("oneDNN picks " + (kernel.empty() ? impl : kernel + " and " + impl) +
                                    " across the M buckets from " + std::to_string(min_bucket));
        }
        kernel = impl;
      }
      s.buckets.resize(kNumBuckets);
      for (int b = first_bucket_; b <= last_bucket_; ++b) {
        QKV_ASSIGN_OR_RETURN(const GemmRuntime::Prim* p, rt.Get(kBuckets[b], s.n, k, n, dt, bias != nullptr, wd));
        Slice::Bucket& bk = s.buckets[b];
        bk.p = p;
        bk.src = memory(p->pd.src_desc(), rt.engine(), DNNL_MEMORY_NONE);
        bk.dst = memory(p->pd.dst_desc(), rt.engine(), DNNL_MEMORY_NONE);
        bk.scratch = memory(p->pd.scratchpad_desc(), rt.engine(), DNNL_MEMORY_NONE);
      }
      // Source: rows n0..n0+n of W ([n][k] row-major) viewed as a k x n matrix.
      memory::desc user({k, s.n}, memory::data_type::f32, memory::dims{1, k});
      memory user_mem(user, rt.engine(), const_cast<float*>(w + static_cast<size_t>(s.n0) * k));
      s.weights_mem = WeightsBuffer(rt.weights_arena(), wd.get_size());
      s.weights = memory(wd, rt.engine(), s.weights_mem.data());
      dnnl::stream st(rt.engine());
      dnnl::reorder(user_mem, s.weights).execute(st, user_mem, s.weights);
      st.wait();
      weight_bytes_ += wd.get_size();
      if (bias) {
        s.bias = memory({{1, s.n}, memory::data_type::f32, tag::ab}, rt.engine());
        std::memcpy(s.bias.get_data_handle(), bias + s.n0, sizeof(float) * s.n);
      }
      for (int b = first_bucket_; b <= last_bucket_; ++b) {
        Slice::Bucket& bk = s.buckets[b];
        // Built once: the memories are handles, so Forward only re-points them.
        bk.args = {{DNNL_ARG_SRC, bk.src},
                   {DNNL_ARG_WEIGHTS, s.weights},
                   {DNNL_ARG_DST, bk.dst},
                   {DNNL_ARG_SCRATCHPAD, bk.scratch}};
        if (bias) bk.args.insert({DNNL_ARG_BIAS, s.bias});
      }
      if (same_kernel) QKV_RETURN_IF_ERROR(ProbeSameBits(s));
    } catch (const dnnl::error& e) {
      return Internal(std::string("linear: oneDNN: ") + e.what());
    }
    slices_.push_back(std::move(s));
  }
  return {};
}

// Runs every bucket of the slice on the same deterministic rows and checks that a sample of rows (at the
// positions where tiles and register blocks begin and end) comes out with the bits each gets alone, at
// position 0 of the smallest bucket. Slices whose buckets share primitives share the verdict.
Status Linear::ProbeSameBits(Slice& s) {
  GemmRuntime& rt = *rt_;
  std::vector<const GemmRuntime::Prim*> key;
  for (int b = first_bucket_; b <= last_bucket_; ++b) key.push_back(s.buckets[b].p);
  auto& verdicts = rt.probe_verdicts();
  auto it = verdicts.find(key);
  if (it == verdicts.end()) {
    const int lo = kBuckets[first_bucket_], hi = kBuckets[last_bucket_];
    const int rows = hi + lo;
    std::vector<float> xf(static_cast<size_t>(rows) * k_);
    uint32_t state = 12345u + static_cast<uint32_t>(k_);
    for (float& v : xf) {
      state = state * 1664525u + 1013904223u;
      v = static_cast<float>(state >> 8) / 8388608.0f - 1.0f;  // [-1, 1)
    }
    std::vector<uint16_t> xb;
    if (dt_ == DType::kBF16) {
      xb.resize(xf.size());
      F32ToBf16Bulk(xf.data(), xb.data(), static_cast<int64_t>(xf.size()));
    }
    const size_t esz = DTypeBytes(dt_);
    const auto* x =
        dt_ == DType::kBF16 ? reinterpret_cast<const uint8_t*>(xb.data()) : reinterpret_cast<const uint8_t*>(xf.data());
    std::vector<float> out(static_cast<size_t>(hi) * s.n), ref;
    auto run = [&](int b, int row0) {
      Slice::Bucket& bk = s.buckets[b];
      bk.src.set_data_handle(const_cast<uint8_t*>(x) + esz * row0 * k_);
      bk.dst.set_data_handle(out.data());
      bk.scratch.set_data_handle(rt.scratch(0));
      bk.p->prim.execute(rt.stream(0), bk.args);
      rt.stream(0).wait();
    };
    std::vector<int> sample;
    for (int r : {0, 1, 2, 3, 5, 8, 13, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 127}) {
      if (r < hi) sample.push_back(r);
    }
    std::string verdict;
    SingleThreaded([&] {
      for (int r : sample) {
        run(first_bucket_, r);
        ref.insert(ref.end(), out.begin(), out.begin() + s.n);
      }
      for (int b = first_bucket_ + 1; b <= last_bucket_ && verdict.empty(); ++b) {
        run(b, 0);
        for (size_t i = 0; i < sample.size() && sample[i] < kBuckets[b]; ++i) {
          if (std::memcmp(&out[static_cast<size_t>(sample[i]) * s.n], &ref[i * s.n], sizeof(float) * s.n) != 0) {
            verdict = "oneDNN's M=" + std::to_string(kBuckets[b]) + " primitive gives row " +
                      std::to_string(sample[i]) + " other bits than M=" + std::to_string(lo);
            break;
          }
        }
      }
      return 0;
    });
    it = verdicts.emplace(std::move(key), std::move(verdict)).first;
  }
  if (!it->second.empty()) return FailedPrecondition(it->second);
  return {};
}

void Linear::Forward(const void* x, int m, float* y) const {
  if (m <= 0) return;
  const int nthr = rt_->n_threads();
  if (quant_) {
    // Each row's int8 image depends on that row only; each output on its row and weight row only. The
    // loops are worksharing loops, so every row and column is computed whatever the team size.
    const auto* xf = static_cast<const float*>(x);
    auto slice = [&](const QuantizedRows& a, int t) {  // slices of whole units (panels, interleaved groups)
      const int c0 = quant_->UnitStart(static_cast<int>(static_cast<int64_t>(n_) * t / nthr));
      const int c1 = quant_->UnitStart(static_cast<int>(static_cast<int64_t>(n_) * (t + 1) / nthr));
      quant_->Compute(a, c0, c1, y, n_);
    };
    if (m <= kOwnQuantRows) {
      // Decode: each thread quantizes the few rows into its own copy (the same bits as a shared copy), so
      // no barrier stands between quantizing and the GEMV (a barrier costs ~1.7 µs on a 2-core VM, against
      // ~0.3 µs to quantize a row of 1,024).
      QuantizedRows* own = rt_->ThreadQuantizedRowsFor(m, k_);
#pragma omp parallel for num_threads(nthr) schedule(static)
      for (int t = 0; t < nthr; ++t) {
        QuantizedRows& a = own[omp_get_thread_num()];
        a.Quantize(xf, 0, m);
        slice(a, t);
      }
      return;
    }
    QuantizedRows& a = rt_->QuantizedRowsFor(m, k_);
#pragma omp parallel num_threads(nthr)
    {
#pragma omp for schedule(static)
      for (int t = 0; t < nthr; ++t) a.Quantize(xf, m * t / nthr, m * (t + 1) / nthr);
#pragma omp for schedule(static)
      for (int t = 0; t < nthr; ++t) slice(a, t);
    }
    return;
  }
  if (amx_) {
    // Rows are packed (rounded to bf16, in tile order) once for all slices; each output depends on its row
    // and weight column only. Worksharing loops: every tile and slice is computed whatever the team size.
    uint16_t* a = rt_->Bf16RowsFor(AmxWeights::PackedRowsSize(m, k_));
    const int mtiles = (m + AmxWeights::kTileRows - 1) / AmxWeights::kTileRows;
    const auto* xf = static_cast<const float*>(x);
#pragma omp parallel num_threads(nthr)
    {
#pragma omp for schedule(static)
      for (int t = 0; t < nthr; ++t) {
        AmxWeights::PackRows(xf, k_, m, k_, mtiles * t / nthr, mtiles * (t + 1) / nthr, a);
      }
#pragma omp for schedule(static)
      for (int t = 0; t < nthr; ++t) amx_->Compute(a, m, panel_bounds_[t], panel_bounds_[t + 1], y, n_);
    }
    return;
  }
  if (packed_ && packed_->dot()) {
    // Rows rounded to bf16 once for all slices (each rounded row depends on its row only), then the slices;
    // worksharing loops, so every row and slice is done whatever the team size.
    uint16_t* a = rt_->Bf16RowsFor(packed_->RoundedRowsSize(m));
    const auto* xf = static_cast<const float*>(x);
#pragma omp parallel num_threads(nthr)
    {
#pragma omp for schedule(static)
      for (int t = 0; t < nthr; ++t) packed_->RoundRows(xf, k_, m * t / nthr, m * (t + 1) / nthr, a);
#pragma omp for schedule(static)
      for (int t = 0; t < nthr; ++t) packed_->ComputeRounded(a, m, panel_bounds_[t], panel_bounds_[t + 1], y, n_);
    }
    return;
  }
  if (packed_) {
    // A worksharing loop: every slice is computed whatever size the team turns out to be.
#pragma omp parallel for num_threads(nthr) schedule(static)
    for (int t = 0; t < nthr; ++t) {
      packed_->Compute(static_cast<const float*>(x), k_, m, panel_bounds_[t], panel_bounds_[t + 1], y, n_);
    }
    return;
  }
  const size_t esz = DTypeBytes(dt_);
  const int nslices = static_cast<int>(slices_.size());
#pragma omp parallel for num_threads(nthr) schedule(static)
  for (int si = 0; si < nslices; ++si) {
    const int t = omp_get_thread_num();
    const Slice& s = slices_[si];
    const int tile = kBuckets[last_bucket_];
    for (int r0 = 0; r0 < m; r0 += tile) {
      const int rows = std::min(tile, m - r0);
      const Slice::Bucket& bk = s.buckets[std::max(first_bucket_, BucketIndex(rows))];
      bk.src.set_data_handle(const_cast<uint8_t*>(static_cast<const uint8_t*>(x)) + esz * r0 * k_);
      float* out = rt_->out(t);
      bk.dst.set_data_handle(out);
      bk.scratch.set_data_handle(rt_->scratch(t));
      bk.p->prim.execute(rt_->stream(t), bk.args);
      for (int r = 0; r < rows; ++r) {
        std::memcpy(y + static_cast<size_t>(r0 + r) * n_ + s.n0, out + static_cast<size_t>(r) * s.n,
                    sizeof(float) * s.n);
      }
    }
  }
}

const void* Linear::PrepareShare(const float* x, int m, int t) const {
  if (quant_) {
    QuantizedRows& q = rt_->OwnQuantizedRows(t, m, k_);
    q.Quantize(x, 0, m);
    return &q;
  }
  if (packed_ && packed_->dot()) {
    uint16_t* b = rt_->OwnBf16Rows(t, packed_->RoundedRowsSize(PaddedRows(m)));
    packed_->RoundRows(x, k_, 0, m, b);
    return b;
  }
  if (!packed_ && dt_ == DType::kBF16) {
    uint16_t* b = rt_->OwnBf16Rows(t, static_cast<size_t>(PaddedRows(m)) * k_);
    F32ToBf16Bulk(x, b, static_cast<int64_t>(m) * k_);
    return b;
  }
  return x;
}

std::pair<int, int> Linear::ComputeShare(int i, int t, const void* in, int m, float* y) const {
  const auto* x = static_cast<const float*>(in);
  const int nthr = rt_->n_threads();
  if (quant_) {  // the same whole-unit slices as Forward
    const int c0 = quant_->UnitStart(static_cast<int>(static_cast<int64_t>(n_) * i / nthr));
    const int c1 = quant_->UnitStart(static_cast<int>(static_cast<int64_t>(n_) * (i + 1) / nthr));
    quant_->Compute(*static_cast<const QuantizedRows*>(in), c0, c1, y, n_);
    return {c0, c1};
  }
  if (packed_) {
    if (packed_->dot()) {
      packed_->ComputeRounded(static_cast<const uint16_t*>(in), m, panel_bounds_[i], panel_bounds_[i + 1], y, n_);
    } else {
      packed_->Compute(x, k_, m, panel_bounds_[i], panel_bounds_[i + 1], y, n_);
    }
    return {std::min(n_, panel_bounds_[i] * PackedWeights::kPanel),
            std::min(n_, panel_bounds_[i + 1] * PackedWeights::kPanel)};
  }
  // oneDNN: m ≤ kOwnQuantRows rows are one call of the slice's bucket, into thread t's buffer.
  const Slice& s = slices_[i];
  const Slice::Bucket& bk = s.buckets[std::max(first_bucket_, BucketIndex(m))];
  bk.src.set_data_handle(const_cast<void*>(in));
  float* out = rt_->out(t);
  bk.dst.set_data_handle(out);
  bk.scratch.set_data_handle(rt_->scratch(t));
  bk.p->prim.execute(rt_->stream(t), bk.args);
  for (int r = 0; r < m; ++r) {
    std::memcpy(y + static_cast<size_t>(r) * n_ + s.n0, out + static_cast<size_t>(r) * s.n, sizeof(float) * s.n);
  }
  return {s.n0, s.n0 + s.n};
}

}  // namespace qkv
