#include "engine/unicode_nfc.h"

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "engine/unicode_nfc_data.h"
#include "engine/utf8.h"

namespace qkv {
namespace {

// Hangul syllables compose and decompose algorithmically (Unicode §3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

struct Tables {
  std::unordered_map<uint32_t, std::pair<uint32_t, uint32_t>> decomp;
  std::unordered_map<uint32_t, uint8_t> ccc;
  std::unordered_map<uint64_t, uint32_t> compose;
};

const Tables& T() {
  static const Tables t = [] {
    Tables x;
    for (const auto& d : unicode::kDecomp) x.decomp[d.cp] = {d.a, d.b};
    for (const auto& c : unicode::kCcc) x.ccc[c.cp] = c.ccc;
    for (const auto& c : unicode::kCompose) x.compose[(static_cast<uint64_t>(c.a) << 32) | c.b] = c.c;
    return x;
  }();
  return t;
}

uint8_t Ccc(uint32_t cp) {
  auto it = T().ccc.find(cp);
  return it == T().ccc.end() ? 0 : it->second;
}

void Decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  auto it = T().decomp.find(cp);
  if (it == T().decomp.end()) {
    out.push_back(cp);
    return;
  }
  Decompose(it->second.first, out);
  if (it->second.second) Decompose(it->second.second, out);
}

bool Compose(uint32_t a, uint32_t b, uint32_t* c) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    *c = kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
    return true;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount) {
    *c = a + (b - kTBase);
    return true;
  }
  auto it = T().compose.find((static_cast<uint64_t>(a) << 32) | b);
  if (it == T().compose.end()) return false;
  *c = it->second;
  return true;
}

uint32_t DecodeAt(std::string_view s, size_t i, size_t len) {
  const auto c0 = static_cast<unsigned char>(s[i]);
  if (len == 1) return c0;
  uint32_t cp = c0 & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

void Encode(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// NFC of a run of valid code points.
void NormalizeRun(std::vector<uint32_t>& cps, std::string& out) {
  std::vector<uint32_t> d;
  for (uint32_t cp : cps) Decompose(cp, d);
  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < d.size();) {
    if (Ccc(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && Ccc(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + i, d.begin() + j, [](uint32_t a, uint32_t b) { return Ccc(a) < Ccc(b); });
    i = j;
  }
  // Canonical composition.
  std::vector<uint32_t> r;
  int starter = -1;
  int last_ccc = -1;
  for (uint32_t cp : d) {
    const int c = Ccc(cp);
    uint32_t comp;
    if (starter >= 0 && (last_ccc < c || (last_ccc == 0 && static_cast<int>(r.size()) - 1 == starter)) &&
        Compose(r[starter], cp, &comp)) {
      r[starter] = comp;
      continue;
    }
    if (c == 0) starter = static_cast<int>(r.size());
    last_ccc = c;
    r.push_back(cp);
  }
  for (uint32_t cp : r) Encode(cp, out);
  cps.clear();
}

}  // namespace

std::string NfcNormalize(std::string_view s) {
  // Fast path: nothing below U+0300 decomposes or composes differently under NFC.
  bool simple = true;
  for (size_t i = 0; i < s.size() && simple; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0xCC) simple = false;  // lead bytes of U+0300 and above
  }
  if (simple) return std::string(s);
  std::string out;
  out.reserve(s.size());
  std::vector<uint32_t> run;
  for (size_t i = 0; i < s.size();) {
    const size_t len = Utf8SequenceLength(s, i);
    if (len == 0) {  // invalid byte: flush and pass it through
      NormalizeRun(run, out);
      out += s[i++];
      continue;
    }
    run.push_back(DecodeAt(s, i, len));
    i += len;
  }
  NormalizeRun(run, out);
  return out;
}

}  // namespace qkv
