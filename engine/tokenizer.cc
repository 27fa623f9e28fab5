#include "engine/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "engine/tokenizer_bpe.h"
#include "engine/unicode_nfc.h"
#include "engine/utf8.h"

namespace qkv {
namespace {

std::string CodepointToUtf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's pre-tokenizer pattern.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Llama 3 ("llama-bpe" in llama.cpp): case-insensitive contractions, digits in runs of up to three.
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// Qwen2/2.5/3: as Llama 3 but single digits.
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> StringArray(const GgufValue& v) {
  std::vector<std::string> out;
  out.reserve(v.array.size());
  for (const GgufValue& e : v.array) out.push_back(e.s);
  return out;
}

}  // namespace

std::string Tokenizer::Decode(std::span<const int> ids) const {
  std::string s;
  for (int id : ids) s += TokenBytes(id);
  return s;
}

const std::vector<std::string>& ByteToUnicode() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = CodepointToUtf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++));
    }
    return t;
  }();
  return table;
}

namespace {
StatusOr<std::unique_ptr<Tokenizer>> LoadSpmFromGguf(const GgufFile& f) {
  const GgufValue* toks = f.Find("tokenizer.ggml.tokens");
  if (!toks || toks->type != GgufType::kArray || toks->array_type != GgufType::kString || toks->array.empty()) {
    return DataLoss("tokenizer: 'tokenizer.ggml.tokens' must be a non-empty string array");
  }
  std::vector<int32_t> types;
  if (const GgufValue* tt = f.Find("tokenizer.ggml.token_type"); tt && tt->type == GgufType::kArray) {
    for (const GgufValue& e : tt->array) types.push_back(static_cast<int32_t>(e.i));
  }
  std::vector<float> scores;
  if (const GgufValue* sc = f.Find("tokenizer.ggml.scores"); sc && sc->type == GgufType::kArray) {
    for (const GgufValue& e : sc->array) scores.push_back(static_cast<float>(e.f));
  }
  if (scores.size() != toks->array.size())
    return DataLoss("tokenizer: 'tokenizer.ggml.scores' must have one score per token");
  const int n = static_cast<int>(toks->array.size());
  const int64_t bos = f.GetIntOr("tokenizer.ggml.bos_token_id", 1), eos = f.GetIntOr("tokenizer.ggml.eos_token_id", 2);
  if (bos >= n || eos >= n) return DataLoss("tokenizer: BOS/EOS id outside the vocabulary");
  return MakeSpmBpeTokenizer(StringArray(*toks), types, {}, scores, static_cast<int>(bos), static_cast<int>(eos),
                             f.GetBoolOr("tokenizer.ggml.add_bos_token", true),
                             f.GetBoolOr("tokenizer.ggml.add_space_prefix", true));
}
}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromGguf(const GgufFile& f) {
  QKV_ASSIGN_OR_RETURN(std::string model, f.GetString("tokenizer.ggml.model"));
  if (model == "llama") return LoadSpmFromGguf(f);
  if (model != "gpt2") {
    return Unimplemented("tokenizer: tokenizer.ggml.model '" + model + "' is not supported yet (supported: gpt2)");
  }
  const std::string pre = f.GetStringOr("tokenizer.ggml.pre", "default");
  std::string pattern;
  bool ignore_merges = false;
  if (pre == "default" || pre == "gpt2" || pre == "gpt-2") {
    pattern = kGpt2Pattern;
  } else if (pre == "llama-bpe" || pre == "llama3") {
    pattern = kLlama3Pattern;
    ignore_merges = true;  // as llama.cpp does for Llama 3
  } else if (pre == "qwen2") {
    pattern = kQwen2Pattern;
  } else {
    return Unimplemented("tokenizer: pre-tokenizer '" + pre +
                         "' is not supported (supported: default, gpt-2, llama-bpe, qwen2)");
  }
  const GgufValue* toks = f.Find("tokenizer.ggml.tokens");
  if (!toks || toks->type != GgufType::kArray || toks->array_type != GgufType::kString || toks->array.empty()) {
    return DataLoss("tokenizer: 'tokenizer.ggml.tokens' must be a non-empty string array");
  }
  std::vector<int32_t> types;
  if (const GgufValue* tt = f.Find("tokenizer.ggml.token_type")) {
    if (tt->type != GgufType::kArray || (!tt->array.empty() && !tt->array[0].is_integer()) ||
        tt->array.size() != toks->array.size()) {
      return DataLoss("tokenizer: 'tokenizer.ggml.token_type' must be an integer array as long as the tokens");
    }
    for (const GgufValue& e : tt->array) types.push_back(static_cast<int32_t>(e.i));
  }
  std::vector<std::string> merges;
  if (const GgufValue* m = f.Find("tokenizer.ggml.merges")) {
    if (m->type != GgufType::kArray || m->array_type != GgufType::kString) {
      return DataLoss("tokenizer: 'tokenizer.ggml.merges' must be a string array");
    }
    merges = StringArray(*m);
  }
  const int n = static_cast<int>(toks->array.size());
  const int64_t eos = f.GetIntOr("tokenizer.ggml.eos_token_id", -1);
  const int64_t bos = f.GetIntOr("tokenizer.ggml.bos_token_id", eos);
  if (eos >= n || bos >= n || eos < -1 || bos < -1) return DataLoss("tokenizer: BOS/EOS id outside the vocabulary");
  const bool add_bos = f.GetBoolOr("tokenizer.ggml.add_bos_token", false);
  return MakeByteBpeTokenizer(StringArray(*toks), types, merges, static_cast<int>(bos), static_cast<int>(eos), add_bos,
                              pattern, ignore_merges);
}

