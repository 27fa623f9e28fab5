// SentencePiece-style BPE with byte fallback (Llama 1/2).
#include <unordered_map>

#include "engine/tokenizer_bpe.h"
#include "engine/utf8.h"

namespace qkv {
namespace {

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

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> MakeSpmBpeTokenizer(const std::vector<std::string>& tokens,
                                                         const std::vector<int32_t>& types,
                                                         const std::vector<std::string>& merges,
                                                         const std::vector<float>& scores, int bos, int eos,
                                                         bool add_bos, bool add_prefix) {
  return SpmBpeTokenizer::Create(tokens, types, merges, scores, bos, eos, add_bos, add_prefix);
}

}  // namespace qkv
