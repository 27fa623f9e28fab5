#include "engine/model.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "engine/bf16.h"
#include "engine/block_manager.h"
#include "engine/gguf.h"
#include "engine/kernels/weights_arena.h"
#include "engine/random_model.h"
#include "engine/sampler.h"
#include "tests/test_util.h"

namespace qkv {
namespace {

// Tests drive Model::Forward directly, without a scheduler: cache stores and a block pool of their own per
// loaded model (a new model may reuse a freed one's address, so Load replaces the entry).
struct TestCache {
  std::unique_ptr<CacheStores> stores;
  std::unique_ptr<KvBlockPool> pool;
};
std::map<const Model*, TestCache>& Caches() {
  static std::map<const Model*, TestCache> caches;
  return caches;
}

KvBlockPool& PoolFor(Model& m) { return *Caches().at(&m).pool; }
CacheStores& CacheFor(Model& m) { return *Caches().at(&m).stores; }
// Blocks for n tokens and (for models that keep state) a state slot; the release gives both back.
Status ReserveAll(Model& m, SeqKv& seq, int n) {
  QKV_RETURN_IF_ERROR(ReserveBlocks(seq, n, m.options().block_size, PoolFor(m)));
  return ReserveStateSlot(seq, CacheFor(m).states());
}
void ReleaseAll(Model& m, SeqKv& seq) {
  ReleaseBlocks(seq, PoolFor(m));
  ReleaseStateSlot(seq, CacheFor(m).states());
}

std::unique_ptr<Model> Load(const std::string& path, DType w, DType kv, int batch = 256, int64_t blocks = 0,
                            int logit_rows = 0) {
  ModelOptions mo;
  mo.max_logit_rows = logit_rows;
  mo.weights_dtype = w;
  mo.kv_dtype = kv;
  mo.n_threads = 2;
  mo.max_batch_tokens = batch;
  mo.kv_blocks = blocks;
  auto m = Model::Load(path, mo);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (!m.ok()) return nullptr;
  auto stores = CacheStores::Create((*m)->cache_layout());
  EXPECT_TRUE(stores.ok()) << stores.status().ToString();
  if (!stores.ok()) return nullptr;
  Caches()[m->get()] = {std::move(*stores),
                        std::make_unique<KvBlockPool>((*m)->cache_layout().tokens.n_blocks, mo.block_size)};
  return std::move(*m);
}

// Appends tokens to seq in chunks of `chunk`; returns the logits of every position (all_logits) or the last.
std::vector<float> Feed(Model& m, SeqKv& seq, const std::vector<int>& tokens, bool all, int chunk = 1 << 30) {
  EXPECT_TRUE(ReserveAll(m, seq, seq.n_tokens + static_cast<int>(tokens.size())).ok());
  std::vector<float> out;
  const int V = m.config().vocab;
  for (size_t i = 0; i < tokens.size(); i += chunk) {
    const size_t n = std::min<size_t>(chunk, tokens.size() - i);
    BatchChunk ch{&seq, std::span<const int>(tokens.data() + i, n), all};
    const Status s = m.Forward(std::span<const BatchChunk>(&ch, 1), CacheFor(m));
    EXPECT_TRUE(s.ok()) << s.ToString();
    if (all || i + n == tokens.size())
      out.insert(out.end(), m.logits(), m.logits() + static_cast<size_t>(m.logits_rows()) * V);
  }
  return out;
}

std::vector<int> Prompt(int n, int vocab, int salt = 0) {
  std::vector<int> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + 11 + salt * 101) % vocab);
  return t;
}

class ModelArchTest : public ::testing::TestWithParam<Arch> {};
void CacheMatchesRecompute(Arch arch, DType kv);

// Decoding with the KV cache gives the same 64 greedy tokens as recomputing the whole prefix each step,
// and logits within 1e-5 (f32 weights; f32 KV, and int8 KV, which quantizes the same K/V the same way).
TEST_P(ModelArchTest, CacheMatchesRecompute) {
  for (DType kv : {DType::kF32, DType::kI8}) CacheMatchesRecompute(GetParam(), kv);
}

void CacheMatchesRecompute(Arch arch, DType kv) {
  SCOPED_TRACE(DTypeName(kv));
  ModelConfig cfg = testing::SmallConfig(arch);
  const auto path = testing::WriteModel(cfg, std::string("cache_") + ArchName(arch));
  auto m = Load(path, DType::kF32, kv, 256, 64);
  ASSERT_TRUE(m);
  const int V = cfg.vocab;
  std::vector<int> prompt = Prompt(20, V);
  SeqKv cached;
  std::vector<float> lc = Feed(*m, cached, prompt, false);
  std::vector<int> toks = prompt;
  double max_diff = 0;
  for (int step = 0; step < 64; ++step) {
    SeqKv fresh;
    std::vector<float> lf = Feed(*m, fresh, toks, false);
    ReleaseAll(*m, fresh);
    for (int i = 0; i < V; ++i) max_diff = std::max(max_diff, static_cast<double>(std::fabs(lc[i] - lf[i])));
    const int a = ArgMax(lc.data(), V), b = ArgMax(lf.data(), V);
    ASSERT_EQ(a, b) << "step " << step;
    toks.push_back(a);
    lc = Feed(*m, cached, {a}, false);
  }
  EXPECT_LE(max_diff, 1e-5);
}

