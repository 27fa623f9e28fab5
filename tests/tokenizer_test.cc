#include "engine/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "engine/gguf.h"
#include "engine/output_processor.h"

namespace qkv {
namespace {

std::unique_ptr<Tokenizer> Synthetic(int vocab = 2000) {
  auto v = MakeSyntheticByteBpe(vocab, 3);
  EXPECT_TRUE(v.ok());
  GgufWriter w;
  v->ToGguf(w);
  static std::vector<uint8_t> bytes;
  bytes = w.Serialize();
  auto f = GgufFile::Parse(bytes);
  EXPECT_TRUE(f.ok());
  auto t = LoadTokenizerFromGguf(**f);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(*t);
}

TEST(Tokenizer, SyntheticVocabularyHasExactSize) {
  auto v = MakeSyntheticByteBpe(1000, 1);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->tokens.size(), 1000u);
  EXPECT_EQ(v->merges.size(), 1000u - 257u);
  EXPECT_EQ(v->tokens.back(), "<|endoftext|>");
  EXPECT_EQ(v->eos_id, 999);
  EXPECT_FALSE(MakeSyntheticByteBpe(256, 1).ok());
  auto again = MakeSyntheticByteBpe(1000, 1);
  EXPECT_EQ(v->merges, again->merges);  // deterministic
}

TEST(Tokenizer, RoundTripsArbitraryText) {
  auto t = Synthetic();
  for (std::string s : std::vector<std::string>{"Hello world", "", "  leading and trailing  ",
                                                "tabs\tand\nnewlines\n\n", "numbers 12345 and 3.14",
                                                "Ünïcödé, кириллица, 中文, emoji 👩‍👩‍👧",
                                                std::string("\xff\xfe invalid utf8 \xc3"), "it's we've they'll"}) {
    const auto ids = t->Encode(s);
    EXPECT_EQ(t->Decode(ids), s);
    for (int id : ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, t->vocab_size());
    }
  }
}

TEST(Tokenizer, MergesShortenCommonText) {
  auto t = Synthetic();
  const std::string s = "the quick brown fox jumps over the lazy dog";
  EXPECT_LT(t->Encode(s).size(), s.size());
}

TEST(Tokenizer, SpecialTokensAreTextUnlessAsked) {
  auto t = Synthetic();
  const std::string s = "a<|endoftext|>b";
  const auto plain = t->Encode(s);
  for (int id : plain) EXPECT_NE(id, t->eos_id());
  EXPECT_EQ(t->Decode(plain), s);
  const auto special = t->Encode(s, /*parse_special=*/true);
  ASSERT_EQ(special.size(), 3u);
  EXPECT_EQ(special[1], t->eos_id());
  EXPECT_TRUE(t->IsSpecial(t->eos_id()));
}

TEST(Tokenizer, Gpt2PreTokenizerKeepsContractionsAndSpaces) {
  // Byte tokens only (no merges): each pre-token is then visible as a run of byte ids, and the split
  // shows up in decode of each id group. Check via the round trip and the count of byte tokens.
  auto t = Synthetic(257);
  EXPECT_EQ(t->Encode("it's").size(), 4u);
  EXPECT_EQ(t->Decode(t->Encode("a  b")), "a  b");
}

