// Byte-level BPE: pre-tokenizer regexes (PCRE2 with UTF and Unicode properties) applied in turn, byte
// tokens merged by rank.
#include <unordered_map>

#include "engine/tokenizer_bpe.h"
#include "engine/utf8.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace qkv {
namespace {

// A sequence of pre-tokenizer regexes, each splitting every piece of the one before ("Isolated" splits, as
// tokenizers' Sequence of Split and llama.cpp's regex lists): matches and the text between them are pieces.
class Pcre2Splitter {
 public:
  static StatusOr<std::unique_ptr<Pcre2Splitter>> Create(const std::vector<PreSplit>& splits) {
    if (splits.empty()) return Internal("tokenizer: no pre-tokenizer regex");
    auto s = std::unique_ptr<Pcre2Splitter>(new Pcre2Splitter());
    for (const PreSplit& split : splits) {
      int err = 0;
      PCRE2_SIZE off = 0;
      pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(split.regex.data()), split.regex.size(),
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &off, nullptr);
      if (!code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return InvalidArgument("tokenizer: cannot compile pre-tokenizer regex at offset " + std::to_string(off) + ": " +
                               reinterpret_cast<const char*>(msg));
      }
      pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
      s->codes_.push_back(code);
      s->drop_.push_back(split.drop_unmatched);
    }
    return s;
  }
  ~Pcre2Splitter() {
    for (pcre2_code* c : codes_) pcre2_code_free(c);
  }

  // Calls fn(piece) for each pre-token; bytes a regex does not match are pieces too unless its split drops them.
  template <typename Fn>
  void Split(std::string_view text, Fn&& fn) const {
    // Invalid UTF-8 would make PCRE2 refuse the subject: validate once and fall back to one byte piece.
    if (!IsValidUtf8(text)) {
      if (!text.empty()) fn(text);
      return;
    }
    std::vector<pcre2_match_data*> md(codes_.size());  // one per level: a level's matching spans the next's
    for (size_t i = 0; i < codes_.size(); ++i) md[i] = pcre2_match_data_create_from_pattern(codes_[i], nullptr);
    SplitLevel(0, text, md, fn);
    for (pcre2_match_data* m : md) pcre2_match_data_free(m);
  }

 private:
  Pcre2Splitter() = default;

  template <typename Fn>
  void SplitLevel(size_t level, std::string_view text, const std::vector<pcre2_match_data*>& md, Fn& fn) const {
    auto emit = [&](std::string_view piece) {
      if (level + 1 == codes_.size())
        fn(piece);
      else
        SplitLevel(level + 1, piece, md, fn);
    };
    size_t pos = 0;
    while (pos < text.size()) {
      const int rc = pcre2_match(codes_[level], reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos,
                                 PCRE2_NO_UTF_CHECK, md[level], nullptr);
      if (rc < 0) {
        if (!drop_[level]) emit(text.substr(pos));
        break;
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md[level]);
      const size_t start = ov[0], end = ov[1];
      if (start > pos && !drop_[level]) emit(text.substr(pos, start - pos));
      if (end == start) {  // empty match: advance one code point
        size_t n = 1;
        while (start + n < text.size() && (static_cast<unsigned char>(text[start + n]) & 0xC0) == 0x80) ++n;
        emit(text.substr(start, n));
        pos = start + n;
      } else {
        emit(text.substr(start, end - start));
        pos = end;
      }
    }
  }

  std::vector<pcre2_code*> codes_;
  std::vector<bool> drop_;  // per level: the text between matches is dropped, not a piece
};

// Byte-level BPE over token ids: each byte starts as its byte token; the lowest-ranked adjacent pair
// is merged until no pair has a rank.
class ByteBpeTokenizer final : public VocabTokenizer {
 public:
  // tokens in GPT-2's byte alphabet; types 3/4 mark special/added tokens; merges "a b" in rank order;
  // splits: the pre-tokenizer regexes, applied in turn; ignore_merges: a pre-token that is itself a token is emitted
  // whole.
  static StatusOr<std::unique_ptr<Tokenizer>> Create(const std::vector<std::string>& tokens,
                                                     const std::vector<int32_t>& types,
                                                     const std::vector<std::string>& merges, int bos, int eos,
                                                     bool add_bos, const std::vector<PreSplit>& splits,
                                                     bool ignore_merges, bool nfc = false) {
    auto t = std::unique_ptr<ByteBpeTokenizer>(new ByteBpeTokenizer());
    t->nfc_ = nfc;
    QKV_ASSIGN_OR_RETURN(t->splitter_, Pcre2Splitter::Create(splits));
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

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> MakeByteBpeTokenizer(const std::vector<std::string>& tokens,
                                                          const std::vector<int32_t>& types,
                                                          const std::vector<std::string>& merges, int bos, int eos,
                                                          bool add_bos, const std::vector<PreSplit>& splits,
                                                          bool ignore_merges, bool nfc) {
  return ByteBpeTokenizer::Create(tokens, types, merges, bos, eos, add_bos, splits, ignore_merges, nfc);
}

}  // namespace qkv
