#include "engine/model.h"

#include <omp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>

#include "engine/bf16.h"
#include "engine/kernels/attention.h"

namespace qkv {
namespace {

std::string ShapeStr(const std::vector<uint64_t>& ne) {
  std::string s = "{";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "}";
}

// Reads a tensor as f32 after checking that its shape (ggml order) is exactly `ne`.
StatusOr<std::vector<float>> ReadTensor(const GgufFile& f, const std::string& name, std::vector<uint64_t> ne) {
  const GgufTensor* t = f.FindTensor(name);
  if (!t) return DataLoss("model: missing tensor '" + name + "'");
  if (t->ne != ne) {
    return DataLoss("model: tensor '" + name + "' has shape " + ShapeStr(t->ne) + ", expected " + ShapeStr(ne));
  }
  std::vector<float> out(t->n_elements());
  QKV_RETURN_IF_ERROR(DequantizeToF32(*t, out.data()));
  for (float v : out) {
    if (!std::isfinite(v)) return DataLoss("model: tensor '" + name + "' holds a non-finite value");
  }
  return out;
}

int64_t MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

}  // namespace

RopeStyle RopeStyleOf(Arch a) { return a == Arch::kLlama ? RopeStyle::kInterleaved : RopeStyle::kHalves; }

Model::~Model() = default;

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& path, const ModelOptions& opt) {
  if (opt.n_threads < 1 || opt.n_threads > 256) return InvalidArgument("threads must be in 1..256");
  if (opt.max_batch_tokens < 1 || opt.max_batch_tokens > 65536) {
    return InvalidArgument("max batch tokens must be in 1..65536");
  }
  if (opt.block_size < 1 || opt.block_size > 1024) return InvalidArgument("block size must be in 1..1024");
  auto m = std::unique_ptr<Model>(new Model());
  m->opt_ = opt;
  {
    QKV_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::Open(path));
    QKV_ASSIGN_OR_RETURN(m->cfg_, ModelConfig::FromGguf(*f));
    if (opt.tokenizer_path.empty()) {
      QKV_ASSIGN_OR_RETURN(m->tokenizer_, LoadTokenizerFromGguf(*f));
    } else {
      QKV_ASSIGN_OR_RETURN(m->tokenizer_, LoadTokenizerFromJson(opt.tokenizer_path));
    }
    if (m->tokenizer_->vocab_size() > m->cfg_.vocab) {
      return DataLoss("model: the tokenizer has " + std::to_string(m->tokenizer_->vocab_size()) +
                      " tokens but the embedding only " + std::to_string(m->cfg_.vocab));
    }
    m->rt_ = std::make_unique<GemmRuntime>(opt.n_threads);
    QKV_RETURN_IF_ERROR(m->LoadWeights(*f));
  }  // the GGUF mapping is released here: only converted weights stay resident
  spdlog::info("model: {}; weights {} ({:.1f} MB), {} threads", m->cfg_.Summary(), DTypeName(opt.weights_dtype),
               m->weight_bytes_ / 1e6, opt.n_threads);
  spdlog::info("gemm: cpu isa {}; compute dtype {}; {}", GemmRuntime::CpuIsa(), DTypeName(m->compute_dtype()),
               m->rt_->Summary());
  for (const std::string& k : m->rt_->KernelLog()) spdlog::debug("gemm bucket: {}", k);
  const ModelConfig& c = m->cfg_;
  m->max_ctx_ = opt.max_context > 0 ? std::min(opt.max_context, c.context_length) : c.context_length;
  KvCacheShape ks;
  ks.n_layers = c.n_layers;
  ks.n_kv_heads = c.n_kv_heads;
  ks.head_dim = c.head_dim;
  ks.block_size = opt.block_size;
  ks.dtype = opt.kv_dtype;
  const int64_t ctx_blocks = (m->max_ctx_ + opt.block_size - 1) / opt.block_size;
  if (opt.kv_blocks > 0) {
    ks.n_blocks = opt.kv_blocks;
  } else if (opt.kv_cache_bytes > 0 || opt.kv_cache_bytes == ModelOptions::kAutoKvBytes) {
    int64_t budget = opt.kv_cache_bytes;
    if (budget == ModelOptions::kAutoKvBytes) {
      const int64_t avail = MemAvailableBytes();
      // A quarter of what is available after the weights, at most 8 GiB, and no more than 1,024 full
      // contexts (a small model needs far less than a quarter of the machine).
      budget = std::min<int64_t>({std::max<int64_t>(avail - static_cast<int64_t>(m->weight_bytes_), 0) / 4, 8ll << 30,
                                  1024ll * m->max_ctx_ * ks.bytes_per_token()});
    }
    ks.n_blocks = std::max(budget / ks.bytes_per_block(), ctx_blocks);
  } else {
    ks.n_blocks = ctx_blocks;
  }
  QKV_ASSIGN_OR_RETURN(m->kv_, KvCache::Create(ks));
  spdlog::info("kv cache: {} blocks of {} tokens = {} tokens, {:.1f} MiB ({} per token, {})", ks.n_blocks,
               ks.block_size, ks.n_blocks * ks.block_size, static_cast<double>(m->kv_->arena_bytes()) / (1 << 20),
               ks.bytes_per_token(), DTypeName(ks.dtype));
  m->rope_ = std::make_unique<RopeTable>(c.rotary_dim, c.rope_theta, m->max_ctx_);

  // Scratch for the largest batch.
  const int rows = (opt.max_batch_tokens + kTileRows - 1) / kTileRows * kTileRows;
  m->rows_cap_ = rows;
  const int qkv_n = c.q_dim() * (c.attn_output_gate ? 2 : 1) + 2 * c.kv_dim();
  const size_t R = static_cast<size_t>(rows);
  m->x_.assign(R * c.hidden, 0);
  m->h_.assign(R * c.hidden, 0);
  m->qkv_.assign(R * qkv_n, 0);
  m->attn_.assign(R * c.q_dim(), 0);
  m->tmp_.assign(R * c.hidden, 0);
  m->gu_.assign(R * 2 * c.ffn, 0);
  m->act_.assign(R * c.ffn, 0);
  m->logits_.assign(R * c.vocab, 0);
  if (opt.weights_dtype == DType::kBF16) m->in_lp_.assign(R * std::max({c.hidden, c.q_dim(), c.ffn}), 0);
  const int group = c.n_heads / c.n_kv_heads;
  m->attn_scratch_stride_ = AttentionScratchFloats(group, m->max_ctx_, c.head_dim, opt.block_size) + 16;
  m->attn_scratch_.assign(m->attn_scratch_stride_ * opt.n_threads, 0);
  m->tok_chunk_.resize(opt.max_batch_tokens);
  m->tok_pos_.resize(opt.max_batch_tokens);
  m->logit_src_.resize(opt.max_batch_tokens);
  return m;
}

