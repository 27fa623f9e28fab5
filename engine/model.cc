#include "engine/model.h"

#include <omp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include "engine/bf16.h"
#include "engine/cgroup.h"
#include "engine/kernels/attention.h"

namespace qkv {
namespace {

// Memory this process may still use: MemAvailable, capped by the least any cgroup between the process's and
// the root may still take (engine/cgroup.h: a container's limit, a systemd unit's MemoryMax=, a parent
// slice's), so that a pod under a Kubernetes limit sizes its KV cache from the limit, not from the host.
int64_t MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  int64_t avail = 0;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") {
      avail = kb * 1024;
      break;
    }
  }
  return std::min(avail, CgroupMemoryHeadroom(ProcSelfCgroup(), CgroupRoot()));
}

// A tensor the layers did not read would change what the model computes (a bias, Llama 3.1's rope_freqs, a
// norm of a variant): refuse the file rather than compute something else. Blocks past the decoder stack
// (deepseek2's next-token-prediction layers, nextn_predict_layers) are for speculative decoding and left.
Status CheckEveryTensorUsed(const GgufFile& f, int n_layers) {
  std::vector<std::string> unused;
  int mtp = 0;
  for (const std::string& name : f.UnusedTensors()) {
    int block = -1;
    if (name.starts_with("blk.")) {
      const auto [ptr, ec] = std::from_chars(name.data() + 4, name.data() + name.size(), block);
      if (ec != std::errc() || *ptr != '.') block = -1;
    }
    if (block >= n_layers) {
      ++mtp;
    } else {
      unused.push_back(name);
    }
  }
  if (mtp > 0) spdlog::info("model: {} tensors of blocks past the {} decoder layers are not used", mtp, n_layers);
  if (unused.empty()) return {};
  std::string list;
  for (size_t i = 0; i < unused.size() && i < 8; ++i) list += (i ? ", " : "") + unused[i];
  if (unused.size() > 8) list += ", … (" + std::to_string(unused.size() - 8) + " more)";
  return Unimplemented("model: the file has " + std::to_string(unused.size()) +
                       " tensors this engine does not compute with, so its output would not be the model's: " + list);
}

}  // namespace