// Changing a later prompt token never changes an earlier position's logits (bit for bit).
TEST_P(ModelArchTest, Causality) {
  ModelConfig cfg = testing::SmallConfig(GetParam());
  cfg.attention_sinks = GetParam() != Arch::kQwen35 && GetParam() != Arch::kDeepseek2;  // (not part of those)
  const auto path = testing::WriteModel(cfg, std::string("causal_") + ArchName(GetParam()));
  auto m = Load(path, DType::kBF16, DType::kBF16);
  ASSERT_TRUE(m);
  const int V = cfg.vocab;
  std::vector<int> a = Prompt(30, V), b = a;
  b[20] = (b[20] + 1) % V;
  b[29] = (b[29] + 5) % V;
  SeqKv sa, sb;
  auto la = Feed(*m, sa, a, true);
  ReleaseAll(*m, sa);
  auto lb = Feed(*m, sb, b, true);
  EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), sizeof(float) * 20 * V));
  EXPECT_NE(0, std::memcmp(la.data() + 20 * V, lb.data() + 20 * V, sizeof(float) * V));
}

// The logits of a prompt do not depend on how it is chunked into forward passes, nor on what other
// sequences share the batch (bit for bit): the basis of batch invariance.
// A 150-token prompt gives the same logits, bit for bit, whole, in chunks of 1, 7 and 64, and in batches
// beside other sequences of other lengths.
void CheckChunkingAndBatches(Model& m, const std::string& what) {
  const int V = m.config().vocab;
  std::vector<int> p = Prompt(150, V);
  SeqKv s1;
  auto whole = Feed(m, s1, p, true);
  ReleaseAll(m, s1);
  for (int chunk : {1, 7, 64}) {
    SeqKv s2;
    auto parts = Feed(m, s2, p, true, chunk);
    ReleaseAll(m, s2);
    ASSERT_EQ(whole.size(), parts.size());
    EXPECT_EQ(0, std::memcmp(whole.data(), parts.data(), whole.size() * sizeof(float))) << what << " chunk " << chunk;
  }
  // The same prompt in a batch with two other sequences of different lengths.
  SeqKv x, y, z;
  std::vector<int> px = Prompt(33, V, 1), pz = Prompt(5, V, 2);
  ASSERT_TRUE(ReserveAll(m, x, 33).ok());
  ASSERT_TRUE(ReserveAll(m, y, 150).ok());
  ASSERT_TRUE(ReserveAll(m, z, 5).ok());
  BatchChunk b[3] = {{&x, px, false}, {&y, std::span<const int>(p.data(), 100), true}, {&z, pz, true}};
  ASSERT_TRUE(m.Forward(b, CacheFor(m)).ok());
  std::vector<float> got(m.logits() + V, m.logits() + 101 * static_cast<size_t>(V));
  BatchChunk b2[2] = {{&z, std::span<const int>(pz.data(), 1), false},
                      {&y, std::span<const int>(p.data() + 100, 50), true}};
  ASSERT_TRUE(m.Forward(b2, CacheFor(m)).ok());
  got.insert(got.end(), m.logits() + V, m.logits() + 51 * static_cast<size_t>(V));
  ASSERT_EQ(got.size(), whole.size());
  EXPECT_EQ(0, std::memcmp(whole.data(), got.data(), whole.size() * sizeof(float))) << what;
  ReleaseAll(m, x);
  ReleaseAll(m, y);
  ReleaseAll(m, z);
}

TEST_P(ModelArchTest, ChunkingAndBatchCompositionDoNotChangeBits) {
  ModelConfig cfg = testing::SmallConfig(GetParam());
  const auto path = testing::WriteModel(cfg, std::string("chunk_") + ArchName(GetParam()));
  for (DType dt : {DType::kF32, DType::kBF16}) {
    auto m = Load(path, dt, dt, 256, 64);
    ASSERT_TRUE(m);
    CheckChunkingAndBatches(*m, DTypeName(dt));
  }
  for (DType dt : {DType::kF32, DType::kBF16}) {  // an int8 KV cache under either weights dtype
    auto m = Load(path, dt, DType::kI8, 256, 64);
    ASSERT_TRUE(m);
    CheckChunkingAndBatches(*m, std::string(DTypeName(dt)) + " weights, int8 KV");
  }
}

// The same on weights kept quantized: Q8_0 on the small shape, and Q4_K_M (Q4_K, Q6_K, Q5_0 fallbacks
// where rows are not whole super-blocks) on a shape with 256-wide rows.
TEST_P(ModelArchTest, QuantizedWeightsKeepTheSameBits) {
  for (const char* preset : {"Q8_0", "Q4_K_M"}) {
    ModelConfig cfg = testing::SmallConfig(GetParam());
    if (std::string(preset) == "Q4_K_M") cfg.hidden = 256, cfg.ffn = 512, cfg.head_dim = 32, cfg.rotary_dim = 32;
    if (cfg.moe.n_experts > 0 && std::string(preset) == "Q4_K_M") cfg.moe.expert_ffn = 256;
    if (cfg.is_mla() && std::string(preset) == "Q4_K_M") {  // 256-wide latent and query rows
      cfg.mla.kv_lora_rank = 64, cfg.mla.q_lora_rank = 256, cfg.head_dim = 64 + 32, cfg.mla.qk_nope_dim = 32;
    }
    const std::string path = testing::TempDir() + "/quant_" + preset + "_" + ArchName(GetParam()) + ".gguf";
    ASSERT_TRUE(WriteRandomModel(cfg, {GgmlType::kF32, 1, preset, {}}, path).ok());
    auto m = Load(path, DType::kBF16, DType::kBF16, 256, 64);
    ASSERT_TRUE(m);
    EXPECT_NE(m->weights_summary().find("(quantized)"), std::string::npos) << m->weights_summary();
    CheckChunkingAndBatches(*m, preset);
  }
}