Status Model::LoadWeights(const GgufFile& f) {
  const ModelConfig& c = cfg_;
  const auto H = static_cast<uint64_t>(c.hidden);
  const DType dt = opt_.weights_dtype;
  const int q_rows = c.q_dim() * (c.attn_output_gate ? 2 : 1);
  QKV_ASSIGN_OR_RETURN(std::vector<float> emb, ReadTensor(f, "token_embd.weight", {H, static_cast<uint64_t>(c.vocab)}));
  QKV_ASSIGN_OR_RETURN(final_norm_, ReadTensor(f, "output_norm.weight", {H}));
  auto make_linear = [&](const std::vector<float>& w, const float* b, int n, int k) {
    return Linear::Create(*rt_, w.data(), b, n, k, dt);
  };
  if (c.tied_embeddings) {
    QKV_ASSIGN_OR_RETURN(lm_head_, make_linear(emb, nullptr, c.vocab, c.hidden));
  } else {
    QKV_ASSIGN_OR_RETURN(std::vector<float> out, ReadTensor(f, "output.weight", {H, static_cast<uint64_t>(c.vocab)}));
    QKV_ASSIGN_OR_RETURN(lm_head_, make_linear(out, nullptr, c.vocab, c.hidden));
  }
  if (dt == DType::kF32) {
    embed_f32_ = std::move(emb);
    weight_bytes_ += embed_f32_.size() * 4;
  } else {
    embed_bf16_.resize(emb.size());
    F32ToBf16Bulk(emb.data(), embed_bf16_.data(), static_cast<int64_t>(emb.size()));
    weight_bytes_ += embed_bf16_.size() * 2;
  }
  weight_bytes_ += lm_head_->weight_bytes() + final_norm_.size() * 4;
  weight_bytes_per_token_ += lm_head_->weight_bytes();

  layers_.resize(c.n_layers);
  const int hd = c.head_dim;
  for (int l = 0; l < c.n_layers; ++l) {
    Layer& L = layers_[l];
    const std::string p = "blk." + std::to_string(l) + ".";
    QKV_ASSIGN_OR_RETURN(L.attn_norm, ReadTensor(f, p + "attn_norm.weight", {H}));
    QKV_ASSIGN_OR_RETURN(L.ffn_norm, ReadTensor(f, p + "ffn_norm.weight", {H}));
    QKV_ASSIGN_OR_RETURN(auto wq, ReadTensor(f, p + "attn_q.weight", {H, static_cast<uint64_t>(q_rows)}));
    QKV_ASSIGN_OR_RETURN(auto wk, ReadTensor(f, p + "attn_k.weight", {H, static_cast<uint64_t>(c.kv_dim())}));
    QKV_ASSIGN_OR_RETURN(auto wv, ReadTensor(f, p + "attn_v.weight", {H, static_cast<uint64_t>(c.kv_dim())}));
    std::vector<float> bq, bk, bv;
    if (c.attention_bias) {
      QKV_ASSIGN_OR_RETURN(bq, ReadTensor(f, p + "attn_q.bias", {static_cast<uint64_t>(q_rows)}));
      QKV_ASSIGN_OR_RETURN(bk, ReadTensor(f, p + "attn_k.bias", {static_cast<uint64_t>(c.kv_dim())}));
      QKV_ASSIGN_OR_RETURN(bv, ReadTensor(f, p + "attn_v.bias", {static_cast<uint64_t>(c.kv_dim())}));
    }
    if (c.qk_norm) {
      QKV_ASSIGN_OR_RETURN(L.q_norm, ReadTensor(f, p + "attn_q_norm.weight", {static_cast<uint64_t>(hd)}));
      QKV_ASSIGN_OR_RETURN(L.k_norm, ReadTensor(f, p + "attn_k_norm.weight", {static_cast<uint64_t>(hd)}));
    }
    if (c.attention_sinks) {
      QKV_ASSIGN_OR_RETURN(L.sinks, ReadTensor(f, p + "attn_sinks.weight", {static_cast<uint64_t>(c.n_heads)}));
    }
    // Fused QKV rows: [queries of all heads | gates of all heads | k | v]. With the output gate, the
    // file's q_proj interleaves [query, gate] per head (Qwen3-Next); de-interleave it here.
    const size_t K = c.hidden;
    std::vector<float> w;
    std::vector<float> b;
    w.reserve((q_rows + 2 * c.kv_dim()) * K);
    auto append_rows = [&](const std::vector<float>& src, const std::vector<float>& sb, int r0, int n) {
      w.insert(w.end(), src.begin() + r0 * K, src.begin() + (r0 + n) * K);
      if (c.attention_bias) b.insert(b.end(), sb.begin() + r0, sb.begin() + r0 + n);
    };
    if (c.attn_output_gate) {
      for (int h = 0; h < c.n_heads; ++h) append_rows(wq, bq, 2 * h * hd, hd);
      for (int h = 0; h < c.n_heads; ++h) append_rows(wq, bq, 2 * h * hd + hd, hd);
    } else {
      append_rows(wq, bq, 0, q_rows);
    }
    append_rows(wk, bk, 0, c.kv_dim());
    append_rows(wv, bv, 0, c.kv_dim());
    QKV_ASSIGN_OR_RETURN(L.qkv,
                         make_linear(w, c.attention_bias ? b.data() : nullptr, q_rows + 2 * c.kv_dim(), c.hidden));
    QKV_ASSIGN_OR_RETURN(auto wo, ReadTensor(f, p + "attn_output.weight", {static_cast<uint64_t>(c.q_dim()), H}));
    QKV_ASSIGN_OR_RETURN(L.o, make_linear(wo, nullptr, c.hidden, c.q_dim()));
    const auto F = static_cast<uint64_t>(c.ffn);
    QKV_ASSIGN_OR_RETURN(auto wg, ReadTensor(f, p + "ffn_gate.weight", {H, F}));
    QKV_ASSIGN_OR_RETURN(auto wu, ReadTensor(f, p + "ffn_up.weight", {H, F}));
    wg.insert(wg.end(), wu.begin(), wu.end());
    QKV_ASSIGN_OR_RETURN(L.gate_up, make_linear(wg, nullptr, 2 * c.ffn, c.hidden));
    QKV_ASSIGN_OR_RETURN(auto wd, ReadTensor(f, p + "ffn_down.weight", {F, H}));
    QKV_ASSIGN_OR_RETURN(L.down, make_linear(wd, nullptr, c.hidden, c.ffn));
    const size_t lb = L.qkv->weight_bytes() + L.o->weight_bytes() + L.gate_up->weight_bytes() + L.down->weight_bytes();
    weight_bytes_ += lb + 4 * (L.attn_norm.size() + L.ffn_norm.size() + L.q_norm.size() + L.k_norm.size() +
                               L.sinks.size() + b.size());
    weight_bytes_per_token_ += lb;
  }
  return {};
}

