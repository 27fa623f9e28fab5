#include "engine/tokenizer.h"

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "engine/unicode_nfc.h"
#include "engine/utf8.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdio>
#include <queue>
#include <random>
#include <set>
#include <unordered_map>
#include <unordered_set>

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

class Pcre2Splitter {
 public:
  static StatusOr<std::unique_ptr<Pcre2Splitter>> Create(const char* pattern) {
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &off, nullptr);
    if (!code) return Internal("tokenizer: cannot compile pre-tokenizer regex");
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
    auto s = std::unique_ptr<Pcre2Splitter>(new Pcre2Splitter());
    s->code_ = code;
    return s;
  }
  ~Pcre2Splitter() { pcre2_code_free(code_); }

  // Calls fn(piece) for each pre-token; bytes the pattern does not match are passed through as pieces.
  template <typename Fn>
  void Split(std::string_view text, Fn&& fn) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t pos = 0;
    // Invalid UTF-8 would make PCRE2 refuse the subject: validate once and fall back to byte pieces.
    const bool valid = IsValidUtf8(text);
    while (pos < text.size()) {
      if (!valid) {
        fn(text.substr(pos));
        break;
      }
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos, PCRE2_NO_UTF_CHECK,
                                 md, nullptr);
      if (rc < 0) {
        fn(text.substr(pos));
        break;
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[0] > pos) fn(text.substr(pos, ov[0] - pos));
      if (ov[1] == ov[0]) {  // empty match: advance one code point
        size_t n = 1;
        while (ov[0] + n < text.size() && (static_cast<unsigned char>(text[ov[0] + n]) & 0xC0) == 0x80) ++n;
        fn(text.substr(ov[0], n));
        pos = ov[0] + n;
      } else {
        fn(text.substr(ov[0], ov[1] - ov[0]));
        pos = ov[1];
      }
    }
    pcre2_match_data_free(md);
  }

 private:
  Pcre2Splitter() = default;
  pcre2_code* code_ = nullptr;
};

// What both BPE tokenizers share: per-token bytes, the special/added tokens, and the splitting of text on
// special-token text (only when the caller asks) around the family's own encoding of ordinary text.
class VocabTokenizer : public Tokenizer {
 public:
  std::vector<int> Encode(std::string_view raw_text, bool parse_special) const final {
    std::vector<int> out;
    std::string normalized;
    if (nfc_) normalized = NfcNormalize(raw_text);
    const std::string_view text = nfc_ ? std::string_view(normalized) : raw_text;
    if (!parse_special || specials_.empty()) {
      EncodeOrdinary(text, out, /*first=*/true);
      return out;
    }
    size_t pos = 0;
    bool first = true;
    // Each special's next occurrence is searched again only once pos has passed it, so the scans advance
    // monotonically: O(text × specials) in all, not per special token found.
    std::vector<size_t> next_at(specials_.size(), 0);
    std::vector<bool> searched(specials_.size(), false);
    while (pos < text.size()) {
      size_t best = std::string_view::npos, best_len = 0;
      int best_id = -1;
      for (size_t k = 0; k < specials_.size(); ++k) {
        const auto& [sp, id] = specials_[k];
        if (!searched[k] || (next_at[k] != std::string_view::npos && next_at[k] < pos)) {
          next_at[k] = text.find(sp, pos);
          searched[k] = true;
        }
        const size_t f = next_at[k];
        if (f != std::string_view::npos && (f < best || (f == best && sp.size() > best_len))) {
          best = f;
          best_id = id;
          best_len = sp.size();
        }
      }
      if (best == std::string_view::npos) {
        EncodeOrdinary(text.substr(pos), out, first);
        break;
      }
      EncodeOrdinary(text.substr(pos, best - pos), out, first);
      out.push_back(best_id);
      first = false;
      pos = best + best_len;
    }
    return out;
  }

  const std::string& TokenBytes(int id) const final {
    static const std::string kEmpty;
    return id >= 0 && id < static_cast<int>(bytes_.size()) ? bytes_[id] : kEmpty;
  }
  int vocab_size() const final { return static_cast<int>(bytes_.size()); }
  bool IsSpecial(int id) const final { return id >= 0 && id < vocab_size() && special_[id]; }