Model::~Model() = default;

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& path, const ModelOptions& opt) {
  if (opt.n_threads < 1 || opt.n_threads > 256) return InvalidArgument("threads must be in 1..256");
  if (opt.max_batch_tokens < 1 || opt.max_batch_tokens > 65536) {
    return InvalidArgument("max batch tokens must be in 1..65536");
  }
  if (opt.block_size < 1 || opt.block_size > 1024) return InvalidArgument("block size must be in 1..1024");
  if (opt.max_logit_rows < 0 || opt.max_logit_rows > opt.max_batch_tokens) {
    return InvalidArgument("max logit rows must be in 0..max batch tokens (" + std::to_string(opt.max_batch_tokens) +
                           "); 0 means max batch tokens");
  }
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
    const ModelConfig& c = m->cfg_;
    m->max_ctx_ = opt.max_context > 0 ? std::min(opt.max_context, c.context_length) : c.context_length;
    const RopeParams rp = c.Rope();
    m->rope_ = std::make_unique<RopeTable>(
        c.rotary_dim, c.rope_theta, m->max_ctx_,
        RopeScale{rp.freq_scale, rp.yarn, rp.orig_ctx, rp.beta_fast, rp.beta_slow, rp.magnitude, rp.freq_factors});
    m->rows_cap_ = (opt.max_batch_tokens + kTileRows - 1) / kTileRows * kTileRows;
    m->logit_rows_cap_ = opt.max_logit_rows > 0 ? opt.max_logit_rows : opt.max_batch_tokens;
    QKV_RETURN_IF_ERROR(m->LoadWeights(*f));
    QKV_RETURN_IF_ERROR(CheckEveryTensorUsed(*f, c.n_layers));
  }  // the GGUF mapping is released here: only converted weights stay resident
  spdlog::info("model: {}; weights {} ({:.1f} MB), {} threads", m->cfg_.Summary(), m->weights_summary(),
               m->weight_bytes_ / 1e6, opt.n_threads);
  spdlog::info("gemm: cpu isa {} (own kernels {}, kv prefetch into {}); compute dtype {}; {}", GemmRuntime::CpuIsa(),
               KernelIsaName(ActiveKernelIsa()), KvPrefetchL2() ? "l2" : "l1", DTypeName(m->compute_dtype()),
               m->rt_->Summary());
  {
    const Tokenizer& t = *m->tokenizer_;
    std::string eog;
    for (int id : t.eog_ids()) eog += (eog.empty() ? "" : ", ") + std::to_string(id) + " " + t.TokenBytes(id);
    spdlog::info("tokenizer: {} tokens, bos {}, eos {}; generation ends at {}", t.vocab_size(), t.bos_id(), t.eos_id(),
                 eog.empty() ? std::string("no token") : eog);
  }
  for (const std::string& k : m->rt_->KernelLog()) spdlog::debug("gemm bucket: {}", k);
  if (const WeightsArena& a = *m->rt_->weights_arena(); a.used_bytes() > 0) {
    spdlog::info("weights arena: {:.1f} MB of weights in {:.1f} MB of regions, {} (transparent huge pages: {})",
                 a.used_bytes() / 1e6, a.held_bytes() / 1e6,
                 a.huge_pages() ? "advised for huge pages" : "not advised (QKV_HUGE_PAGES=0)", ThpMode());
  }
  const ModelConfig& c = m->cfg_;
  // The cache the layers need: one arena layer of the paged token store per layer kind that caches per
  // token, and state slots if any kind keeps per-sequence state. Sized here; the scheduler allocates it.
  KvCacheShape ks;
  ks.n_layers = m->kv_layers_;
  ks.n_kv_heads = c.n_kv_heads;
  ks.head_dim = c.head_dim;
  if (c.is_mla()) {  // the latent in the K plane, the shared rope key in the V plane (kernels/mla_attention.h)
    ks.head_dim = c.mla.kv_lora_rank;
    ks.v_dim = c.rotary_dim;
  }
  ks.block_size = opt.block_size;
  ks.dtype = opt.kv_dtype;
  const int64_t ctx_blocks = (m->max_ctx_ + opt.block_size - 1) / opt.block_size;
  // Layers that keep per-sequence state (Gated DeltaNet) share the budget with the KV blocks: unless
  // --state-slots gives the count, the slots take up to half the budget (at least 1, at most 64 slots) and
  // the blocks the rest; without a byte budget, 64 slots or as many as 2 GiB hold, at least 1.
  const CacheSpec spec = m->cache_spec();
  const int64_t state_bytes = spec.state_bytes_per_seq;
  constexpr int kMaxDefaultSlots = 64;
  int slots = 0;
  if (state_bytes > 0) {
    slots = opt.state_slots > 0 ? opt.state_slots
                                : static_cast<int>(std::clamp<int64_t>((2ll << 30) / state_bytes, 1, kMaxDefaultSlots));
  }
  // Prefix caching keeps copies of states at block boundaries (Scheduler): a quarter as many as the slots.
  auto snapshots_for = [](int n) { return n / 4; };
  if (opt.kv_blocks > 0) {
    ks.n_blocks = opt.kv_blocks;
  } else if (opt.kv_cache_bytes > 0 || opt.kv_cache_bytes == ModelOptions::kAutoKvBytes) {
    int64_t budget = opt.kv_cache_bytes;
    if (budget == ModelOptions::kAutoKvBytes) {
      const int64_t avail = MemAvailableBytes();
      // A quarter of what is available after the weights, at most 8 GiB, and no more than 256 full
      // contexts (a small model needs far less than a quarter of the machine).
      budget = std::min<int64_t>({std::max<int64_t>(avail - static_cast<int64_t>(m->weight_bytes_), 0) / 4, 8ll << 30,
                                  256ll * m->max_ctx_ * ks.bytes_per_token() + kMaxDefaultSlots * state_bytes});
    }
    if (state_bytes > 0) {
      if (opt.state_slots <= 0) {
        slots = static_cast<int>(std::clamp<int64_t>(budget / 2 / state_bytes, 1, kMaxDefaultSlots));
      }
      budget = std::max<int64_t>(budget - (slots + snapshots_for(slots)) * state_bytes, 0);
    }
    ks.n_blocks = std::max(budget / ks.bytes_per_block(), ctx_blocks);
    if (opt.kv_cache_bytes > 0 && budget / ks.bytes_per_block() < ctx_blocks) {
      // Never less than one full context: say so, since the arena is then larger than the budget asked for.
      spdlog::warn(
          "kv cache: a budget of {} bytes holds {} blocks, less than one full context of {} tokens; using "
          "{} blocks ({:.1f} MiB)",
          opt.kv_cache_bytes, budget / ks.bytes_per_block(), m->max_ctx_, ctx_blocks,
          static_cast<double>(ctx_blocks * ks.bytes_per_block()) / (1 << 20));
    }
  } else {
    ks.n_blocks = ctx_blocks;
  }
  // One accounting: the arena's bytes per token are what the layer kinds declare they cache.
  if (spec.bytes_per_token != ks.bytes_per_token()) {
    return Internal("model: layers cache " + std::to_string(spec.bytes_per_token) +
                    " bytes per token but the KV arena holds " + std::to_string(ks.bytes_per_token()));
  }
  if (state_bytes != c.StateBytesPerSeq()) {
    return Internal("model: layers keep " + std::to_string(state_bytes) +
                    " bytes of state per sequence but the "
                    "config says " +
                    std::to_string(c.StateBytesPerSeq()));
  }
  m->layout_.tokens = ks;
  m->layout_.state_bytes_per_seq = state_bytes;
  m->layout_.state_slots = slots;
  m->layout_.snapshot_slots = snapshots_for(slots);
  // The slots are allocated and zeroed at start-up: refuse what this machine cannot hold (a file can declare
  // linear heads of any width) instead of failing the allocation.
  if (state_bytes > 0 && m->layout_.state_bytes() > MemAvailableBytes()) {
    return ResourceExhausted("model: " + std::to_string(slots + m->layout_.snapshot_slots) + " state slots of " +
                             std::to_string(state_bytes) +
                             " bytes exceed the available memory (lower --state-slots or "
                             "--kv-cache-bytes)");
  }
  if (state_bytes > 0) {
    spdlog::info("state: {} slots + {} prefix snapshots of {:.2f} MiB ({} Gated DeltaNet layers), {:.1f} MiB", slots,
                 m->layout_.snapshot_slots, static_cast<double>(state_bytes) / (1 << 20),
                 c.n_layers - c.n_attention_layers(), static_cast<double>(m->layout_.state_bytes()) / (1 << 20));
  }
  spdlog::info("kv cache: {} blocks of {} tokens = {} tokens, {:.1f} MiB ({} per token, {})", ks.n_blocks,
               ks.block_size, ks.n_blocks * ks.block_size, static_cast<double>(m->layout_.token_bytes()) / (1 << 20),
               ks.bytes_per_token(), DTypeName(ks.dtype));
  // Scratch for the largest batch.
  const int rows = m->rows_cap_;
  const int qkv_n = c.q_dim() * (c.attn_output_gate ? 2 : 1) + 2 * c.kv_dim();
  const size_t R = static_cast<size_t>(rows);
  m->x_.assign(R * c.hidden, 0);
  m->h_.assign(R * c.hidden, 0);
  if (!c.is_mla()) {  // the MLA layer kind holds its own (mla_attention.cc)
    m->qkv_.assign(R * qkv_n, 0);
    m->attn_.assign(R * c.q_dim(), 0);
  }
  m->tmp_.assign(R * c.hidden, 0);
  m->gu_.assign(R * 2 * c.ffn, 0);
  m->act_.assign(R * c.ffn, 0);
  m->logits_.assign(static_cast<size_t>(m->logit_rows_cap_) * c.vocab, 0);
  // Only layers on oneDNN's bf16 GEMM take bf16 input; the packed and AMX GEMMs read the f32 activations.
  if (m->rt_->any_bf16_input()) {
    int widest = std::max({c.hidden, c.q_dim(), c.ffn});
    for (const auto& l : m->layers_) l->ForEachLinear([&](const Linear& lin) { widest = std::max(widest, lin.k()); });
    m->in_lp_.assign(R * widest, 0);
  }
  size_t per_thread = 0;
  for (const auto& l : m->layers_)
    per_thread = std::max(per_thread, l->scratch_floats_per_thread(m->max_ctx_, opt.block_size));
  m->attn_scratch_stride_ = per_thread + 16;
  m->attn_scratch_.assign(m->attn_scratch_stride_ * opt.n_threads, 0);
  // Steps of one token run in one parallel region (Layer::ForwardTeam) when every layer and the LM head
  // can; QKV_TEAM_STEP=0 turns it off (to compare).
  const char* team = std::getenv("QKV_TEAM_STEP");
  m->team_step_ = !(team && std::strcmp(team, "0") == 0) && m->lm_head_->team_ready();
  size_t team_floats = static_cast<size_t>(PaddedRows(1)) * c.hidden;
  int widest_k = m->lm_head_->k();
  bool any_quant = m->lm_head_->quantized() != nullptr;
  for (const auto& l : m->layers_) {
    m->team_step_ = m->team_step_ && l->team_ready();
    team_floats = std::max(team_floats, l->team_floats());
    l->ForEachLinear([&](const Linear& lin) {
      widest_k = std::max(widest_k, lin.k());
      any_quant = any_quant || lin.quantized();
    });
  }
  if (m->team_step_) {
    m->team_stride_ = (team_floats + 15) / 16 * 16;
    m->team_rows_.assign(m->team_stride_ * opt.n_threads, 0);
    if (any_quant) m->rt_->ThreadQuantizedRowsFor(kOwnQuantRows, widest_k);  // each thread's own rows
    // Each thread's bf16 rows: oneDNN's bf16 GEMM and the packed GEMM's bf16 form (K padded to even) round
    // the step's rows for themselves.
    if (m->rt_->any_bf16_compute())
      m->rt_->ReserveOwnBf16(static_cast<size_t>(PaddedRows(kOwnQuantRows)) * (widest_k + 1));
  }
  spdlog::info("one-token steps: {}", m->team_step_ ? "one parallel region per step"
                                                    : "a parallel region per layer phase (not every layer kind or "
                                                      "GEMM has a team step, or QKV_TEAM_STEP=0)");
  m->tok_chunk_.resize(opt.max_batch_tokens);
  m->tok_pos_.resize(opt.max_batch_tokens);
  m->logit_src_.resize(m->logit_rows_cap_);
  return m;
}