// deepseek2 with routed experts after a leading dense block, shared experts, sigmoid gating, the selection
// bias and group-limited routing (DeepSeek-V3's router): chunking and batch composition keep the bits.
TEST(Model, DeepseekExpertsKeepTheSameBits) {
  ModelConfig cfg = testing::SmallConfig(Arch::kDeepseek2);
  cfg.n_layers = 3;
  cfg.n_dense_lead = 1;
  cfg.moe = {/*n_experts=*/8,       /*n_used=*/2,           /*expert_ffn=*/32,
             /*n_shared=*/1,        ExpertGating::kSigmoid,
             /*norm_weights=*/true, /*weights_scale=*/2.5,  /*n_groups=*/4,
             /*n_group_used=*/2,    /*selection_bias=*/true};
  const auto path = testing::WriteModel(cfg, "ds3_moe");
  for (DType dt : {DType::kF32, DType::kBF16}) {
    auto m = Load(path, dt, dt, 256, 64);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->layers()[3]->kind(), "moe_swiglu");
    EXPECT_EQ(m->layers()[1]->kind(), "dense_swiglu");
    CheckChunkingAndBatches(*m, DTypeName(dt));
  }
}

// Experts on quantized weights run fused in one OpenMP region (moe_swiglu.cc); QKV_MOE_FUSED=0 runs each
// expert's GEMMs through Linear::Forward. Both give the same bits: a 24-token prefill (72 slots: experts split
// one by one; several tokens per expert, tiles of 8, 4, 2 and 1 rows over routed rows), then 4 decoded tokens
// and a 7-token step (3 and 21 slots: the active experts spread over the threads), on qwen3moe and on
// deepseek2 with shared experts and group-limited sigmoid routing.
TEST(Model, FusedQuantizedExpertsKeepThePerExpertBits) {
  for (Arch arch : {Arch::kQwen3Moe, Arch::kDeepseek2}) {
    for (const char* preset : {"Q8_0", "Q4_K_M"}) {
      SCOPED_TRACE(std::string(ArchName(arch)) + " " + preset);
      ModelConfig cfg = testing::SmallConfig(arch);
      cfg.moe.n_experts = 8, cfg.moe.n_used = 3, cfg.moe.expert_ffn = 64;
      if (arch == Arch::kDeepseek2) {
        cfg.n_layers = 2, cfg.n_dense_lead = 1, cfg.moe.n_shared = 1, cfg.moe.gating = ExpertGating::kSigmoid;
        cfg.moe.norm_weights = true, cfg.moe.weights_scale = 2.5, cfg.moe.n_groups = 4, cfg.moe.n_group_used = 2;
        cfg.moe.selection_bias = true;
      }
      if (std::string(preset) == "Q4_K_M") {
        cfg.hidden = 256, cfg.ffn = 512, cfg.head_dim = 32, cfg.rotary_dim = 32, cfg.moe.expert_ffn = 256;
        if (cfg.is_mla())
          cfg.mla.kv_lora_rank = 64, cfg.mla.q_lora_rank = 256, cfg.head_dim = 96, cfg.mla.qk_nope_dim = 32;
      }
      const std::string path = testing::TempDir() + "/fused_" + preset + "_" + ArchName(arch) + ".gguf";
      ASSERT_TRUE(WriteRandomModel(cfg, {GgmlType::kF32, 1, preset, {}}, path).ok());
      std::vector<float> out[2];
      for (int fused = 0; fused < 2; ++fused) {
        if (fused == 0) setenv("QKV_MOE_FUSED", "0", 1);
        auto m = Load(path, DType::kBF16, DType::kBF16, 256, 64);
        unsetenv("QKV_MOE_FUSED");
        ASSERT_TRUE(m);
        SeqKv seq;
        out[fused] = Feed(*m, seq, Prompt(24, cfg.vocab), true);
        for (int step = 0; step < 4; ++step) {
          const int next = ArgMax(&out[fused][out[fused].size() - cfg.vocab], cfg.vocab);
          const std::vector<float> l = Feed(*m, seq, {next}, false);
          out[fused].insert(out[fused].end(), l.begin(), l.end());
        }
        // A step of 7 tokens: 21 slots, spread over the threads (ExpertsSpread) with several rows per expert.
        const std::vector<float> l = Feed(*m, seq, Prompt(7, cfg.vocab), true);
        out[fused].insert(out[fused].end(), l.begin(), l.end());
        ReleaseAll(*m, seq);
      }
      ASSERT_EQ(out[0].size(), out[1].size());
      EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)), 0);
    }
  }
}