// llama.cpp's `tokenizer.ggml.pre` names load with their regexes; BOS is added by default where llama.cpp adds
// it for the name (files from before the converter wrote add_bos_token); an unknown name is refused by name.
TEST(Tokenizer, PreTokenizerNamesOfLlamaCpp) {
  auto v = MakeSyntheticByteBpe(600, 5);
  ASSERT_TRUE(v.ok());
  auto load = [&](const std::string& pre, int add_bos) {
    GgufWriter w;  // BpeVocab::ToGguf's keys but add_bos_token, which it always writes
    w.SetString("tokenizer.ggml.model", "gpt2");
    w.SetString("tokenizer.ggml.pre", pre);
    w.SetStringArray("tokenizer.ggml.tokens", v->tokens);
    w.SetI32Array("tokenizer.ggml.token_type", v->types);
    w.SetStringArray("tokenizer.ggml.merges", v->merges);
    w.SetU32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(v->eos_id));
    if (add_bos >= 0) w.SetBool("tokenizer.ggml.add_bos_token", add_bos != 0);
    static std::vector<uint8_t> bytes;
    bytes = w.Serialize();
    auto f = GgufFile::Parse(bytes);
    EXPECT_TRUE(f.ok());
    return LoadTokenizerFromGguf(**f);
  };
  const std::string text = "Don't parseHTTPResponse 12345 नमस्ते 你好 ½ \n\n  x";
  for (const char* pre : {"gpt-2", "llama-bpe", "llama-v3", "qwen2", "deepseek-r1-qwen", "qwen35", "deepseek-v3",
                          "deepseek-llm", "tekken", "gpt-4o", "smollm", "dbrx"}) {
    auto t = load(pre, -1);
    ASSERT_TRUE(t.ok()) << pre << ": " << t.status().ToString();
    EXPECT_EQ((*t)->Decode((*t)->Encode(text)), text) << pre;
  }
  for (auto [pre, bos] : std::vector<std::pair<const char*, bool>>{
           {"llama-bpe", true}, {"tekken", true}, {"qwen2", false}, {"deepseek-v3", false}}) {
    auto t = load(pre, -1);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ((*t)->add_bos(), bos) << pre;
    auto kept = load(pre, bos ? 0 : 1);  // the file's own key wins
    ASSERT_TRUE(kept.ok());
    EXPECT_EQ((*kept)->add_bos(), !bos) << pre;
  }
  auto bad = load("no-such-pre", -1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(bad.status().message().find("'no-such-pre'"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("deepseek-v3"), std::string::npos) << bad.status().message();
}

// The end-of-generation set (llama.cpp's): EOS, the file's eot/eom ids and every token whose text ends a turn.
// A Qwen-style file whose EOS is <|endoftext|> still ends a chat turn at <|im_end|>; generation stops there
// (with ignore_eos, at none of them).
TEST(Tokenizer, EndOfGenerationSet) {
  auto v = MakeSyntheticByteBpe(600, 5);
  ASSERT_TRUE(v.ok());
  std::vector<std::string> tokens = v->tokens;
  std::vector<int32_t> types = v->types;
  const int im_end = static_cast<int>(tokens.size());
  for (const char* s : {"<|im_end|>", "<|im_start|>", "<|eom_id|>", "<tool_call>"}) {
    tokens.push_back(s);
    types.push_back(3);
  }
  const int eom = im_end + 2, tool = im_end + 3;
  auto load = [&](int64_t eot) {
    GgufWriter w;
    w.SetString("tokenizer.ggml.model", "gpt2");
    w.SetString("tokenizer.ggml.pre", "qwen2");
    w.SetStringArray("tokenizer.ggml.tokens", tokens);
    w.SetI32Array("tokenizer.ggml.token_type", types);
    w.SetStringArray("tokenizer.ggml.merges", v->merges);
    w.SetU32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(v->eos_id));
    if (eot >= 0) w.SetU32("tokenizer.ggml.eot_token_id", static_cast<uint32_t>(eot));
    static std::vector<uint8_t> bytes;
    bytes = w.Serialize();
    auto f = GgufFile::Parse(bytes);
    EXPECT_TRUE(f.ok());
    return LoadTokenizerFromGguf(**f);
  };
  auto t = load(-1);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // <|endoftext|> (EOS), <|im_end|>, <|eom_id|>; not <|im_start|>.
  EXPECT_EQ((*t)->eog_ids(), (std::vector<int>{v->eos_id, im_end, eom}));
  EXPECT_TRUE((*t)->IsEndOfGeneration(im_end));
  EXPECT_FALSE((*t)->IsEndOfGeneration(im_end + 1));
  auto with_eot = load(tool);  // the file's own end-of-turn id joins the set
  ASSERT_TRUE(with_eot.ok());
  EXPECT_TRUE((*with_eot)->IsEndOfGeneration(tool));
  auto bad = load(100000);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("tokenizer.ggml.eot_token_id"), std::string::npos);

  // Generation ends at <|im_end|> with reason "eos" although EOS is another token; ignore_eos goes on.
  std::vector<float> row(static_cast<size_t>((*t)->vocab_size()), 0.0f);
  row[static_cast<size_t>(im_end)] = 10.0f;
  SamplingParams greedy;
  greedy.temperature = 0;
  const std::vector<int> prompt{1, 2, 3};
  OutputOptions o;
  o.max_tokens = 8;
  OutputProcessor stop(**t, greedy, prompt, o);
  const OutputProcessor::Step s1 = stop.Next(row.data(), static_cast<int>(row.size()), 4);
  EXPECT_EQ(s1.token, im_end);
  EXPECT_EQ(s1.finish, FinishReason::kStop);
  EXPECT_EQ(s1.stop_reason, "eos");
  o.ignore_eos = true;
  OutputProcessor go_on(**t, greedy, prompt, o);
  EXPECT_EQ(go_on.Next(row.data(), static_cast<int>(row.size()), 4).finish, FinishReason::kNone);
}