Status Model::LoadWeights(const GgufFile& f) {
  const ModelConfig& c = cfg_;
  const auto H = static_cast<uint64_t>(c.hidden);
  const DType dt = opt_.weights_dtype;
  QKV_ASSIGN_OR_RETURN(final_norm_, ReadTensor(f, "output_norm.weight", {H}));
  const auto V = static_cast<uint64_t>(c.vocab);
  if (opt_.keep_quantized) {
    QKV_ASSIGN_OR_RETURN(embed_q_, ReadQuantized(f, "token_embd.weight", V, H, rt_->weights_arena()));
  }
  if (c.tied_embeddings && embed_q_) {
    QKV_ASSIGN_OR_RETURN(lm_head_, Linear::CreateQuantized(*rt_, embed_q_));
  } else {
    const std::string head = c.tied_embeddings ? "token_embd.weight" : "output.weight";
    QKV_ASSIGN_OR_RETURN(lm_head_,
                         MakeLinear(f, *rt_, dt, opt_.keep_quantized, {{head, V, 0, c.vocab}}, c.hidden, nullptr));
  }
  if (embed_q_) {
    if (!c.tied_embeddings) weight_bytes_ += embed_q_->bytes();
  } else {
    QKV_ASSIGN_OR_RETURN(std::vector<float> emb, ReadTensor(f, "token_embd.weight", {H, V}));
    if (dt == DType::kF32) {
      embed_f32_ = std::move(emb);
      weight_bytes_ += embed_f32_.size() * 4;
    } else {
      embed_bf16_.resize(emb.size());
      F32ToBf16Bulk(emb.data(), embed_bf16_.data(), static_cast<int64_t>(emb.size()));
      weight_bytes_ += embed_bf16_.size() * 2;
    }
  }
  weight_bytes_ += lm_head_->weight_bytes() + final_norm_.size() * 4;
  weight_bytes_per_token_ += lm_head_->weight_bytes();

  // The decoder stack, block by block, as the registered layer kinds the model's blocks are made of. Layers
  // that keep state get consecutive shares of a state slot.
  int64_t state_bytes = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    for (std::string_view name : ModelLayerKinds(c, l)) {
      QKV_ASSIGN_OR_RETURN(const LayerKind* kind, FindLayerKind(name));
      LayerInit in{f,
                   c,
                   l,
                   *rt_,
                   dt,
                   opt_.keep_quantized,
                   opt_.kv_dtype,
                   kind->caches_tokens ? kv_layers_++ : -1,
                   state_bytes,
                   rope_.get(),
                   rows_cap_,
                   &shared_scratch_};
      QKV_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer, kind->make(in));
      state_bytes += layer->cache().state_bytes_per_seq;
      weight_bytes_ += layer->weight_bytes();
      weight_bytes_per_token_ += layer->weight_bytes_per_token();
      layers_.push_back(std::move(layer));
    }
  }
  return {};
}