// A step of one token runs in one parallel region (Layer::ForwardTeam) where every layer and the LM head
// can, and gives the bits of the per-layer regions (QKV_TEAM_STEP=0): attention with sinks, q/k norms and the
// output gate, dense and fused quantized experts, quantized / oneDNN f32 / packed GEMMs, bf16 and int8 caches;
// MLA with and without the low-rank query path, deepseek2's shared experts beside routed ones (fused quantized
// and f32) after a leading dense layer; Gated DeltaNet layers beside gated attention, decoding across a
// committed chunk of their state (position 31). Fused quantized experts with 2 or 4 experts a token give
// each of the 2 threads whole experts (the cut of the experts' columns falls on an expert's edge); 3 split one.
TEST(Model, OneTokenStepsInOneRegionKeepTheBits) {
  struct Case {
    Arch arch;
    const char* preset;  // nullptr: f32 weights
    const char* gemm;    // QKV_GEMM
    int n_used = 3;      // experts per token: 3 splits experts between 2 threads, 2 and 4 give each whole ones
  };
  for (const Case& k : {Case{Arch::kQwen3, "Q8_0", "auto"}, Case{Arch::kQwen2, "Q4_K_M", "auto"},
                        Case{Arch::kQwen3Moe, "Q4_K_M", "auto"}, Case{Arch::kQwen3Moe, "Q4_K_M", "auto", 4},
                        Case{Arch::kQwen3Moe, nullptr, "auto"}, Case{Arch::kLlama, nullptr, "auto"},
                        Case{Arch::kLlama, nullptr, "packed"}, Case{Arch::kDeepseek2, "Q4_K_M", "auto"},
                        Case{Arch::kDeepseek2, "Q4_K_M", "auto", 2}, Case{Arch::kDeepseek2, nullptr, "auto"},
                        Case{Arch::kQwen35, "Q8_0", "auto"}, Case{Arch::kQwen35, nullptr, "auto"}}) {
    for (DType kv : {DType::kBF16, DType::kI8}) {
      SCOPED_TRACE(std::string(ArchName(k.arch)) + " " + (k.preset ? k.preset : "f32") + " " + k.gemm + " kv " +
                   DTypeName(kv) + " experts " + std::to_string(k.n_used));
      ModelConfig cfg = testing::SmallConfig(k.arch);
      cfg.attention_sinks = k.arch != Arch::kQwen35;  // (qwen35 has none; deepseek2's below)
      if (k.arch == Arch::kQwen3) cfg.attn_output_gate = true;
      if (k.preset) cfg.hidden = 256, cfg.ffn = 512, cfg.head_dim = 32, cfg.rotary_dim = 32;
      if (k.arch == Arch::kQwen3Moe) cfg.moe.n_experts = 8, cfg.moe.n_used = k.n_used, cfg.moe.expert_ffn = 256;
      if (k.arch == Arch::kQwen35) cfg.recurrent = {true, false, true}, cfg.n_layers = 3;
      if (k.arch == Arch::kQwen35 && k.preset) cfg.linear.k_dim = 32, cfg.linear.v_dim = 32;
      if (k.arch == Arch::kDeepseek2) {
        cfg.attention_sinks = false;
        cfg.n_layers = 3, cfg.n_dense_lead = 1;
        cfg.moe = {8, k.n_used, k.preset ? 256 : 32, /*n_shared=*/1, ExpertGating::kSigmoid, true, 2.5, 4, 2, true};
        if (k.preset) {
          cfg.mla.kv_lora_rank = 64, cfg.mla.q_lora_rank = 256, cfg.head_dim = 96, cfg.mla.qk_nope_dim = 32;
        } else {
          cfg.mla.q_lora_rank = 0;  // queries straight from the first GEMM (llama.cpp: only at 26 or 27 layers)
          cfg.n_layers = 27;
        }
      }
      const std::string path = testing::TempDir() + "/team_" + ArchName(k.arch) + (k.preset ? k.preset : "") + "_" +
                               std::to_string(k.n_used) + ".gguf";
      RandomModelOptions ro;
      if (k.preset) ro.preset = k.preset;
      ASSERT_TRUE(WriteRandomModel(cfg, ro, path).ok());
      setenv("QKV_GEMM", k.gemm, 1);
      std::vector<float> out[2];
      for (int team = 0; team < 2; ++team) {
        if (team == 0) setenv("QKV_TEAM_STEP", "0", 1);
        auto m = Load(path, DType::kF32, kv, 256, 64);
        unsetenv("QKV_TEAM_STEP");
        ASSERT_TRUE(m);
        EXPECT_EQ(m->team_step(), team == 1);
        SeqKv seq;
        out[team] = Feed(*m, seq, Prompt(21, cfg.vocab), true);
        for (int step = 0; step < 12; ++step) {  // past a 16-token block and position 31
          const int next = ArgMax(&out[team][out[team].size() - cfg.vocab], cfg.vocab);
          const std::vector<float> l = Feed(*m, seq, {next}, false);
          out[team].insert(out[team].end(), l.begin(), l.end());
        }
        ReleaseAll(*m, seq);
      }
      unsetenv("QKV_GEMM");
      ASSERT_EQ(out[0].size(), out[1].size());
      EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, ModelArchTest,
                         ::testing::Values(Arch::kLlama, Arch::kQwen2, Arch::kQwen3, Arch::kDeepseek2, Arch::kQwen3Moe,
                                           Arch::kQwen35),
                         [](const auto& info) { return std::string(ArchName(info.param)); });

// V is never rotated: in layer 0 the value of a token depends only on the token, so the same token at
// every position stores the same V row, while its K rows (rotated) differ.
// The decoder stack is made of registered layer kinds, and the KV arena holds exactly what they declare.
TEST(Model, LayerKindsAndOneCacheAccounting) {
  std::set<std::string_view> names;
  for (const LayerKind& k : LayerKinds()) EXPECT_TRUE(names.insert(k.name).second) << "duplicate kind " << k.name;
  const ModelConfig cfg = testing::SmallConfig(Arch::kQwen2);
  auto m = Load(testing::WriteModel(cfg, "kinds_model", 4), DType::kBF16, DType::kF32);
  ASSERT_TRUE(m);
  ASSERT_EQ(m->layers().size(), static_cast<size_t>(2 * cfg.n_layers));
  for (size_t i = 0; i < m->layers().size(); ++i) {
    EXPECT_EQ(m->layers()[i]->kind(), i % 2 == 0 ? "gqa_attention" : "dense_swiglu");
    EXPECT_TRUE(names.count(m->layers()[i]->kind()));
  }
  const CacheSpec spec = m->cache_spec();
  EXPECT_EQ(spec.bytes_per_token, int64_t{cfg.n_layers} * 2 * cfg.n_kv_heads * cfg.head_dim * 4);  // f32 KV
  EXPECT_EQ(spec.bytes_per_token, m->cache_layout().tokens.bytes_per_token());
  EXPECT_EQ(spec.state_bytes_per_seq, 0);
  EXPECT_EQ(FindLayerKind("no_such_kind").status().code(), StatusCode::kInternal);
}

// qwen35: Gated DeltaNet layers keep only per-sequence state (no K/V per token), the attention layers get the
// arena's layers in order, and the state slots share the KV budget (up to half of it) unless a count is given.
TEST(Model, HybridLayerKindsStateAndBudget) {
  ModelConfig cfg = testing::SmallConfig(Arch::kQwen35);
  cfg.n_layers = 4;
  cfg.recurrent = {true, true, false, true};
  const std::string path = testing::WriteModel(cfg, "hybrid_kinds", 4);
  auto m = Load(path, DType::kBF16, DType::kBF16);
  ASSERT_TRUE(m);
  const char* kinds[] = {"gated_deltanet", "gated_deltanet", "gqa_attention", "gated_deltanet"};
  for (int l = 0; l < 4; ++l) EXPECT_EQ(m->layers()[2 * l]->kind(), kinds[l]);
  const CacheSpec spec = m->cache_spec();
  EXPECT_EQ(spec.bytes_per_token, int64_t{2} * cfg.n_kv_heads * cfg.head_dim * 2);  // one attention layer, bf16
  EXPECT_EQ(m->cache_layout().tokens.n_layers, 1);
  EXPECT_EQ(spec.state_bytes_per_seq, 3 * cfg.linear.state_bytes());
  EXPECT_EQ(spec.state_bytes_per_seq, cfg.StateBytesPerSeq());
  const int64_t S = spec.state_bytes_per_seq;
  for (int64_t budget : {int64_t{1} << 20, 10 * S, S}) {
    ModelOptions mo;
    mo.kv_cache_bytes = budget;
    auto b = Model::Load(path, mo);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const CacheLayout& l = (*b)->cache_layout();
    EXPECT_EQ(l.state_slots, std::clamp<int64_t>(budget / 2 / S, 1, 64)) << budget;
    const int64_t ctx_bytes = (*b)->max_context() * l.tokens.bytes_per_token();
    EXPECT_LE(l.token_bytes(), std::max(budget - l.state_bytes(), ctx_bytes + l.tokens.bytes_per_block())) << budget;
    mo.state_slots = 3;
    auto c = Model::Load(path, mo);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ((*c)->cache_layout().state_slots, 3);
  }
}

// A byte budget below one full context still gets one full context (a sequence must fit), and the start-up
// log says so: the arena is then larger than what the operator asked for.
TEST(Model, KvBudgetBelowOneContextIsRaisedAndLogged) {
  const ModelConfig cfg = testing::SmallConfig(Arch::kQwen3);
  const std::string path = testing::WriteModel(cfg, "kv_budget", 5);
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_st>(log);
  auto& sinks = spdlog::default_logger()->sinks();
  sinks.push_back(sink);
  const auto level = spdlog::get_level();
  spdlog::set_level(spdlog::level::info);
  // Restored however the test leaves (an ASSERT returns early): no later test may log into `log`.
  struct Restore {
    std::vector<spdlog::sink_ptr>& sinks;
    spdlog::level::level_enum level;
    ~Restore() {
      spdlog::set_level(level);
      sinks.pop_back();
    }
  } restore{sinks, level};
  for (const int64_t budget : {int64_t{1}, int64_t{1} << 30}) {
    log.str("");
    ModelOptions mo;
    mo.kv_cache_bytes = budget;
    auto m = Model::Load(path, mo);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const CacheLayout& l = (*m)->cache_layout();
    const int64_t ctx_blocks = ((*m)->max_context() + l.tokens.block_size - 1) / l.tokens.block_size;
    const bool raised = log.str().find("less than one full context") != std::string::npos;
    if (budget == 1) {
      EXPECT_EQ(l.tokens.n_blocks, ctx_blocks);
      EXPECT_TRUE(raised) << log.str();
    } else {
      EXPECT_GT(l.tokens.n_blocks, ctx_blocks);
      EXPECT_FALSE(raised) << log.str();
    }
  }
}

// Hugging Face Qwen3.5 names: layer_types or full_attention_interval, the linear head counts and widths; the
// GGUF keys llama.cpp reads round-trip (an interval when the pattern is one, else per-layer flags), and bad
// shapes are refused naming the field.
TEST(Model, Qwen35ConfigFromHfAndGguf) {
  const std::string base =
      R"("hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 32, "intermediate_size": 96, "vocab_size": 300, "linear_conv_kernel_dim": 4,
         "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_num_key_heads": 2)";
  auto a = ModelConfig::FromHfJson("{" + base + R"(, "linear_num_value_heads": 4, "full_attention_interval": 2})",
                                   Arch::kQwen35);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->recurrent, (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(a->rotary_dim, 8);  // partial_rotary_factor 0.25 by default
  EXPECT_TRUE(a->attn_output_gate && a->qk_norm);
  EXPECT_EQ(a->KvBytesPerToken(2), 2 * 2 * 1 * 32 * 2);
  auto b = ModelConfig::FromHfJson(
      "{" + base +
          R"(, "linear_num_value_heads": 6, "layer_types": ["full_attention", "linear_attention", "linear_attention",
             "full_attention"]})",
      Arch::kQwen35);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  for (const ModelConfig& c : {*a, *b}) {
    const std::string path = testing::WriteModel(c, "qwen35_cfg_" + std::to_string(c.linear.n_v_heads));
    auto f = GgufFile::Open(path);
    ASSERT_TRUE(f.ok());
    auto back = ModelConfig::FromGguf(**f);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->recurrent, c.recurrent);
    EXPECT_EQ(back->linear.n_v_heads, c.linear.n_v_heads);
    EXPECT_EQ(back->linear.v_dim, c.linear.v_dim);
    EXPECT_EQ(back->StateBytesPerSeq(), c.StateBytesPerSeq());
    EXPECT_EQ((*f)->Find("qwen35.full_attention_interval") != nullptr, c.linear.n_v_heads == 4);
    EXPECT_EQ((*f)->Find("qwen35.attention.recurrent_layers") != nullptr, c.linear.n_v_heads == 6);
  }
  auto bad = [&](const std::string& extra, const std::string& field) {
    auto c = ModelConfig::FromHfJson("{" + base + extra + "}", Arch::kQwen35);
    ASSERT_FALSE(c.ok()) << extra;
    EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status().message();
  };
  bad(R"(, "linear_num_value_heads": 3)", "linear_num_value_heads");
  bad(R"(, "linear_num_value_heads": 4, "layer_types": ["linear_attention"])", "layer_types");
  bad(R"(, "linear_num_value_heads": 4, "full_attention_interval": 5)", "full_attention");
}

