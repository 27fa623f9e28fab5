#include "engine/gguf.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>

#include "engine/chat_template.h"
#include "engine/model.h"
#include "engine/random_model.h"
#include "engine/tokenizer.h"
#include "tests/test_util.h"

namespace qkv {
namespace {

TEST(Gguf, RoundTripsMetadataAndTensors) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetU32("a.u32", 7);
  w.SetF32("a.f32", 1.5f);
  w.SetBool("a.bool", true);
  w.SetStringArray("a.strs", {"x", "", "yz"});
  w.SetI32Array("a.ints", {-1, 2});
  const float vals[64] = {1, -2, 3.5f};
  w.AddTensor("t.f32", GgmlType::kF32, {4, 16}, EncodeFromF32(vals, 64, GgmlType::kF32));
  w.AddTensor("t.q8", GgmlType::kQ8_0, {64}, EncodeFromF32(vals, 64, GgmlType::kQ8_0));
  const auto bytes = w.Serialize();
  auto f = GgufFile::Parse(bytes);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(*(*f)->GetInt("a.u32"), 7);
  EXPECT_EQ(*(*f)->GetFloat("a.f32"), 1.5);
  EXPECT_TRUE(*(*f)->GetBool("a.bool"));
  EXPECT_EQ((*f)->Find("a.strs")->array.size(), 3u);
  EXPECT_EQ((*f)->Find("a.strs")->array[2].s, "yz");
  EXPECT_EQ((*f)->Find("a.ints")->array[0].i, -1);
  const GgufTensor* t = (*f)->FindTensor("t.f32");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->ne, (std::vector<uint64_t>{4, 16}));
  std::vector<float> back(64);
  ASSERT_TRUE(DequantizeToF32(*t, back.data()).ok());
  EXPECT_EQ(back[1], -2.0f);
  const GgufTensor* q = (*f)->FindTensor("t.q8");
  ASSERT_TRUE(DequantizeToF32(*q, back.data()).ok());
  EXPECT_NEAR(back[2], 3.5f, 0.02f);
  EXPECT_FALSE((*f)->GetInt("missing").ok());
  EXPECT_EQ((*f)->GetString("a.u32").status().code(), StatusCode::kInvalidArgument);
}

// qkvserve.chat.stop: absent is none; an array of 1..16 strings of 1..64 bytes of UTF-8, else a clear error.
// Tensors made while the file is written (GgufWriter's fill): the file equals Serialize() and reads back; a fill
// that fails leaves no file (nor its .tmp) and an older file at the path untouched; the bytes of an encoded row
// do not depend on the encoder's thread count.
TEST(Gguf, StreamedTensorsAndAFailedWriteLeavesNoFile) {
  std::vector<float> v(4 * 256);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.1f * static_cast<float>(i));
  auto build = [&](bool fail_second) {
    GgufWriter w;
    w.SetString("general.name", "stream");
    w.AddTensor("a", GgmlType::kF32, {3}, std::vector<uint8_t>(12, 7));
    w.AddTensor("q", GgmlType::kQ4_K, {256, 4}, [&v](std::span<uint8_t> dst) {
      EXPECT_EQ(dst.size(), 4 * GgmlRowBytes(GgmlType::kQ4_K, 256));
      EncodeRowsFromF32(v.data(), 4, 256, GgmlType::kQ4_K, dst.data(), 3);
      return Status{};
    });
    w.AddTensor("b", GgmlType::kF32, {5}, [fail_second](std::span<uint8_t> dst) {
      if (fail_second) return DataLoss("no bytes for b");
      std::memset(dst.data(), 1, dst.size());
      return Status{};
    });
    return w;
  };
  const std::string path = testing::TempDir() + "/streamed.gguf";
  ASSERT_TRUE(build(false).WriteFile(path).ok());
  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(file, build(false).Serialize());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufTensor* q = (*f)->FindTensor("q");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(std::vector<uint8_t>(q->data, q->data + q->nbytes), EncodeFromF32(v.data(), v.size(), GgmlType::kQ4_K));
  ASSERT_NE((*f)->FindTensor("b"), nullptr);
  EXPECT_EQ((*f)->FindTensor("b")->data[4], 1);

  const Status bad = build(true).WriteFile(path);
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.message().find("no bytes for b"), std::string::npos);
  std::ifstream again(path, std::ios::binary);
  EXPECT_EQ(std::vector<uint8_t>((std::istreambuf_iterator<char>(again)), std::istreambuf_iterator<char>()), file);
  EXPECT_FALSE(std::ifstream(path + ".tmp").good());
  const std::string fresh = testing::TempDir() + "/streamed_never.gguf";
  EXPECT_FALSE(build(true).WriteFile(fresh).ok());
  EXPECT_FALSE(std::ifstream(fresh).good());
  EXPECT_TRUE(build(true).Serialize().empty());
}