namespace {
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromJsonUnchecked(const std::string& path);
}  // namespace

// A field of the wrong type makes nlohmann::json throw: that is an error message, never a terminate.
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromJson(const std::string& path) {
  try {
    return LoadTokenizerFromJsonUnchecked(path);
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument("tokenizer: '" + path + "' has a field of the wrong shape: " + e.what());
  }
}

namespace {
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromJsonUnchecked(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("tokenizer: cannot read '" + path + "'");
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgument("tokenizer: '" + path + "' is not JSON");
  if (!j.contains("model") || !j["model"].is_object()) return InvalidArgument("tokenizer: no 'model' object");
  const auto& m = j["model"];
  if (m.value("type", "") != "BPE") return Unimplemented("tokenizer: only BPE models are supported");
  if (!m.contains("vocab") || !m["vocab"].is_object())
    return InvalidArgument("tokenizer: model.vocab must be an object");
  // Vocabulary by id, added tokens included.
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  auto put = [&](int64_t id, const std::string& s, int type) -> Status {
    if (id < 0 || id > (1 << 22)) return InvalidArgument("tokenizer: token id out of range");
    if (static_cast<int64_t>(tokens.size()) <= id) {
      tokens.resize(id + 1);
      types.resize(id + 1, 1);
    }
    tokens[id] = s;
    types[id] = type;
    return {};
  };
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    if (!it.value().is_number_integer()) return InvalidArgument("tokenizer: vocab ids must be integers");
    QKV_RETURN_IF_ERROR(put(it.value().get<int64_t>(), it.key(), 1));
  }
  int eos = -1, bos = -1;
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const auto& a : j["added_tokens"]) {
      const std::string content = a.value("content", "");
      const int64_t id = a.value("id", -1);
      QKV_RETURN_IF_ERROR(put(id, content, a.value("special", false) ? 3 : 4));
      if (content == "<|endoftext|>" || content == "<|end_of_text|>" || content == "</s>") {
        if (eos < 0) eos = static_cast<int>(id);
      }
      if (content == "<|begin_of_text|>" || content == "<s>") bos = static_cast<int>(id);
    }
  }
  // tokenizer_config.json beside the file, when present, names BOS/EOS and whether BOS is added.
  bool add_bos_cfg = false, have_add_bos = false;
  {
    const size_t slash = path.find_last_of('/');
    const std::string cfg_path =
        (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + "tokenizer_config.json";
    std::ifstream cin(cfg_path);
    const auto c = cin ? nlohmann::json::parse(cin, nullptr, false) : nlohmann::json();
    if (c.is_object()) {
      auto token_id = [&](const char* key) -> int {
        if (!c.contains(key)) return -1;
        const auto& v = c[key];
        const std::string content =
            v.is_string() ? v.get<std::string>() : (v.is_object() ? v.value("content", "") : "");
        for (size_t i = 0; i < tokens.size(); ++i) {
          if (!content.empty() && tokens[i] == content) return static_cast<int>(i);
        }
        return -1;
      };
      if (int e = token_id("eos_token"); e >= 0) eos = e;
      if (int b = token_id("bos_token"); b >= 0) bos = b;
      if (c.contains("add_bos_token") && c["add_bos_token"].is_boolean()) {
        have_add_bos = true;
        add_bos_cfg = c["add_bos_token"].get<bool>();
      }
    }
  }
  std::vector<std::string> merges;
  if (m.contains("merges") && m["merges"].is_array()) {
    for (const auto& mg : m["merges"]) {
      if (mg.is_string())
        merges.push_back(mg.get<std::string>());
      else if (mg.is_array() && mg.size() == 2)
        merges.push_back(mg[0].get<std::string>() + " " + mg[1].get<std::string>());
      else
        return InvalidArgument("tokenizer: malformed merge");
    }
  }
  // Pre-tokenizer: a Split with a Regex (alone or in a Sequence), else ByteLevel's own GPT-2 regex.
  std::string pattern = kGpt2Pattern;
  std::function<void(const nlohmann::json&)> scan = [&](const nlohmann::json& p) {
    if (!p.is_object()) return;
    if (p.value("type", "") == "Sequence" && p.contains("pretokenizers")) {
      for (const auto& q : p["pretokenizers"]) scan(q);
    } else if (p.value("type", "") == "Split" && p.contains("pattern") && p["pattern"].contains("Regex")) {
      pattern = p["pattern"]["Regex"].get<std::string>();
    }
  };
  if (j.contains("pre_tokenizer")) scan(j["pre_tokenizer"]);
  // Normalizer types, flattened out of any Sequence: "Prepend" (SentencePiece's "▁"), "NFC".
  std::set<std::string> normalizers;
  std::function<void(const nlohmann::json&)> scan_norm = [&](const nlohmann::json& n) {
    if (!n.is_object()) return;
    normalizers.insert(n.value("type", ""));
    if (n.value("type", "") == "Sequence" && n.contains("normalizers")) {
      for (const auto& q : n["normalizers"]) scan_norm(q);
    }
  };
  if (j.contains("normalizer")) scan_norm(j["normalizer"]);
  if (m.value("byte_fallback", false)) {  // SentencePiece-style (Llama 2): "▁" for spaces, byte fallback
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] == "<unk>") types[i] = 2;
    }
    return MakeSpmBpeTokenizer(tokens, types, merges, {}, bos, eos, have_add_bos ? add_bos_cfg : bos >= 0,
                               normalizers.count("Prepend") > 0);
  }
  return MakeByteBpeTokenizer(tokens, types, merges, bos >= 0 ? bos : eos, eos,
                              have_add_bos ? add_bos_cfg : (bos >= 0 && bos != eos), pattern,
                              m.value("ignore_merges", false), normalizers.count("NFC") > 0);
}
}  // namespace