TEST(Model, ValuesAreNotRotated) {
  ModelConfig cfg = testing::SmallConfig();
  const auto path = testing::WriteModel(cfg, "vrot");
  auto m = Load(path, DType::kF32, DType::kF32);
  ASSERT_TRUE(m);
  SeqKv s;
  Feed(*m, s, std::vector<int>(20, 42), false);
  const KvCache& kv = CacheFor(*m).tokens();
  const int bs = m->options().block_size, hd = cfg.head_dim;
  // V rows are [slot][head_dim]; K is stored transposed per block ([head_dim][slot]).
  auto row = [&](bool k, int pos) {
    const int block = s.blocks[pos / bs], slot = pos % bs;
    const float* base = reinterpret_cast<const float*>(k ? kv.K(0, block, 1) : kv.V(0, block, 1));
    std::vector<float> r(hd);
    for (int d = 0; d < hd; ++d) r[d] = k ? base[d * bs + slot] : base[slot * hd + d];
    return r;
  };
  for (int p = 1; p < 20; ++p) {
    EXPECT_EQ(row(false, 0), row(false, p)) << "V at position " << p;
    EXPECT_NE(row(true, 0), row(true, p)) << "K at position " << p;
  }
}

// Scratch is held once per model (SharedScratch), not once per layer: a model with 6 layers of a kind reports
// the scratch of one with 2 — MoE (the fused quantized path's buffers and the bf16 one's), MLA and Gated
// DeltaNet, quantized and not (each case fails with per-layer buffers).
TEST(Model, LayersShareTheirScratch) {
  struct Case {
    Arch arch;
    const char* preset;  // nullptr: bf16
  };
  for (const Case& k : {Case{Arch::kQwen3Moe, "Q4_K_M"}, Case{Arch::kQwen3Moe, nullptr}, Case{Arch::kDeepseek2, "Q8_0"},
                        Case{Arch::kDeepseek2, nullptr}, Case{Arch::kQwen35, "Q8_0"}, Case{Arch::kQwen35, nullptr}}) {
    size_t scratch[2] = {};
    for (int i = 0; i < 2; ++i) {
      ModelConfig cfg = testing::SmallConfig(k.arch);
      cfg.n_layers = i == 0 ? 2 : 6;
      if (k.arch == Arch::kQwen3Moe) {
        cfg.hidden = 256, cfg.head_dim = 32, cfg.rotary_dim = 32;
        cfg.moe.n_experts = 8, cfg.moe.n_used = 3, cfg.moe.expert_ffn = 256;
      }
      if (k.arch == Arch::kDeepseek2) cfg.n_dense_lead = cfg.n_layers;
      if (k.arch == Arch::kQwen35) {
        cfg.recurrent =
            i == 0 ? std::vector<bool>{true, false} : std::vector<bool>{true, true, false, true, true, false};
      }
      RandomModelOptions ro;
      if (k.preset) ro.preset = k.preset;
      const std::string path = testing::TempDir() + "/scratch_" + std::string(ArchName(k.arch)) + "_" +
                               (k.preset ? k.preset : "bf16") + "_" + std::to_string(cfg.n_layers) + ".gguf";
      ASSERT_TRUE(WriteRandomModel(cfg, ro, path).ok());
      auto m = Load(path, DType::kBF16, DType::kBF16, 256, 64);
      ASSERT_TRUE(m);
      scratch[i] = m->scratch_bytes();
    }
    EXPECT_GT(scratch[0], 0u);
    EXPECT_EQ(scratch[0], scratch[1]) << ArchName(k.arch) << " " << (k.preset ? k.preset : "bf16");
  }
}