size_t Model::weight_memory_bytes() const { return weight_bytes_ + rt_->weights_arena()->slack_bytes(); }

size_t Model::weight_heap_bytes() const {
  return weight_bytes_ - std::min(weight_bytes_, rt_->weights_arena()->used_bytes());
}

size_t Model::scratch_bytes() const {
  size_t n = 0;
  for (const auto* v : {&x_, &h_, &qkv_, &attn_, &tmp_, &gu_, &act_, &logits_, &attn_scratch_, &team_rows_})
    n += v->capacity() * sizeof(float);
  n += in_lp_.capacity() * sizeof(uint16_t);
  for (const auto& l : layers_) n += l->scratch_bytes();
  return n + shared_scratch_.bytes() + rt_->scratch_bytes();
}

std::vector<std::pair<int, std::vector<uint64_t>>> Model::ExpertTokens() const {
  std::vector<std::pair<int, std::vector<uint64_t>>> out;
  const size_t per_block = cfg_.n_layers > 0 ? layers_.size() / static_cast<size_t>(cfg_.n_layers) : 1;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (const auto* t = layers_[i]->expert_tokens()) out.emplace_back(static_cast<int>(i / per_block), *t);
  }
  return out;
}

CacheSpec Model::cache_spec() const {
  CacheSpec total;
  for (const auto& l : layers_) {
    total.bytes_per_token += l->cache().bytes_per_token;
    total.state_bytes_per_seq += l->cache().state_bytes_per_seq;
  }
  return total;
}