TEST(Gguf, ChatStopStrings) {
  auto parse = [](const std::function<void(GgufWriter&)>& set) {
    GgufWriter w;
    set(w);
    const auto bytes = w.Serialize();
    auto f = GgufFile::Parse(bytes);
    EXPECT_TRUE(f.ok());
    return ChatStopStrings(**f);
  };
  EXPECT_TRUE(parse([](GgufWriter&) {})->empty());
  EXPECT_EQ(*parse([](GgufWriter& w) {
    w.SetStringArray(kKeyChatStop, {"\n", "Amen"});
  }),
            (std::vector<std::string>{"\n", "Amen"}));
  for (const auto& bad : std::vector<std::function<void(GgufWriter&)>>{
           [](GgufWriter& w) { w.SetString(kKeyChatStop, "\n"); },
           [](GgufWriter& w) { w.SetStringArray(kKeyChatStop, {}); },
           [](GgufWriter& w) { w.SetStringArray(kKeyChatStop, {""}); },
           [](GgufWriter& w) { w.SetStringArray(kKeyChatStop, {std::string(65, 'x')}); },
           [](GgufWriter& w) { w.SetStringArray(kKeyChatStop, {"\xff"}); },
           [](GgufWriter& w) { w.SetStringArray(kKeyChatStop, std::vector<std::string>(17, "x")); },
           [](GgufWriter& w) { w.SetI32Array(kKeyChatStop, {1}); }}) {
    auto r = parse(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("qkvserve.chat.stop"), std::string::npos) << r.status().message();
  }
}

TEST(Gguf, RejectsBadMagicVersionAndTruncation) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  auto bytes = w.Serialize();
  auto bad = bytes;
  bad[0] = 'X';
  auto r = GgufFile::Parse(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("magic"), std::string::npos);
  bad = bytes;
  bad[4] = 9;
  r = GgufFile::Parse(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("version"), std::string::npos);
  r = GgufFile::Parse(std::span<const uint8_t>(bytes.data(), 60));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("truncated"), std::string::npos);
}