size_t Model::scratch_bytes() const {
  size_t n = 0;
  for (const auto* v : {&x_, &h_, &qkv_, &attn_, &tmp_, &gu_, &act_, &logits_, &attn_scratch_})
    n += v->capacity() * sizeof(float);
  n += in_lp_.capacity() * sizeof(uint16_t);
  return n + rt_->scratch_bytes();
}

DType Model::compute_dtype() const {
  return lm_head_->input_dtype() == DType::kBF16 || layers_[0].qkv->input_dtype() == DType::kBF16 ? DType::kBF16
                                                                                                  : DType::kF32;
}

void Model::RunLinear(const Linear& lin, const float* x, int rows, float* y) {
  const void* in = x;
  if (lin.input_dtype() == DType::kBF16) {
    F32ToBf16Bulk(x, in_lp_.data(), static_cast<int64_t>(rows) * lin.k());
    in = in_lp_.data();
  }
  lin.Forward(in, rows, y);
}

namespace {
// Adds the time since the last mark to a profile field, when profiling.
class PhaseTimer {
 public:
  explicit PhaseTimer(bool on) : on_(on) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  void Mark(double& field) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    field += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  bool on_;
  std::chrono::steady_clock::time_point last_;
};
}  // namespace

Status Model::CheckChunk(const BatchChunk& ch) const {
  if (!ch.seq || ch.tokens.empty()) return InvalidArgument("forward: empty chunk");
  const int64_t end = static_cast<int64_t>(ch.seq->n_tokens) + static_cast<int64_t>(ch.tokens.size());
  if (end > max_ctx_) {
    return InvalidArgument("forward: sequence would reach " + std::to_string(end) + " tokens, past the context of " +
                           std::to_string(max_ctx_));
  }
  if (static_cast<int64_t>(ch.seq->blocks.size()) * opt_.block_size < end) {
    return FailedPrecondition("forward: KV blocks not reserved for the chunk");
  }
  for (int t : ch.tokens) {
    if (t < 0 || t >= cfg_.vocab)
      return InvalidArgument("forward: token id " + std::to_string(t) + " out of vocabulary");
  }
  return {};
}

