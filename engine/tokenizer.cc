#include "engine/tokenizer.h"

#include <algorithm>
#include <cctype>
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
// Qwen3.5: as Qwen2 with combining marks (\p{M}) kept on their letters.
constexpr const char* kQwen35Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// Mistral's Tekken (Mistral Nemo, Mistral Small 3): words split at lower-to-upper case changes, single digits.
constexpr const char* kTekkenPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// OpenAI's o200k (GPT-4o; llama.cpp's "gpt-4o", "llama4"): Tekken's case split with contractions, digit runs of
// up to three.
constexpr const char* kGpt4oPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// DeepSeek V3/R1 (tokenizer.json: a Sequence of three Isolated splits).
constexpr const char* kDeepseek3Patterns[] = {
    R"(\p{N}{1,3})",
    R"([\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+)",
    R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
};
// DeepSeek LLM and V2 (llama.cpp's "deepseek-llm"): newlines, then runs of (cased) letters, ASCII and full-width
// punctuation, trailing whitespace, CJK and Hangul, digits, each split in turn.
constexpr const char* kDeepseekLlmPatterns[] = {
    R"([\r\n])",
    R"(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF})"
    R"(\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5})"
    R"(\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA})"
    R"(\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D})"
    R"(\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4})"
    R"(\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC})"
    R"(\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126})"
    R"(\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184})"
    R"(\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B})"
    R"(\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17})"
    R"(\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2})"
    R"(\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)",
    R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)",
    R"(\s+$)",
    R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)",
    R"(\p{N}+)",
};