std::string Model::weights_summary() const {
  std::set<std::string> q;
  bool expanded = !embed_f32_.empty() || !embed_bf16_.empty();
  auto note = [&](const Linear& l) {
    if (!l.quantized()) {
      expanded = true;
      return;
    }
    std::string t = l.quantized()->types();
    for (size_t a = 0, b; a <= t.size(); a = b + 1) {
      b = t.find('+', a);
      if (b == std::string::npos) b = t.size();
      q.insert(t.substr(a, b - a));
    }
  };
  note(*lm_head_);
  for (const auto& l : layers_) l->ForEachLinear(note);
  std::string s;
  for (const auto& t : q) s += (s.empty() ? "" : "+") + t;
  if (!s.empty()) s += " (quantized)";
  if (expanded) s += (s.empty() ? "" : " + ") + std::string(DTypeName(opt_.weights_dtype));
  return s;
}

DType Model::compute_dtype() const { return rt_->any_bf16_compute() ? DType::kBF16 : DType::kF32; }

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
  if (ch.all_logits && static_cast<int>(ch.tokens.size()) > logit_rows_cap_) {
    return InvalidArgument("forward: a chunk of " + std::to_string(ch.tokens.size()) +
                           " tokens wants logits for each, more than the " + std::to_string(logit_rows_cap_) +
                           " rows of max_logit_rows");
  }
  for (int t : ch.tokens) {
    if (t < 0 || t >= cfg_.vocab)
      return InvalidArgument("forward: token id " + std::to_string(t) + " out of vocabulary");
  }
  return {};
}