// A tokenizer.json's pre-tokenizers apply in order, each to the pieces of the one before (tokenizers'
// Sequence); Digits and literal String splits are understood; what is not understood is refused by name rather
// than skipped (a skipped split tokenizes unlike the model's training).
class TokenizerJson : public ::testing::Test {
 protected:
  StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& pre_tokenizer, const std::string& normalizer = "null",
                                            const std::string& generation_config = "") {
    // The 256 byte tokens, then "12", "123", "1234" by merges, and "<|endoftext|>", "<|im_end|>" added.
    std::string vocab;
    const auto& b2u = ByteToUnicode();
    for (int b = 0; b < 256; ++b) {
      std::string k;
      for (unsigned char c : b2u[b]) {
        if (c == '"' || c == '\\') k += '\\';
        k += static_cast<char>(c);
      }
      vocab += "\"" + k + "\": " + std::to_string(b) + ", ";
    }
    vocab += R"("12": 256, "123": 257, "1234": 258)";
    const std::string json =
        R"({"added_tokens": [{"id": 259, "content": "<|endoftext|>", "special": true}, {"id": 260, "content": "<|im_end|>", "special": true}], "normalizer": )" +
        normalizer + R"(, "pre_tokenizer": )" + pre_tokenizer + R"(, "model": {"type": "BPE", "vocab": {)" + vocab +
        R"(}, "merges": ["1 2", "12 3", "123 4"]}})";
    // A directory of its own: tests run in parallel, and generation_config.json is read beside the file.
    std::string dir = ::testing::TempDir() + "/qkv_tokenizer_json_XXXXXX";
    if (mkdtemp(dir.data()) == nullptr) return Internal("cannot make a directory under " + ::testing::TempDir());
    auto write = [](const std::string& path, const std::string& text) {
      FILE* f = std::fopen(path.c_str(), "w");
      EXPECT_NE(f, nullptr);
      std::fwrite(text.data(), 1, text.size(), f);
      std::fclose(f);
    };
    write(dir + "/tokenizer.json", json);
    if (!generation_config.empty()) write(dir + "/generation_config.json", generation_config);
    auto t = LoadTokenizerFromJson(dir + "/tokenizer.json");
    std::remove((dir + "/tokenizer.json").c_str());
    std::remove((dir + "/generation_config.json").c_str());
    rmdir(dir.c_str());
    return t;
  }
  static std::string Split(const std::string& re) {
    return R"({"type": "Split", "pattern": {"Regex": ")" + re + R"("}, "behavior": "Isolated", "invert": false})";
  }
  static std::string Seq(const std::string& a, const std::string& b) {
    return R"({"type": "Sequence", "pretokenizers": [)" + a + ", " + b + "]}";
  }
  static constexpr const char* kByteLevel = R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": false})";
};

TEST_F(TokenizerJson, SequenceSplitsEachPieceOfTheOneBefore) {
  const std::vector<int> whole{258}, threes{257, '4'}, ones{'1', '2', '3', '4'};
  auto one = Load(Seq(Split(R"(\\p{N}+)"), kByteLevel));
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ((*one)->Encode("1234"), whole);
  auto three = Load(Seq(Split(R"(\\p{N}{1,3})"), kByteLevel));
  ASSERT_TRUE(three.ok());
  EXPECT_EQ((*three)->Encode("1234"), threes);
  // Threes first, then every digit alone: the second split cuts the pieces of the first.
  auto both = Load(R"({"type": "Sequence", "pretokenizers": [)" + Split(R"(\\p{N}{1,3})") + ", " +
                   R"({"type": "Digits", "individual_digits": true}, )" + kByteLevel + "]}");
  ASSERT_TRUE(both.ok());
  EXPECT_EQ((*both)->Encode("1234"), ones);
  // Digits as tokenizers (Rust) defines it: every Unicode number, in runs unless individual_digits.
  auto runs = Load(Seq(R"({"type": "Digits", "individual_digits": false})", kByteLevel));
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ((*runs)->Encode("1234"), whole);
  // A literal String split isolates the string, special characters included.
  auto lit = Load(Seq(R"({"type": "Split", "pattern": {"String": "2."}, "behavior": "Isolated"})", kByteLevel));
  ASSERT_TRUE(lit.ok());
  EXPECT_EQ((*lit)->Encode("12.3"), (std::vector<int>{'1', '2', '.', '3'}));
  EXPECT_EQ((*lit)->Encode("123"), (std::vector<int>{257}));
  // ByteLevel's own regex when use_regex (GPT-2's: digits stay together).
  auto gpt2 = Load(R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})");
  ASSERT_TRUE(gpt2.ok());
  EXPECT_EQ((*gpt2)->Encode("1234"), whole);
  // Removed with invert: the matches are the pieces and the text between them is dropped.
  auto removed = Load(
      Seq(R"({"type": "Split", "pattern": {"Regex": "\\p{N}+"}, "behavior": "Removed", "invert": true})", kByteLevel));
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ((*removed)->Encode("a1234b"), whole);
}