// llama.cpp's `tokenizer.ggml.pre` names for byte-level BPE (src/llama-vocab.cpp), with the regexes the model's
// own tokenizer.json uses (llama.cpp adapts some to its regex engine; PCRE2 runs the originals). add_bos is
// llama.cpp's default when the file has no `tokenizer.ggml.add_bos_token`.
struct PreTokenizer {
  std::vector<const char*> names;
  std::vector<PreSplit> splits;
  bool ignore_merges = false;
  bool add_bos = false;
};
const std::vector<PreTokenizer>& PreTokenizers() {
  static const std::vector<PreTokenizer> table = {
      // "default" is also what a file without the key gets. llama.cpp's own fallback for it is a regex list no
      // model was trained with; GPT-2's is the model's own for the files that predate the key.
      {{"default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "exaone4", "roberta-bpe"}, {kGpt2Pattern}},
      {{"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"}, {kLlama3Pattern}, true, true},
      {{"dbrx", "smaug-bpe"}, {kLlama3Pattern}},
      {{"qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"}, {kQwen2Pattern}},
      {{"qwen35"}, {kQwen35Pattern}},
      {{"tekken"}, {kTekkenPattern}, true, true},
      {{"gpt-4o", "llama4"}, {kGpt4oPattern}},
      {{"deepseek-v3"}, {std::begin(kDeepseek3Patterns), std::end(kDeepseek3Patterns)}},
      {{"deepseek-llm"}, {std::begin(kDeepseekLlmPatterns), std::end(kDeepseekLlmPatterns)}},
      // SmolLM, StarCoder: every digit alone, then GPT-2's regex (tokenizer.json: Digits, then ByteLevel's regex).
      {{"smollm", "starcoder", "refact", "command-r", "codeshell"}, {R"(\p{N})", kGpt2Pattern}},
  };
  return table;
}

std::string PreTokenizerNames() {
  std::string s;
  for (const PreTokenizer& p : PreTokenizers()) {
    for (const char* n : p.names) s += (s.empty() ? "" : ", ") + std::string(n);
  }
  return s;
}

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

bool Tokenizer::IsEndOfGeneration(int id) const { return std::binary_search(eog_ids_.begin(), eog_ids_.end(), id); }

void Tokenizer::SetEndOfGeneration(const std::vector<int>& extra) {
  // llama.cpp's list of end-of-turn texts (src/llama-vocab.cpp, special_eog_ids), for the models whose files
  // name only EOS: a Qwen base model's EOS is <|endoftext|> while its chat turns end with <|im_end|>; Llama 3.1
  // ends a tool call with <|eom_id|>.
  static const std::set<std::string> kTexts = {"<|eot_id|>",
                                               "<|im_end|>",
                                               "<|end|>",
                                               "<|return|>",
                                               "<|call|>",
                                               "<|flush|>",
                                               "<|calls|>",
                                               "<end_of_turn>",
                                               "<|endoftext|>",
                                               "</s>",
                                               "<|eom_id|>",
                                               "<EOT>",
                                               "_<EOT>",
                                               "[EOT]",
                                               "[EOS]",
                                               "<|end_of_text|>",
                                               "<end_of_utterance>",
                                               "<eos>",
                                               "<turn|>",
                                               "<|tool_response>",
                                               "<｜end▁of▁sentence｜>",
                                               "[e~["};
  std::set<int> ids;
  if (eos_id_ >= 0) ids.insert(eos_id_);
  for (int id : extra) {
    if (id >= 0 && id < vocab_size()) ids.insert(id);
  }
  for (int id = 0; id < vocab_size(); ++id) {
    const std::string& t = TokenBytes(id);
    if (t.size() >= 3 && t.size() <= 32 && kTexts.count(t)) ids.insert(id);
  }
  eog_ids_.assign(ids.begin(), ids.end());
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

namespace {
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromGgufNoEog(const GgufFile& f);
}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromGguf(const GgufFile& f) {
  QKV_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> t, LoadTokenizerFromGgufNoEog(f));
  std::vector<int> extra;
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    const int64_t id = f.GetIntOr(key, -1);
    if (id >= t->vocab_size()) return DataLoss(std::string("tokenizer: '") + key + "' is outside the vocabulary");
    if (id >= 0) extra.push_back(static_cast<int>(id));
  }
  t->SetEndOfGeneration(extra);
  return t;
}

namespace {
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromGgufNoEog(const GgufFile& f) {
  QKV_ASSIGN_OR_RETURN(std::string model, f.GetString("tokenizer.ggml.model"));
  if (model == "llama") return LoadSpmFromGguf(f);
  if (model != "gpt2") {
    return Unimplemented("tokenizer: tokenizer.ggml.model '" + model + "' is not supported yet (supported: gpt2)");
  }
  const std::string pre = f.GetStringOr("tokenizer.ggml.pre", "default");
  const PreTokenizer* pt = nullptr;
  for (const PreTokenizer& p : PreTokenizers()) {
    for (const char* n : p.names) {
      if (pre == n) pt = &p;
    }
  }
  if (!pt) {
    return Unimplemented("tokenizer: tokenizer.ggml.pre '" + pre +
                         "' is not supported (supported: " + PreTokenizerNames() + ")");
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
  const bool add_bos = f.GetBoolOr("tokenizer.ggml.add_bos_token", pt->add_bos);
  return MakeByteBpeTokenizer(StringArray(*toks), types, merges, static_cast<int>(bos), static_cast<int>(eos), add_bos,
                              pt->splits, pt->ignore_merges);
}
}  // namespace

namespace {
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromJsonUnchecked(const std::string& path);
}  // namespace

// A field of the wrong type makes nlohmann::json throw: that is an error message, never a terminate.
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromJson(const std::string& path) {
  try {
    QKV_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> t, LoadTokenizerFromJsonUnchecked(path));
    // generation_config.json beside it: eos_token_id, one id or a list (Llama 3.1: end of text, message, turn).
    std::vector<int> extra;
    const size_t slash = path.find_last_of('/');
    std::ifstream gin((slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) +
                      "generation_config.json");
    const auto g = gin ? nlohmann::json::parse(gin, nullptr, false) : nlohmann::json();
    if (g.is_object() && g.contains("eos_token_id")) {
      const nlohmann::json& e = g["eos_token_id"];
      for (const nlohmann::json& id : e.is_array() ? e : nlohmann::json::array({e})) {
        if (id.is_number_integer()) extra.push_back(id.get<int>());
      }
    }
    t->SetEndOfGeneration(extra);
    return t;
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
  // Pre-tokenizer, in order: Split (a Regex or a literal String), Digits, ByteLevel (its GPT-2 regex when
  // use_regex), alone or in a Sequence. Anything else is refused below for byte-level BPE rather than skipped:
  // a skipped split tokenizes differently from the model's training without a word.
  std::vector<PreSplit> splits;
  bool any_pre = false;
  std::string unsupported;
  std::function<void(const nlohmann::json&)> scan = [&](const nlohmann::json& p) {
    if (!p.is_object()) return;
    any_pre = true;
    const std::string type = p.value("type", "");
    if (type == "Sequence" && p.contains("pretokenizers")) {
      for (const auto& q : p["pretokenizers"]) scan(q);
    } else if (type == "Split" && p.contains("pattern")) {
      const nlohmann::json& pat = p["pattern"];
      std::string re;
      if (pat.contains("Regex")) {
        re = pat["Regex"].get<std::string>();
      } else if (pat.contains("String")) {
        for (char c : pat["String"].get<std::string>()) {
          if (static_cast<unsigned char>(c) < 0x80 && !std::isalnum(static_cast<unsigned char>(c))) re += '\\';
          re += c;
        }
      } else {
        unsupported = "a Split without a Regex or String pattern";
        return;
      }
      const std::string behavior = p.value("behavior", "Isolated");
      const bool invert = p.value("invert", false);
      if (behavior == "Isolated" && !invert)
        splits.emplace_back(re);
      else if (behavior == "Removed" && invert)  // the matches are the pieces; the text between them goes
        splits.emplace_back(re, true);
      else
        unsupported = "a Split with behavior '" + behavior + "'" + (invert ? " and invert" : "");
    } else if (type == "Digits") {
      splits.emplace_back(p.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)");
    } else if (type == "ByteLevel") {
      if (p.value("add_prefix_space", false)) unsupported = "ByteLevel with add_prefix_space";
      if (p.value("use_regex", true)) splits.emplace_back(kGpt2Pattern);
    } else {
      unsupported = "'" + type + "'";
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
  if (!unsupported.empty()) {
    return Unimplemented("tokenizer: '" + path + "': pre_tokenizer " + unsupported +
                         " is not supported for byte-level BPE (supported: Split with a Regex or String, Isolated "
                         "or Removed with invert; Digits; ByteLevel; a Sequence of them)");
  }
  for (const std::string& n : normalizers) {
    if (n != "" && n != "Sequence" && n != "NFC") {
      return Unimplemented("tokenizer: '" + path + "': normalizer '" + n +
                           "' is not supported for byte-level BPE (supported: NFC, a Sequence of it)");
    }
  }
  if (!any_pre) splits.emplace_back(kGpt2Pattern);        // no pre_tokenizer at all: GPT-2's regex, as before
  if (splits.empty()) splits.emplace_back(R"([\s\S]+)");  // ByteLevel without its regex alone: the text whole
  return MakeByteBpeTokenizer(tokens, types, merges, bos >= 0 ? bos : eos, eos,
                              have_add_bos ? add_bos_cfg : (bos >= 0 && bos != eos), splits,
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