TEST(Gguf, RejectsUnknownTensorTypeAndAbsurdCounts) {
  GgufWriter w;
  const float v[4] = {};
  w.AddTensor("t", GgmlType::kF32, {4}, EncodeFromF32(v, 4, GgmlType::kF32));
  auto bytes = w.Serialize();
  // Tensor info: magic(4) version(4) counts(16) name(8+1) n_dims(4) ne(8) type(4).
  const size_t type_at = 24 + 9 + 4 + 8;
  auto bad = bytes;
  bad[type_at] = 16;  // iq2_xxs: not supported
  auto r = GgufFile::Parse(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("unsupported ggml type 16"), std::string::npos);
  bad = bytes;
  bad[type_at] = 2;  // q4_0, but 4 values are not a whole 32-value block
  r = GgufFile::Parse(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not a multiple of its block size"), std::string::npos);
  bad = bytes;
  bad[8 + 7] = 0x7f;  // tensor count ~ 2^63
  r = GgufFile::Parse(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("absurd"), std::string::npos);
}

// Quantized tensors: every type reads back; a file cut inside a quantized tensor's data is refused.
TEST(Gguf, QuantizedTensorsRoundTripAndTruncationIsRefused) {
  std::vector<float> vals(2 * 256);
  for (size_t i = 0; i < vals.size(); ++i) vals[i] = std::sin(0.37f * static_cast<float>(i));
  for (const char* name :
       {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"}) {
    const GgmlType t = *GgmlTypeFromName(name);
    GgufWriter w;
    w.AddTensor("q", t, {256, 2}, EncodeFromF32(vals.data(), vals.size(), t));
    const auto bytes = w.Serialize();
    auto f = GgufFile::Parse(bytes);
    ASSERT_TRUE(f.ok()) << name << ": " << f.status().ToString();
    const GgufTensor* q = (*f)->FindTensor("q");
    ASSERT_TRUE(q);
    EXPECT_EQ(q->nbytes, GgmlRowBytes(t, 256) * 2) << name;
    std::vector<float> back(vals.size());
    ASSERT_TRUE(DequantizeToF32(*q, back.data()).ok());
    double err = 0;
    for (size_t i = 0; i < vals.size(); ++i) err = std::max(err, std::fabs(double(back[i]) - vals[i]));
    EXPECT_LT(err, 0.5) << name;
    const std::span<const uint8_t> cut(bytes.data(), bytes.size() - GgmlBlockBytes(t) / 2 - 32);
    auto r = GgufFile::Parse(cut);
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_NE(r.status().message().find("beyond the end"), std::string::npos) << r.status().message();
  }
}

// Rewrites a GGUF file's metadata and tensors: `drop_key` is left out, `set_u32` overrides (or adds) u32
// keys, `drop_tensor` is left out and `swap_tensor` gets its first two dims swapped.
std::string Rewrite(const GgufFile& f, const std::string& out_name, const std::string& drop_key,
                    const std::map<std::string, uint32_t>& set_u32, const std::string& drop_tensor = "",
                    const std::string& swap_tensor = "") {
  GgufWriter w;
  for (const auto& [key, v] : f.metadata()) {
    if (key == drop_key || set_u32.count(key)) continue;
    if (v.type == GgufType::kString)
      w.SetString(key, v.s);
    else if (v.type == GgufType::kU32)
      w.SetU32(key, static_cast<uint32_t>(v.u));
    else if (v.type == GgufType::kF32)
      w.SetF32(key, static_cast<float>(v.f));
    else if (v.type == GgufType::kBool)
      w.SetBool(key, v.u != 0);
    else if (v.type == GgufType::kArray && v.array_type == GgufType::kString) {
      std::vector<std::string> s;
      for (const auto& e : v.array) s.push_back(e.s);
      w.SetStringArray(key, s);
    } else if (v.type == GgufType::kArray) {
      std::vector<int32_t> s;
      for (const auto& e : v.array) s.push_back(static_cast<int32_t>(e.i));
      w.SetI32Array(key, s);
    }
  }
  for (const auto& [key, u] : set_u32) w.SetU32(key, u);
  for (const GgufTensor& t : f.tensors()) {
    if (t.name == drop_tensor) continue;
    std::vector<uint64_t> ne = t.ne;
    if (t.name == swap_tensor) std::swap(ne[0], ne[1]);
    w.AddTensor(t.name, t.type, ne, std::vector<uint8_t>(t.data, t.data + t.nbytes));
  }
  const std::string out = testing::TempDir() + "/" + out_name + ".gguf";
  EXPECT_TRUE(w.WriteFile(out).ok());
  return out;
}

std::string LoadError(const std::string& path) {
  ModelOptions mo;
  mo.n_threads = 1;
  auto m = Model::Load(path, mo);
  EXPECT_FALSE(m.ok()) << path;
  return m.ok() ? "" : m.status().ToString();
}

TEST(Gguf, ModelLoadNamesMissingAndMisshapenTensors) {
  const std::string path = testing::WriteModel(testing::SmallConfig(), "shape_src");
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok());
  // Rebuild the file without one tensor, and with one tensor of the wrong shape.
  EXPECT_NE(
      LoadError(Rewrite(**f, "variant0", "", {}, "blk.1.attn_k.weight")).find("missing tensor 'blk.1.attn_k.weight'"),
      std::string::npos);
  EXPECT_NE(LoadError(Rewrite(**f, "variant1", "", {}, "", "blk.0.ffn_down.weight"))
                .find("'blk.0.ffn_down.weight' has shape"),
            std::string::npos);
}

// deepseek2 metadata is read as llama.cpp reads it: q_lora_rank is required unless the model has 26 or 27
// layers, the expert keys are required even for dense layers, and expert blocks need experts.
TEST(Gguf, Deepseek2MetadataAsLlamaCppReadsIt) {
  const std::string path = testing::WriteModel(testing::SmallConfig(Arch::kDeepseek2), "mla_src");
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok());
  struct Case {
    std::string drop_key;
    std::map<std::string, uint32_t> set;
    std::string drop_tensor, want;
  };
  const std::vector<Case> cases = {
      {"deepseek2.attention.q_lora_rank", {}, "", "needs 'deepseek2.attention.q_lora_rank'"},
      {"deepseek2.expert_feed_forward_length",
       {},
       "",
       "'deepseek2.expert_feed_forward_length' (llama.cpp requires it)"},
      {"deepseek2.expert_shared_count", {}, "", "'deepseek2.expert_shared_count'"},
      // expert blocks after the leading dense ones need experts (llama.cpp: "n_expert must be > 0")
      {"", {{"deepseek2.leading_dense_block_count", 1}}, "", "need expert_count > 0"},
      {"deepseek2.leading_dense_block_count", {}, "", "need expert_count > 0"},  // llama.cpp's default is 0
      {"", {}, "blk.1.attn_k_b.weight", "missing tensor 'blk.1.attn_k_b.weight'"},
      {"", {{"deepseek2.attention.kv_lora_rank", 40}}, "", "'blk.0.attn_kv_a_norm.weight' has shape"},
      {"", {{"deepseek2.rope.dimension_count", 64}}, "", "key length must exceed rope.dimension_count"},
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string err = LoadError(Rewrite(**f, "mla_case" + std::to_string(i++), c.drop_key, c.set, c.drop_tensor));
    EXPECT_NE(err.find(c.want), std::string::npos) << err;
  }
  // The same file loads as it is, and reports MLA.
  ModelOptions mo;
  mo.n_threads = 1;
  auto m = Model::Load(path, mo);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_STREQ((*m)->config().AttentionKind(), "MLA");
}