// generation_config.json's eos_token_id (one id or a list, as Llama 3.1's) joins the end-of-generation set, beside
// the added tokens whose text ends a turn.
TEST_F(TokenizerJson, GenerationConfigEndsGeneration) {
  auto plain = Load(kByteLevel);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ((*plain)->eog_ids(), (std::vector<int>{259, 260}));
  auto list = Load(kByteLevel, "null", R"({"eos_token_id": [257, 259]})");
  ASSERT_TRUE(list.ok());
  EXPECT_EQ((*list)->eog_ids(), (std::vector<int>{257, 259, 260}));
  auto one = Load(kByteLevel, "null", R"({"eos_token_id": 256})");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)->eog_ids(), (std::vector<int>{256, 259, 260}));
}

TEST_F(TokenizerJson, RefusesWhatItDoesNotUnderstandByName) {
  auto expect_refused = [&](const StatusOr<std::unique_ptr<Tokenizer>>& t, const std::string& names) {
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(t.status().message().find(names), std::string::npos) << t.status().message();
  };
  expect_refused(Load(Seq(R"({"type": "Whitespace"})", kByteLevel)), "'Whitespace'");
  expect_refused(
      Load(Seq(R"({"type": "Split", "pattern": {"Regex": "a"}, "behavior": "MergedWithPrevious"})", kByteLevel)),
      "behavior 'MergedWithPrevious'");
  expect_refused(Load(R"({"type": "ByteLevel", "add_prefix_space": true})"), "add_prefix_space");
  expect_refused(Load(kByteLevel, R"({"type": "Lowercase"})"), "normalizer 'Lowercase'");
  auto bad_regex = Load(Seq(Split("("), kByteLevel));
  ASSERT_FALSE(bad_regex.ok());
  EXPECT_EQ(bad_regex.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_regex.status().message().find("regex"), std::string::npos) << bad_regex.status().message();
}
}  // namespace
}  // namespace qkv

namespace qkv {
namespace {

// A GGUF `tokenizer.ggml.model = llama` (SentencePiece-style) vocabulary: merges by the merged token's
// score, "▁" for spaces with a prepended "▁", byte fallback for characters outside the vocabulary.
TEST(Tokenizer, SentencePieceFromGguf) {
  std::vector<std::string> toks = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  std::vector<float> scores = {0, 0, 0};
  char buf[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    toks.push_back(buf);
    types.push_back(6);
    scores.push_back(0);
  }
  const std::string u = "\xE2\x96\x81";  // ▁
  for (auto [t, s] : std::vector<std::pair<std::string, float>>{
           {u, -1}, {"a", -2}, {"b", -3}, {"ab", -4}, {u + "a", -5}, {u + "ab", -6}, {"c", -7}}) {
    toks.push_back(t);
    types.push_back(1);
    scores.push_back(s);
  }
  auto id = [&](const std::string& t) {
    return static_cast<int>(std::find(toks.begin(), toks.end(), t) - toks.begin());
  };
  GgufWriter w;
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", toks);
  w.SetI32Array("tokenizer.ggml.token_type", types);
  // scores are f32: write them through the array helper for f32 values.
  w.SetF32Array("tokenizer.ggml.scores", scores);
  w.SetU32("tokenizer.ggml.bos_token_id", 1);
  w.SetU32("tokenizer.ggml.eos_token_id", 2);
  static std::vector<uint8_t> bytes;
  bytes = w.Serialize();
  auto f = GgufFile::Parse(bytes);
  ASSERT_TRUE(f.ok());
  auto t = LoadTokenizerFromGguf(**f);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // "ab ab": ▁ab (the best-scored full merge chain) twice; "é" is outside: its two bytes fall back.
  EXPECT_EQ((*t)->Encode("ab ab"), (std::vector<int>{id(u + "ab"), id(u + "ab")}));
  EXPECT_EQ((*t)->Encode("c\xC3\xA9"), (std::vector<int>{id(u), id("c"), id("<0xC3>"), id("<0xA9>")}));
  EXPECT_EQ((*t)->Decode((*t)->Encode("ab c\xC3\xA9")), " ab c\xC3\xA9");
  EXPECT_TRUE((*t)->add_bos());
  EXPECT_EQ((*t)->bos_id(), 1);
}

}  // namespace
}  // namespace qkv
