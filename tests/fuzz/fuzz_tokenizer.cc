// libFuzzer target: every tokenizer family and pre-tokenizer, encode (with and without special tokens)
// and decode. The first input byte picks the tokenizer and the mode; the rest is the text (or, to decode,
// little-endian int32 ids, any value). Checks what must hold for every input: ids are inside the
// vocabulary, and byte-level BPE without a normalizer decodes back to exactly the text it encoded.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/gguf.h"
#include "engine/tokenizer.h"
#include "engine/tokenizer_bpe.h"
#include "engine/utf8.h"

namespace {

struct Entry {
  std::unique_ptr<qkv::Tokenizer> tok;
  bool round_trips;            // Decode(Encode(text)) == text for valid UTF-8 without special parsing
  std::vector<uint8_t> image;  // keeps a GGUF-built tokenizer's file alive
};

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

std::unique_ptr<qkv::Tokenizer> FromGguf(qkv::GgufWriter& w, std::vector<uint8_t>& image) {
  image = w.Serialize();
  auto f = qkv::GgufFile::Parse(image);
  Check(f.ok());
  auto t = qkv::LoadTokenizerFromGguf(**f);
  Check(t.ok());
  return std::move(*t);
}

// Byte-level BPE from GGUF metadata, with one of llama.cpp's pre-tokenizer names.
Entry ByteBpeGguf(const char* pre) {
  auto v = qkv::MakeSyntheticByteBpe(700, 7);
  Check(v.ok());
  qkv::GgufWriter w;
  w.SetString("tokenizer.ggml.model", "gpt2");
  w.SetString("tokenizer.ggml.pre", pre);
  w.SetStringArray("tokenizer.ggml.tokens", v->tokens);
  w.SetI32Array("tokenizer.ggml.token_type", v->types);
  w.SetStringArray("tokenizer.ggml.merges", v->merges);
  w.SetU32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(v->eos_id));
  Entry e{nullptr, true, {}};
  e.tok = FromGguf(w, e.image);
  return e;
}

// Byte-level BPE as a tokenizer.json gives it: added tokens (special and not), NFC, ignore_merges.
Entry ByteBpeJsonStyle() {
  auto v = qkv::MakeSyntheticByteBpe(500, 11);
  Check(v.ok());
  std::vector<std::string> tokens = v->tokens;
  std::vector<int32_t> types = v->types;
  for (const char* s : {"<tool_call>", "<|im_start|>", "<|im_end|>"}) {
    tokens.push_back(s);
    types.push_back(std::string_view(s).substr(0, 2) == "<|" ? 3 : 4);
  }
  auto t = qkv::MakeByteBpeTokenizer(
      tokens, types, v->merges, v->eos_id, v->eos_id, false,
      {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
      true, true);
  Check(t.ok());
  return {std::move(*t), false, {}};
}

// SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, "▁", letters and a few merges.
void SpmVocab(std::vector<std::string>& tokens, std::vector<int32_t>& types, std::vector<float>& scores,
              std::vector<std::string>& merges) {
  auto add = [&](const std::string& s, int type, float score) {
    tokens.push_back(s);
    types.push_back(type);
    scores.push_back(score);
  };
  add("<unk>", 2, 0);
  add("<s>", 3, 0);
  add("</s>", 3, 0);
  char buf[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    add(buf, 6, 0);
  }
  add("\xe2\x96\x81", 1, -1);
  for (char c = 'a'; c <= 'z'; ++c) add(std::string(1, c), 1, -2);
  add("\xc3\xa9", 1, -3);  // é
  const char* pairs[][2] = {{"\xe2\x96\x81", "t"},
                            {"h", "e"},
                            {"\xe2\x96\x81t", "he"},
                            {"i", "n"},
                            {"\xe2\x96\x81", "a"},
                            {"a", "n"},
                            {"an", "d"},
                            {"\xe2\x96\x81", "and"}};
  float score = -1;
  for (const auto& p : pairs) {
    merges.push_back(std::string(p[0]) + " " + p[1]);
    add(std::string(p[0]) + p[1], 1, score);
    score -= 0.5f;
  }
}

Entry SpmGguf() {
  std::vector<std::string> tokens, merges;
  std::vector<int32_t> types;
  std::vector<float> scores;
  SpmVocab(tokens, types, scores, merges);
  qkv::GgufWriter w;
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetI32Array("tokenizer.ggml.token_type", types);
  w.SetF32Array("tokenizer.ggml.scores", scores);
  w.SetU32("tokenizer.ggml.bos_token_id", 1);
  w.SetU32("tokenizer.ggml.eos_token_id", 2);
  Entry e{nullptr, false, {}};
  e.tok = FromGguf(w, e.image);
  return e;
}

Entry SpmMerges() {
  std::vector<std::string> tokens, merges;
  std::vector<int32_t> types;
  std::vector<float> scores;
  SpmVocab(tokens, types, scores, merges);
  auto t = qkv::MakeSpmBpeTokenizer(tokens, types, merges, {}, 1, 2, true, false);
  Check(t.ok());
  return {std::move(*t), false, {}};
}

std::vector<Entry>& Tokenizers() {
  static std::vector<Entry> all = [] {
    std::vector<Entry> v;
    v.push_back(ByteBpeGguf("gpt-2"));
    v.push_back(ByteBpeGguf("llama-bpe"));
    v.push_back(ByteBpeGguf("qwen2"));
    // Several regexes in turn, \p{M} and case-change classes, digits split off first.
    for (const char* pre : {"deepseek-v3", "deepseek-llm", "qwen35", "tekken", "gpt-4o", "smollm"})
      v.push_back(ByteBpeGguf(pre));
    v.push_back(ByteBpeJsonStyle());
    v.push_back(SpmGguf());
    v.push_back(SpmMerges());
    return v;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  auto& all = Tokenizers();
  const Entry& e = all[(data[0] & 0x3f) % all.size()];
  const bool special = data[0] & 0x80;
  const bool decode = data[0] & 0x40;
  const qkv::Tokenizer& tok = *e.tok;
  if (decode) {
    std::vector<int> ids((size - 1) / 4);
    if (!ids.empty()) std::memcpy(ids.data(), data + 1, ids.size() * 4);
    const std::string text = tok.Decode(ids);
    for (int id : ids) Check(id >= 0 && id < tok.vocab_size() ? true : tok.TokenBytes(id).empty());
    (void)text;
    return 0;
  }
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  if (!qkv::IsValidUtf8(text)) return 0;  // the server refuses invalid UTF-8 before tokenizing
  const std::vector<int> ids = tok.Encode(text, special);
  for (int id : ids) Check(id >= 0 && id < tok.vocab_size());
  if (e.round_trips && !special) Check(tok.Decode(ids) == text);
  return 0;
}