// qwen3moe needs expert_count and expert_used_count (llama.cpp requires them); the expert width defaults
// to feed_forward_length / expert_used_count.
TEST(Gguf, Qwen3MoeMetadataAsLlamaCppReadsIt) {
  const std::string path = testing::WriteModel(testing::SmallConfig(Arch::kQwen3Moe), "moe_src");
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok());
  for (const char* key : {"qwen3moe.expert_count", "qwen3moe.expert_used_count"}) {
    const std::string err = LoadError(Rewrite(**f, std::string("moe_no_") + key, key, {}));
    EXPECT_NE(err.find(std::string("needs metadata '") + key), std::string::npos) << err;
  }
  EXPECT_NE(LoadError(Rewrite(**f, "moe_used9", "", {{"qwen3moe.expert_used_count", 9}})).find("num_experts_per_tok"),
            std::string::npos);
  EXPECT_NE(LoadError(Rewrite(**f, "moe_no_gate_exps", "", {}, "blk.1.ffn_up_exps.weight"))
                .find("missing tensor 'blk.1.ffn_up_exps.weight'"),
            std::string::npos);
  auto cfg = ModelConfig::FromGguf(**f);
  ASSERT_TRUE(cfg.ok());
  EXPECT_EQ(cfg->moe.expert_ffn, 48);
  EXPECT_LT(cfg->ActiveParameterCount(), cfg->ParameterCount());
}

// Truncates and corrupts a valid model many times: parsing and loading must fail cleanly or succeed,
// never crash or read out of bounds (run under ASan/valgrind to see the latter).
// Also on a quantized file (Q4_K_M on 256-wide rows: Q4_K, Q6_K and Q5_0 tensors), whose corrupted scales
// must not crash the load either, and on an MLA (deepseek2) file.
TEST(Gguf, FuzzedFilesNeverCrash) {
  ModelConfig qcfg = testing::SmallConfig(Arch::kQwen2);
  qcfg.hidden = 256, qcfg.ffn = 256, qcfg.head_dim = 32, qcfg.rotary_dim = 32;
  const std::string qpath = testing::TempDir() + "/fuzz_src_q4_k_m.gguf";
  ASSERT_TRUE(WriteRandomModel(qcfg, {GgmlType::kF32, 1, "Q4_K_M", {}}, qpath).ok());
  for (const std::string& path : {testing::WriteModel(testing::SmallConfig(Arch::kQwen2), "fuzz_src"), qpath,
                                  testing::WriteModel(testing::SmallConfig(Arch::kDeepseek2), "fuzz_src_mla")}) {
    const std::vector<uint8_t> good = testing::ReadAll(path);
    ASSERT_GT(good.size(), 1000u);
    std::mt19937_64 rng(123);
    int parsed_ok = 0, failed = 0, loaded = 0;
    const std::string mutated = testing::TempDir() + "/mutated.gguf";
    for (int it = 0; it < 3000; ++it) {
      std::vector<uint8_t> b = good;
      switch (it % 3) {
        case 0: b.resize(rng() % b.size()); break;  // truncation
        case 1: {                                   // flips in the header/metadata region
          const int flips = 1 + rng() % 4;
          const size_t region = std::min<size_t>(b.size(), 24000);
          for (int k = 0; k < flips; ++k) b[rng() % region] ^= static_cast<uint8_t>(1u << (rng() % 8));
          break;
        }
        default: {  // random bytes anywhere, including 0xff runs that make huge lengths
          const size_t at = rng() % b.size();
          for (size_t k = at; k < std::min(b.size(), at + 8); ++k)
            b[k] = (rng() % 2) ? 0xff : static_cast<uint8_t>(rng());
          break;
        }
      }
      auto f = GgufFile::Parse(b);
      if (!f.ok()) {
        ++failed;
        EXPECT_FALSE(f.status().message().empty());
        continue;
      }
      ++parsed_ok;
      (void)ModelConfig::FromGguf(**f);
      (void)LoadTokenizerFromGguf(**f);
      if (it % 10 == 1) {  // full loads are slower: every tenth corrupted file
        ASSERT_TRUE(testing::WriteAll(mutated, b));
        ModelOptions mo;
        mo.n_threads = 1;
        mo.max_batch_tokens = 8;
        mo.max_context = 64;  // a corrupted context_length must not make the test allocate gigabytes
        auto m = Model::Load(mutated, mo);
        if (m.ok()) ++loaded;
      }
    }
    EXPECT_GT(failed, 1000) << path;
    EXPECT_GT(parsed_ok, 100) << path;
    std::printf("fuzz %s: %d rejected, %d parsed, %d fully loaded\n", path.c_str(), failed, parsed_ok, loaded);
  }
}

}  // namespace
}  // namespace qkv