void BpeVocab::ToGguf(GgufWriter& w) const {
  w.SetString("tokenizer.ggml.model", "gpt2");
  w.SetString("tokenizer.ggml.pre", "gpt-2");  // llama.cpp's name for the GPT-2 pre-tokenizer
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetI32Array("tokenizer.ggml.token_type", types);
  w.SetStringArray("tokenizer.ggml.merges", merges);
  w.SetU32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(eos_id));
  w.SetU32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(eos_id));
  w.SetBool("tokenizer.ggml.add_bos_token", false);
}

StatusOr<BpeVocab> MakeSyntheticByteBpe(int vocab_size, uint64_t seed) {
  if (vocab_size < 257) return InvalidArgument("vocab_size must be at least 257 for a byte-level BPE vocabulary");
  BpeVocab v;
  const auto& b2u = ByteToUnicode();
  for (int b = 0; b < 256; ++b) v.tokens.push_back(b2u[b]);
  std::unordered_set<std::string> have(v.tokens.begin(), v.tokens.end());
  const std::string space = b2u[' '];
  std::vector<int> words;  // ids of tokens that are letters only
  for (int c = 'a'; c <= 'z'; ++c) words.push_back(c);
  for (int c = 'A'; c <= 'Z'; ++c) words.push_back(c);
  std::vector<int> heads = words;  // ids that may start a merge: letters and space-prefixed letters
  auto add = [&](int a, int b) {
    const std::string m = v.tokens[a] + v.tokens[b];
    v.merges.push_back(v.tokens[a] + " " + v.tokens[b]);
    v.tokens.push_back(m);
    have.insert(m);
    return static_cast<int>(v.tokens.size()) - 1;
  };
  const int n_merges = vocab_size - 257;
  // First " x" for every letter x, so that words after a space can grow.
  for (int w : std::vector<int>(words)) {
    if (static_cast<int>(v.merges.size()) >= n_merges) break;
    heads.push_back(add(' ', w));
  }
  std::mt19937_64 rng(seed);
  while (static_cast<int>(v.merges.size()) < n_merges) {
    const int a = heads[rng() % heads.size()];
    const int b = words[rng() % words.size()];
    if (v.tokens[a].size() + v.tokens[b].size() > 24) continue;
    if (have.count(v.tokens[a] + v.tokens[b])) continue;
    const int id = add(a, b);
    heads.push_back(id);
    if (v.tokens[a].rfind(space, 0) != 0) words.push_back(id);
  }
  v.types.assign(v.tokens.size(), 1);
  v.tokens.push_back("<|endoftext|>");
  v.types.push_back(3);
  v.eos_id = static_cast<int>(v.tokens.size()) - 1;
  return v;
}

}  // namespace qkv