 protected:
  static uint64_t Key(int a, int b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

  // BPE merging in O(n log n): symbols in a linked list, candidate pairs in a heap ordered by priority
  // (lower first), then by position (leftmost first), stale candidates skipped when popped. The same
  // merges as repeatedly merging the best adjacent pair, without rescanning the word after each merge.
  // merge(a, b, &prio, &merged) says whether symbols a, b merge. Appends the final symbols to out.
  template <typename Prio, typename MergeFn>
  static void MergePairs(std::vector<int>& sym, const MergeFn& merge, std::vector<int>& out) {
    const int n = static_cast<int>(sym.size());
    std::vector<int> prev(n), next(n);
    for (int i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
    }
    struct Cand {
      Prio prio;
      int left, right, a, b, merged;
      bool operator>(const Cand& o) const { return prio > o.prio || (prio == o.prio && left > o.left); }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> q;
    auto push = [&](int l) {
      if (l < 0 || next[l] < 0) return;
      Prio p;
      int m;
      if (merge(sym[l], sym[next[l]], &p, &m)) q.push({p, l, next[l], sym[l], sym[next[l]], m});
    };
    for (int i = 0; i + 1 < n; ++i) push(i);
    while (!q.empty()) {
      const Cand c = q.top();
      q.pop();
      const int r = next[c.left];
      if (r != c.right || sym[c.left] != c.a || sym[r] != c.b) continue;  // stale
      sym[c.left] = c.merged;
      sym[r] = -1;
      next[c.left] = next[r];
      if (next[r] >= 0) prev[next[r]] = c.left;
      push(prev[c.left]);
      push(c.left);
    }
    for (int i = n > 0 ? 0 : -1; i >= 0; i = next[i]) out.push_back(sym[i]);
  }
  // Encodes text holding no special token; `first` is true for the first segment of the input.
  virtual void EncodeOrdinary(std::string_view text, std::vector<int>& out, bool first) const = 0;
  // Longest specials first so that overlapping ones match greedily.
  void SortSpecials() {
    std::sort(specials_.begin(), specials_.end(),
              [](const auto& x, const auto& y) { return x.first.size() > y.first.size(); });
  }

  std::vector<std::string> bytes_;
  std::vector<bool> special_;
  std::vector<std::pair<std::string, int>> specials_;
  bool nfc_ = false;  // NFC-normalize input first (tokenizer.json "NFC" normalizer)
};
// Byte-level BPE over token ids: each byte starts as its byte token; the lowest-ranked adjacent pair
// is merged until no pair has a rank.
class ByteBpeTokenizer final : public VocabTokenizer {
 public:
  // tokens in GPT-2's byte alphabet; types 3/4 mark special/added tokens; merges "a b" in rank order;
  // pattern: the pre-tokenizer regex; ignore_merges: a pre-token that is itself a token is emitted whole.
  static StatusOr<std::unique_ptr<Tokenizer>> Create(const std::vector<std::string>& tokens,
                                                     const std::vector<int32_t>& types,
                                                     const std::vector<std::string>& merges, int bos, int eos,
                                                     bool add_bos, const std::string& pattern, bool ignore_merges,
                                                     bool nfc = false) {
    auto t = std::unique_ptr<ByteBpeTokenizer>(new ByteBpeTokenizer());
    t->nfc_ = nfc;
    QKV_ASSIGN_OR_RETURN(t->splitter_, Pcre2Splitter::Create(pattern.c_str()));
    t->ignore_merges_ = ignore_merges;
    const int n = static_cast<int>(tokens.size());
    // Reverse of ByteToUnicode.
    std::unordered_map<std::string, uint8_t> unicode_to_byte;
    for (int b = 0; b < 256; ++b) unicode_to_byte[ByteToUnicode()[b]] = static_cast<uint8_t>(b);
    t->bytes_.resize(n);
    t->special_.assign(n, false);
    std::unordered_map<std::string, int> id_of;
    for (int i = 0; i < n; ++i) {
      const std::string& s = tokens[i];
      const int type = i < static_cast<int>(types.size()) ? types[i] : 1;
      if (type == 3 || type == 4) {  // control / user-defined: text as is
        t->special_[i] = true;
        t->bytes_[i] = s;
        if (!s.empty()) t->specials_.emplace_back(s, i);
      } else {
        std::string raw;
        size_t p = 0;
        while (p < s.size()) {
          size_t len = 1;
          while (p + len < s.size() && (static_cast<unsigned char>(s[p + len]) & 0xC0) == 0x80) ++len;
          auto it = unicode_to_byte.find(s.substr(p, len));
          if (it == unicode_to_byte.end()) {
            raw = s;  // not in the byte alphabet: keep the text (as llama.cpp does for such tokens)
            break;
          }
          raw += static_cast<char>(it->second);
          p += len;
        }
        t->bytes_[i] = raw;
        if (ignore_merges) t->whole_.emplace(raw, i);
      }
      id_of.emplace(s, i);
    }
    for (int b = 0; b < 256; ++b) {
      auto it = id_of.find(ByteToUnicode()[b]);
      if (it == id_of.end()) {
        return DataLoss("tokenizer: byte-level BPE vocabulary lacks the token for byte " + std::to_string(b));
      }
      t->byte_token_[b] = it->second;
    }
    for (size_t r = 0; r < merges.size(); ++r) {
      const std::string& m = merges[r];
      const size_t sp = m.find(' ', 1);
      if (sp == std::string::npos) return DataLoss("tokenizer: malformed merge #" + std::to_string(r));
      const std::string a = m.substr(0, sp), b = m.substr(sp + 1);
      auto ia = id_of.find(a), ib = id_of.find(b), im = id_of.find(a + b);
      if (ia == id_of.end() || ib == id_of.end() || im == id_of.end()) continue;  // unusable merge
      t->merge_.emplace(Key(ia->second, ib->second), std::make_pair(static_cast<int>(r), im->second));
    }
    t->SortSpecials();
    t->bos_id_ = bos;
    t->eos_id_ = eos;
    t->add_bos_ = add_bos;
    return std::unique_ptr<Tokenizer>(std::move(t));
  }

 private:
  void EncodeOrdinary(std::string_view text, std::vector<int>& out, bool /*first*/) const override {
    if (text.empty()) return;
    std::vector<int> sym;
    splitter_->Split(text, [&](std::string_view piece) {
      if (ignore_merges_) {
        auto it = whole_.find(std::string(piece));
        if (it != whole_.end()) {
          out.push_back(it->second);
          return;
        }
      }
      sym.clear();
      for (char c : piece) sym.push_back(byte_token_[static_cast<unsigned char>(c)]);
      MergePairs<int>(
          sym,
          [this](int a, int b, int* rank, int* merged) {
            auto it = merge_.find(Key(a, b));
            if (it == merge_.end()) return false;
            *rank = it->second.first;
            *merged = it->second.second;
            return true;
          },
          out);
    });
  }

  std::unique_ptr<Pcre2Splitter> splitter_;
  int byte_token_[256] = {};
  std::unordered_map<uint64_t, std::pair<int, int>> merge_;  // (a, b) -> (rank, merged id)
  bool ignore_merges_ = false;
  std::unordered_map<std::string, int> whole_;  // raw bytes -> id, for ignore_merges
};

// SentencePiece-style BPE (Llama 1/2): spaces become U+2581 ("▁"), a "▁" is prepended, the text is split
// into characters (unknown ones fall back to <0xXX> byte tokens), and adjacent symbols are merged in
// priority order (merge rank from tokenizer.json, or the merged token's score from GGUF), equal priorities
// left to right.
class SpmBpeTokenizer final : public VocabTokenizer {
 public:
  // merges: rank order (tokenizer.json); scores: per token (GGUF). Exactly one is used: merges if given.
  static StatusOr<std::unique_ptr<Tokenizer>> Create(const std::vector<std::string>& tokens,
                                                     const std::vector<int32_t>& types,
                                                     const std::vector<std::string>& merges,
                                                     const std::vector<float>& scores, int bos, int eos, bool add_bos,
                                                     bool add_prefix) {
    auto t = std::unique_ptr<SpmBpeTokenizer>(new SpmBpeTokenizer());
    const int n = static_cast<int>(tokens.size());
    t->bytes_.resize(n);
    t->special_.assign(n, false);
    for (int b = 0; b < 256; ++b) t->byte_token_[b] = -1;
    for (int i = 0; i < n; ++i) {
      const std::string& s = tokens[i];
      const int type = i < static_cast<int>(types.size()) ? types[i] : 1;
      unsigned int byte = 0;
      if (s.size() == 6 && s.compare(0, 3, "<0x") == 0 && s[5] == '>' &&
          std::sscanf(s.c_str() + 3, "%2x", &byte) == 1) {
        t->byte_token_[byte] = i;
        t->bytes_[i] = std::string(1, static_cast<char>(byte));
        continue;
      }
      if (type == 2 || type == 3 || type == 4) {  // unknown / control / user-defined
        t->special_[i] = true;
        t->bytes_[i] = s;
        if (!s.empty() && type != 2) t->specials_.emplace_back(s, i);
      } else {
        std::string raw;
        for (size_t p = 0; p < s.size();) {
          if (s.compare(p, 3, "\xE2\x96\x81") == 0) {
            raw += ' ';
            p += 3;
          } else {
            raw += s[p++];
          }
        }
        t->bytes_[i] = raw;
      }
      t->id_of_.emplace(s, i);
    }
    if (!merges.empty()) {
      for (size_t r = 0; r < merges.size(); ++r) {
        const size_t sp = merges[r].find(' ', 1);
        if (sp == std::string::npos) return DataLoss("tokenizer: malformed merge #" + std::to_string(r));
        auto a = t->id_of_.find(merges[r].substr(0, sp)), b = t->id_of_.find(merges[r].substr(sp + 1));
        auto m = t->id_of_.find(merges[r].substr(0, sp) + merges[r].substr(sp + 1));
        if (a == t->id_of_.end() || b == t->id_of_.end() || m == t->id_of_.end()) continue;
        t->merge_.emplace(Key(a->second, b->second), std::make_pair(static_cast<float>(r), m->second));
      }
    } else {
      t->scores_ = scores;
      t->scores_.resize(n, 0.0f);
      t->text_ = tokens;
    }
    t->SortSpecials();
    t->bos_id_ = bos;
    t->eos_id_ = eos;
    t->add_bos_ = add_bos;
    t->add_prefix_ = add_prefix;
    return std::unique_ptr<Tokenizer>(std::move(t));
  }

 private:
  // Priority of merging symbols a and b (lower first) and the merged id; false if they cannot merge.
  bool Merge(int a, int b, float* prio, int* merged) const {
    if (!merge_.empty()) {
      auto it = merge_.find(Key(a, b));
      if (it == merge_.end()) return false;
      *prio = it->second.first;
      *merged = it->second.second;
      return true;
    }
    if (text_.empty() || a >= static_cast<int>(text_.size()) || b >= static_cast<int>(text_.size())) return false;
    auto it = id_of_.find(text_[a] + text_[b]);
    if (it == id_of_.end()) return false;
    *prio = -scores_[it->second];
    *merged = it->second;
    return true;
  }

  void EncodeOrdinary(std::string_view text, std::vector<int>& out, bool prefix) const override {
    if (text.empty()) return;
    std::string norm;
    if (add_prefix_ && prefix) norm = "\xE2\x96\x81";
    for (char c : text) {
      if (c == ' ')
        norm += "\xE2\x96\x81";
      else
        norm += c;
    }
    // Characters to symbols (byte fallback for characters outside the vocabulary).
    std::vector<int> sym;
    for (size_t i = 0; i < norm.size();) {
      size_t len = Utf8SequenceLength(norm, i);
      if (len == 0) len = 1;
      auto it = id_of_.find(norm.substr(i, len));
      if (it != id_of_.end()) {
        sym.push_back(it->second);
      } else {
        for (size_t k = 0; k < len; ++k) {
          const int bt = byte_token_[static_cast<unsigned char>(norm[i + k])];
          if (bt >= 0) sym.push_back(bt);
        }
      }
      i += len;
    }
    MergePairs<float>(
        sym, [this](int a, int b, float* prio, int* merged) { return Merge(a, b, prio, merged); }, out);
  }

  std::unordered_map<std::string, int> id_of_;
  std::unordered_map<uint64_t, std::pair<float, int>> merge_;
  std::vector<float> scores_;
  std::vector<std::string> text_;
  int byte_token_[256];
  bool add_prefix_ = true;
};

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
  return SpmBpeTokenizer::Create(StringArray(*toks), types, {}, scores, static_cast<int>(bos), static_cast<int>(eos),
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
  return ByteBpeTokenizer::Create(StringArray(*toks), types, merges, static_cast<int>(bos), static_cast<int>(eos),
                                  add_bos, pattern, ignore_merges);
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
    return SpmBpeTokenizer::Create(tokens, types, merges, {}, bos, eos, have_add_bos ? add_bos_cfg : bos >= 0,
                                   normalizers.count("Prepend") > 0);
  }
  return ByteBpeTokenizer::Create(tokens, types, merges, bos >= 0 ? bos : eos, eos,
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