Status Model::Forward(std::span<const BatchChunk> batch, CacheStores& cache) {
  const ModelConfig& c = cfg_;
  const KvCacheShape& have = cache.layout().tokens;
  if (have.n_layers != layout_.tokens.n_layers || have.n_kv_heads != layout_.tokens.n_kv_heads ||
      have.head_dim != layout_.tokens.head_dim || have.value_dim() != layout_.tokens.value_dim() ||
      have.block_size != layout_.tokens.block_size || have.dtype != layout_.tokens.dtype ||
      cache.layout().state_bytes_per_seq != layout_.state_bytes_per_seq) {
    return InvalidArgument("forward: the cache stores were not made for this model's cache layout");
  }
  // Validate the whole batch before touching anything.
  int T = 0, wanted = 0;
  for (size_t ci = 0; ci < batch.size(); ++ci) {
    const BatchChunk& ch = batch[ci];
    if (!ch.seq || ch.tokens.empty()) return InvalidArgument("forward: empty chunk");
    for (size_t cj = 0; cj < ci; ++cj) {
      if (batch[cj].seq == ch.seq) return InvalidArgument("forward: a sequence appears twice in one batch");
    }
    QKV_RETURN_IF_ERROR(CheckChunk(ch));
    if (layout_.state_bytes_per_seq > 0 && !cache.states().in_use(ch.seq->state_slot)) {
      return FailedPrecondition("forward: the sequence holds no state slot");
    }
    if (T + static_cast<int>(ch.tokens.size()) > opt_.max_batch_tokens) {
      return InvalidArgument("forward: batch exceeds " + std::to_string(opt_.max_batch_tokens) + " tokens");
    }
    wanted += ch.all_logits ? static_cast<int>(ch.tokens.size()) : 1;
    if (wanted > logit_rows_cap_) {
      return InvalidArgument("forward: batch wants more than " + std::to_string(logit_rows_cap_) +
                             " rows of logits (max_logit_rows)");
    }
    for (size_t i = 0; i < ch.tokens.size(); ++i) {
      tok_chunk_[T] = static_cast<int>(ci);
      tok_pos_[T] = ch.seq->n_tokens + static_cast<int>(i);
      ++T;
    }
  }
  if (T == 0) return InvalidArgument("forward: empty batch");

  const int H = c.hidden;
  const float eps = static_cast<float>(c.rms_eps);
  PhaseTimer timer(profiling_);
  Profile& pf = profile_;
  // Embedding lookup.
  {
    int t = 0;
    for (const BatchChunk& ch : batch) {
      for (int id : ch.tokens) {
        float* dst = &x_[static_cast<size_t>(t++) * H];
        if (embed_q_) {
          embed_q_->DequantizeRow(id, dst);
        } else if (!embed_f32_.empty()) {
          std::memcpy(dst, &embed_f32_[static_cast<size_t>(id) * H], sizeof(float) * H);
        } else {
          Bf16ToF32Bulk(&embed_bf16_[static_cast<size_t>(id) * H], dst, H);
        }
      }
    }
  }
  timer.Mark(pf.embed);

  // The decoder stack: each layer adds its output to the residual stream x_.
  const StepRows rows_in{T, batch, tok_chunk_.data(), tok_pos_.data()};
  LayerScratch sc;
  sc.h = h_.data();
  sc.qkv = qkv_.data();
  sc.attn = attn_.data();
  sc.tmp = tmp_.data();
  sc.gu = gu_.data();
  sc.act = act_.data();
  sc.attn_per_thread = attn_scratch_.data();
  sc.attn_stride = attn_scratch_stride_;
  sc.bf16_in = in_lp_.data();
  sc.kv = &cache.tokens();
  sc.states = &cache.states();
  sc.n_threads = opt_.n_threads;
  sc.timer = &timer;
  sc.profile = &pf;
  if (T == 1 && team_step_) {
    // One token: the whole pass in one parallel region, each layer's phases separated by barriers.
    sc.team_rows = team_rows_.data();
    sc.team_stride = team_stride_;
    TeamBarrier barrier;
    sc.barrier = &barrier;
#pragma omp parallel num_threads(opt_.n_threads)
    {
      for (const auto& layer : layers_) layer->ForwardTeam(x_.data(), rows_in, sc);
      float* h = sc.TeamRows(omp_get_thread_num());
      RmsNorm(x_.data(), final_norm_.data(), h, H, eps);
      lm_head_->ForwardShare(h, 1, logits_.data(), [](int, int) {});
    }
    timer.Mark(pf.lm_head);
    logits_rows_ = 1;
    batch[0].seq->n_tokens += 1;
    return {};
  }
  for (const auto& layer : layers_) layer->Forward(x_.data(), rows_in, sc);

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
  sc.Gemm(*lm_head_, h_.data(), rows, logits_.data());
  timer.Mark(pf.lm_head);
  logits_rows_ = rows;
  for (const BatchChunk& ch : batch) ch.seq->n_tokens += static_cast<int>(ch.tokens.size());
  return {};
}

}  // namespace qkv
