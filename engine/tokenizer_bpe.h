// Internal to the tokenizers: what both BPE families share (VocabTokenizer) and their factories. Not part
// of the engine's API; include tokenizer.h instead.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <queue>
#include <string>
#include <string_view>
#include <vector>

#include "engine/tokenizer.h"
#include "engine/unicode_nfc.h"

namespace qkv {

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

// One pre-tokenizer split: matches of `regex` and the text between them become pieces ("Isolated", as
// tokenizers' Split and llama.cpp's regex lists); with drop_unmatched the text between matches is dropped
// (tokenizers' "Removed" with invert).
struct PreSplit {
  PreSplit(std::string r, bool drop = false) : regex(std::move(r)), drop_unmatched(drop) {}  // NOLINT: implicit
  PreSplit(const char* r) : regex(r) {}                                                      // NOLINT: implicit
  std::string regex;
  bool drop_unmatched = false;
};

// Byte-level BPE (tokenizer_byte_bpe.cc): tokens in GPT-2's byte alphabet; types 3/4 mark special/added
// tokens; merges "a b" in rank order; splits: the pre-tokenizer's regexes, each splitting the pieces of the one
// before; ignore_merges: a pre-token that is itself a token is emitted whole.
StatusOr<std::unique_ptr<Tokenizer>> MakeByteBpeTokenizer(const std::vector<std::string>& tokens,
                                                          const std::vector<int32_t>& types,
                                                          const std::vector<std::string>& merges, int bos, int eos,
                                                          bool add_bos, const std::vector<PreSplit>& splits,
                                                          bool ignore_merges, bool nfc = false);
// SentencePiece-style BPE (tokenizer_spm.cc): merges by rank (tokenizer.json) or, with none, by the merged
// token's score (GGUF).
StatusOr<std::unique_ptr<Tokenizer>> MakeSpmBpeTokenizer(const std::vector<std::string>& tokens,
                                                         const std::vector<int32_t>& types,
                                                         const std::vector<std::string>& merges,
                                                         const std::vector<float>& scores, int bos, int eos,
                                                         bool add_bos, bool add_prefix);

}  // namespace qkv