// A model's GEMM weights live in its arena, in regions advised for huge pages, quantized or bf16; the
// weights' memory counts the arena's slack (less than a huge page here: GEMMs tried and dropped at load give
// their space back).
TEST(Model, WeightsLiveInTheHugePageArena) {
  ModelConfig cfg = testing::SmallConfig(Arch::kQwen3Moe);
  cfg.hidden = 256, cfg.head_dim = 32, cfg.rotary_dim = 32;
  cfg.moe.n_experts = 8, cfg.moe.n_used = 3, cfg.moe.expert_ffn = 256;
  for (const char* preset : {"Q4_K_M", static_cast<const char*>(nullptr)}) {
    RandomModelOptions ro;
    if (preset) ro.preset = preset;
    const std::string path = testing::TempDir() + "/arena_" + (preset ? preset : "bf16") + ".gguf";
    ASSERT_TRUE(WriteRandomModel(cfg, ro, path).ok());
    auto m = Load(path, DType::kBF16, DType::kBF16, 256, 64);
    ASSERT_TRUE(m);
    const WeightsArena& arena = *m->gemm().weights_arena();
    if (preset) {  // everything but the norms (f32, a few KB) is quantized here
      EXPECT_GT(arena.used_bytes(), m->weight_bytes() * 95 / 100);
    } else {  // the GEMMs' bf16 weights are in the arena, the embedding rows on the heap
      EXPECT_GT(arena.used_bytes(), 0u);
      EXPECT_GE(m->weight_heap_bytes(), static_cast<size_t>(cfg.vocab) * cfg.hidden * 2);
    }
    EXPECT_EQ(m->weight_heap_bytes(), m->weight_bytes() - arena.used_bytes());
    EXPECT_EQ(m->weight_memory_bytes(), m->weight_bytes() + arena.held_bytes() - arena.used_bytes());
    EXPECT_LT(m->weight_memory_bytes() - m->weight_bytes(), WeightsArena::kHugePage);
    const std::vector<const uint8_t*> regions = arena.RegionStarts();
    ASSERT_FALSE(regions.empty());
    for (const uint8_t* r : regions) {
      const std::string flags = testing::VmFlagsOf(r);
      if (ThpMode() != "unavailable") {
        EXPECT_NE(flags.find(" hg"), std::string::npos) << flags;
      }
    }
  }
}