Status Model::Forward(std::span<const BatchChunk> batch) {
  const ModelConfig& c = cfg_;
  // Validate the whole batch before touching anything.
  int T = 0;
  for (size_t ci = 0; ci < batch.size(); ++ci) {
    const BatchChunk& ch = batch[ci];
    if (!ch.seq || ch.tokens.empty()) return InvalidArgument("forward: empty chunk");
    for (size_t cj = 0; cj < ci; ++cj) {
      if (batch[cj].seq == ch.seq) return InvalidArgument("forward: a sequence appears twice in one batch");
    }
    QKV_RETURN_IF_ERROR(CheckChunk(ch));
    if (T + static_cast<int>(ch.tokens.size()) > opt_.max_batch_tokens) {
      return InvalidArgument("forward: batch exceeds " + std::to_string(opt_.max_batch_tokens) + " tokens");
    }
    for (size_t i = 0; i < ch.tokens.size(); ++i) {
      tok_chunk_[T] = static_cast<int>(ci);
      tok_pos_[T] = ch.seq->n_tokens + static_cast<int>(i);
      ++T;
    }
  }
  if (T == 0) return InvalidArgument("forward: empty batch");

  const int H = c.hidden, hd = c.head_dim;
  const int q_dim = c.q_dim(), kv_dim = c.kv_dim();
  const int gate_off = q_dim;
  const int k_off = q_dim * (c.attn_output_gate ? 2 : 1);
  const int v_off = k_off + kv_dim;
  const int qkv_n = v_off + kv_dim;
  const float eps = static_cast<float>(c.rms_eps);
  const RopeStyle style = RopeStyleOf(c.arch);
  const int nthr = opt_.n_threads;

  PhaseTimer timer(profiling_);
  Profile& pf = profile_;
  // Embedding lookup.
  {
    int t = 0;
    for (const BatchChunk& ch : batch) {
      for (int id : ch.tokens) {
        float* dst = &x_[static_cast<size_t>(t++) * H];
        if (!embed_f32_.empty()) {
          std::memcpy(dst, &embed_f32_[static_cast<size_t>(id) * H], sizeof(float) * H);
        } else {
          Bf16ToF32Bulk(&embed_bf16_[static_cast<size_t>(id) * H], dst, H);
        }
      }
    }
  }

  timer.Mark(pf.embed);
  for (int l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[l];
#pragma omp parallel for num_threads(nthr) if (T > 1)
    for (int t = 0; t < T; ++t)
      RmsNorm(&x_[static_cast<size_t>(t) * H], L.attn_norm.data(), &h_[static_cast<size_t>(t) * H], H, eps);
    timer.Mark(pf.norms);
    RunLinear(*L.qkv, h_.data(), T, qkv_.data());
    timer.Mark(pf.qkv);

    // q/k norm, RoPE (Q and K only; V is stored as projected), then K/V into the cache.
#pragma omp parallel for num_threads(nthr) if (T > 1)
    for (int t = 0; t < T; ++t) {
      float* row = &qkv_[static_cast<size_t>(t) * qkv_n];
      const int pos = tok_pos_[t];
      for (int h = 0; h < c.n_heads; ++h) {
        float* q = row + h * hd;
        if (c.qk_norm) RmsNorm(q, L.q_norm.data(), q, hd, eps);
        if (c.rotary_dim > 0) rope_->Apply(q, pos, style);
      }
      for (int h = 0; h < c.n_kv_heads; ++h) {
        float* k = row + k_off + h * hd;
        if (c.qk_norm) RmsNorm(k, L.k_norm.data(), k, hd, eps);
        if (c.rotary_dim > 0) rope_->Apply(k, pos, style);
      }
      const BatchChunk& ch = batch[tok_chunk_[t]];
      StoreKv(*kv_, l, ch.seq->blocks.data(), pos, row + k_off, row + v_off);
    }
    timer.Mark(pf.rope_store);

    AttentionShape as{c.n_heads, c.n_kv_heads, hd, c.attention_sinks ? L.sinks.data() : nullptr};
    const int items = T * c.n_kv_heads;
#pragma omp parallel for num_threads(nthr) schedule(dynamic, 1) if (items > 1)
    for (int it = 0; it < items; ++it) {
      const int t = it / c.n_kv_heads, g = it % c.n_kv_heads;
      const BatchChunk& ch = batch[tok_chunk_[t]];
      float* scratch = &attn_scratch_[attn_scratch_stride_ * omp_get_thread_num()];
      AttendGroup(*kv_, l, ch.seq->blocks.data(), tok_pos_[t] + 1, &qkv_[static_cast<size_t>(t) * qkv_n],
                  &attn_[static_cast<size_t>(t) * q_dim], as, g, scratch);
    }
    if (c.attn_output_gate) {
      for (int t = 0; t < T; ++t) {
        float* a = &attn_[static_cast<size_t>(t) * q_dim];
        const float* gt = &qkv_[static_cast<size_t>(t) * qkv_n + gate_off];
        for (int i = 0; i < q_dim; ++i) a[i] *= 1.0f / (1.0f + FastExp(-gt[i]));
      }
    }
    timer.Mark(pf.attention);
    RunLinear(*L.o, attn_.data(), T, tmp_.data());
    AddInPlace(x_.data(), tmp_.data(), T * H);
    timer.Mark(pf.o);

#pragma omp parallel for num_threads(nthr) if (T > 1)
    for (int t = 0; t < T; ++t)
      RmsNorm(&x_[static_cast<size_t>(t) * H], L.ffn_norm.data(), &h_[static_cast<size_t>(t) * H], H, eps);
    timer.Mark(pf.norms);
    RunLinear(*L.gate_up, h_.data(), T, gu_.data());
    timer.Mark(pf.ffn_up);
    const int F = c.ffn;
#pragma omp parallel for num_threads(nthr) if (T > 1)
    for (int t = 0; t < T; ++t) {
      const float* g = &gu_[static_cast<size_t>(t) * 2 * F];
      SiluMul(g, g + F, &act_[static_cast<size_t>(t) * F], F);
    }
    timer.Mark(pf.ffn_act);
    RunLinear(*L.down, act_.data(), T, tmp_.data());
    AddInPlace(x_.data(), tmp_.data(), T * H);
    timer.Mark(pf.ffn_down);
  }

  // Final norm and LM head, only on the rows whose logits are wanted.
  int rows = 0;
  {
    int t = 0;
    for (const BatchChunk& ch : batch) {
      const int n = static_cast<int>(ch.tokens.size());
      for (int i = 0; i < n; ++i, ++t) {
        if (ch.all_logits || i == n - 1) logit_src_[rows++] = t;
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    RmsNorm(&x_[static_cast<size_t>(logit_src_[r]) * H], final_norm_.data(), &h_[static_cast<size_t>(r) * H], H, eps);
  }
  RunLinear(*lm_head_, h_.data(), rows, logits_.data());
  timer.Mark(pf.lm_head);
  logits_rows_ = rows;
  for (const BatchChunk& ch : batch) ch.seq->n_tokens += static_cast<int>(ch.tokens.size());
  return {};
}

}  // namespace qkv