// The logits buffer holds max_logit_rows rows (not max_batch_tokens): the rows it has give the bits of the
// uncapped model, and a batch that wants more rows (an all-logits chunk longer than the cap, more chunks than
// rows) is refused with InvalidArgument naming the option, before anything is computed.
TEST(Model, LogitRowsAreCapped) {
  const ModelConfig cfg = testing::SmallConfig(Arch::kLlama);
  const auto path = testing::WriteModel(cfg, "logit_rows");
  auto full = Load(path, DType::kF32, DType::kF32, 64, 64);
  auto capped = Load(path, DType::kF32, DType::kF32, 64, 64, /*logit_rows=*/4);
  ASSERT_TRUE(full && capped);
  EXPECT_EQ(capped->max_logit_rows(), 4);
  EXPECT_EQ(full->max_logit_rows(), 64);
  EXPECT_EQ(full->scratch_bytes() - capped->scratch_bytes(), sizeof(float) * 60 * cfg.vocab);
  const std::vector<int> p = Prompt(12, cfg.vocab);
  SeqKv a, b;
  const std::vector<float> want = Feed(*full, a, p, true);
  ASSERT_TRUE(ReserveAll(*capped, b, 12).ok());
  {  // 5 rows wanted of 4: refused, and the sequence is untouched
    BatchChunk ch{&b, std::span<const int>(p.data(), 5), true};
    const Status st = capped->Forward(std::span<const BatchChunk>(&ch, 1), CacheFor(*capped));
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("max_logit_rows"), std::string::npos) << st.message();
    EXPECT_EQ(b.n_tokens, 0);
  }
  const std::vector<float> got = Feed(*capped, b, p, true, 4);
  EXPECT_EQ(got, want);
  {  // five sequences of one token each: five rows
    std::vector<SeqKv> seqs(5);
    std::vector<BatchChunk> batch;
    for (SeqKv& s : seqs) {
      ASSERT_TRUE(ReserveAll(*capped, s, 1).ok());
      batch.push_back({&s, std::span<const int>(p.data(), 1), false});
    }
    const Status st = capped->Forward(batch, CacheFor(*capped));
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("max_logit_rows"), std::string::npos) << st.message();
    batch.pop_back();
    EXPECT_TRUE(capped->Forward(batch, CacheFor(*capped)).ok());
    for (SeqKv& s : seqs) ReleaseAll(*capped, s);
  }
  ReleaseAll(*full, a);
  ReleaseAll(*capped, b);
  ModelOptions mo;
  mo.max_batch_tokens = 64;
  mo.max_logit_rows = 65;
  const auto bad = Model::Load(path, mo);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("max logit rows"), std::string::npos);
}

// A quantized tensor whose block scale is not finite is refused at load with DataLoss naming the tensor, kept
// quantized or expanded (the check runs on every thread over the tensor's rows; the bad block is in a late
// row, so that another thread than the first finds it).
TEST(Model, RefusesAQuantizedTensorWithANonFiniteScale) {
  ModelConfig cfg = testing::SmallConfig(Arch::kQwen3);
  cfg.hidden = 256, cfg.ffn = 512, cfg.head_dim = 32, cfg.rotary_dim = 32;
  RandomModelOptions ro;
  ro.preset = "Q8_0";
  const std::string good = testing::TempDir() + "/finite_ok.gguf", bad = testing::TempDir() + "/finite_bad.gguf";
  ASSERT_TRUE(WriteRandomModel(cfg, ro, good).ok());
  std::vector<uint8_t> bytes = testing::ReadAll(good);
  ASSERT_FALSE(bytes.empty());
  const std::string name = "blk.1.ffn_down.weight";
  {
    auto g = GgufFile::Parse(bytes);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    const GgufTensor* t = (*g)->FindTensor(name);
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->type, GgmlType::kQ8_0);
    // The scale (f16, first two bytes) of the last block of the last row: +inf.
    const size_t at = static_cast<size_t>(t->data - bytes.data()) + t->nbytes - GgmlBlockBytes(GgmlType::kQ8_0);
    bytes[at] = 0x00, bytes[at + 1] = 0x7c;
  }
  ASSERT_TRUE(testing::WriteAll(bad, bytes));
  for (bool keep : {true, false}) {
    ModelOptions mo;
    mo.n_threads = 2;
    mo.keep_quantized = keep;
    EXPECT_TRUE(Model::Load(good, mo).ok()) << keep;
    auto m = Model::Load(bad, mo);
    ASSERT_FALSE(m.ok()) << keep;
    EXPECT_EQ(m.status().code(), StatusCode::kDataLoss) << keep;
    EXPECT_NE(m.status().message().find(name), std::string::npos) << m.status().ToString();
    EXPECT_NE(m.status().message().find("non-finite"), std::string::npos) << m.status().ToString();
  }
}

TEST(Model, RejectsBadBatches) {
  ModelConfig cfg = testing::SmallConfig();
  auto m = Load(testing::WriteModel(cfg, "badbatch"), DType::kF32, DType::kF32, 16, 32);
  ASSERT_TRUE(m);
  SeqKv s;
  std::vector<int> bad = {1, cfg.vocab};
  ASSERT_TRUE(ReserveBlocks(s, 40, 16, PoolFor(*m)).ok());
  BatchChunk ch{&s, bad, false};
  Status st = m->Forward(std::span<const BatchChunk>(&ch, 1), CacheFor(*m));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("out of vocabulary"), std::string::npos);
  std::vector<int> many(17, 1);
  ch.tokens = many;
  EXPECT_EQ(m->Forward(std::span<const BatchChunk>(&ch, 1), CacheFor(*m)).code(), StatusCode::kInvalidArgument);
  SeqKv unreserved;
  std::vector<int> one = {1};
  BatchChunk ch2{&unreserved, one, false};
  EXPECT_EQ(m->Forward(std::span<const BatchChunk>(&ch2, 1), CacheFor(*m)).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.n_tokens, 0);  // nothing was applied
}

// A copy of a model file with its tensors edited: `extra` added (f32), those named in `drop` left out.
std::string RewriteModel(const std::string& src, const std::string& name,
                         const std::vector<std::pair<std::string, std::vector<float>>>& extra,
                         const std::set<std::string>& drop = {},
                         const std::function<void(GgufWriter&)>& set_metadata = nullptr) {
  auto f = GgufFile::Open(src);
  EXPECT_TRUE(f.ok());
  GgufWriter w;
  for (const auto& [k, v] : (*f)->metadata()) w.SetValue(k, v);
  if (set_metadata) set_metadata(w);
  for (const GgufTensor& t : (*f)->tensors()) {
    if (drop.count(t.name)) continue;
    w.AddTensor(t.name, t.type, t.ne, std::vector<uint8_t>(t.data, t.data + t.nbytes));
  }
  for (const auto& [n, v] : extra) {
    w.AddTensor(n, GgmlType::kF32, {v.size()}, EncodeFromF32(v.data(), v.size(), GgmlType::kF32));
  }
  const std::string path = testing::TempDir() + "/" + name + ".gguf";
  EXPECT_TRUE(w.WriteFile(path).ok());
  return path;
}

// A tensor the layers do not read would change what the model computes: the load fails and names it.
// Tensors of blocks past the decoder stack (next-token-prediction layers) are left, and load.
TEST(Model, RefusesTensorsItDoesNotUse) {
  ModelOptions mo;
  mo.n_threads = 1;
  mo.kv_blocks = 16;
  const ModelConfig cfg = testing::SmallConfig(Arch::kLlama);
  const std::string base = testing::WriteModel(cfg, "unused_base");
  ASSERT_TRUE(Model::Load(base, mo).ok());
  const std::string bias =
      RewriteModel(base, "unused_bias", {{"blk.0.ffn_gate.bias", std::vector<float>(cfg.ffn, 0.5f)}});
  auto m = Model::Load(bias, mo);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(m.status().message().find("blk.0.ffn_gate.bias"), std::string::npos) << m.status().message();
  const std::string mtp = RewriteModel(
      base, "unused_mtp", {{"blk." + std::to_string(cfg.n_layers) + ".attn_norm.weight", std::vector<float>(8, 1)}});
  EXPECT_TRUE(Model::Load(mtp, mo).ok());
  // Llama 3.1's rope_freqs.weight is llama's only: a qwen2 file holding it is refused.
  const std::string qwen = testing::WriteModel(testing::SmallConfig(Arch::kQwen2), "unused_qwen2");
  const std::vector<float> ones(static_cast<size_t>(cfg.rotary_dim / 2), 1.0f);
  auto q = Model::Load(RewriteModel(qwen, "unused_qwen2_freqs", {{"rope_freqs.weight", ones}}), mo);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("rope_freqs.weight"), std::string::npos) << q.status().message();
  // A llama-architecture mixture of experts (Mixtral): said so, not a missing dense tensor.
  auto mix = Model::Load(RewriteModel(base, "unused_mixtral", {}, {"blk.0.ffn_gate.weight"},
                                      [](GgufWriter& w) { w.SetU32("llama.expert_count", 8); }),
                         mo);
  ASSERT_FALSE(mix.ok());
  EXPECT_EQ(mix.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(mix.status().message().find("'llama.expert_count' = 8, e.g. Mixtral"), std::string::npos)
      << mix.status().message();
}

// Llama 3.1's rope scaling reaches the attention: divisors of 1 give the bits of no divisors, others change
// the logits; a wrong length or a non-positive divisor is refused.
TEST(Model, RopeFrequencyDivisors) {
  ModelConfig cfg = testing::SmallConfig(Arch::kLlama);
  const std::string base = testing::WriteModel(cfg, "freqs_base");
  const size_t half = static_cast<size_t>(cfg.rotary_dim / 2);
  std::vector<float> ff(half, 1.0f);
  const std::string ones = RewriteModel(base, "freqs_ones", {{"rope_freqs.weight", ff}});
  for (size_t i = half / 2; i < half; ++i) ff[i] = 8.0f;
  const std::string eights = RewriteModel(base, "freqs_eights", {{"rope_freqs.weight", ff}});
  std::vector<float> logits[3];
  int k = 0;
  for (const std::string& path : {base, ones, eights}) {
    auto m = Load(path, DType::kF32, DType::kF32);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->config().rope_freq_factors.size(), path == base ? 0 : half);
    SeqKv seq;
    logits[k++] = Feed(*m, seq, Prompt(40, cfg.vocab), true);
    ReleaseAll(*m, seq);
  }
  EXPECT_EQ(logits[0], logits[1]);
  EXPECT_NE(logits[0], logits[2]);
  ModelOptions mo;
  mo.n_threads = 1;
  mo.kv_blocks = 16;
  for (const auto& bad : {std::vector<float>(half + 1, 1.0f), std::vector<float>(half, 0.0f)}) {
    auto m = Model::Load(RewriteModel(base, "freqs_bad", {{"rope_freqs.weight", bad}}), mo);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find("rope_freqs.weight"), std::string::npos) << m.status().message();
  }
}

}  // namespace
}  // namespace qkv
