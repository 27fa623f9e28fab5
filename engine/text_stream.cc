#include "engine/text_stream.h"

#include <algorithm>

#include "engine/utf8.h"

namespace qkv {
namespace {
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

// True if s[i..] is a proper prefix of some valid UTF-8 sequence (more bytes could complete it).
bool IncompleteUtf8(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
  if (need == 0 || s.size() - i >= need) return false;
  for (size_t k = i + 1; k < s.size(); ++k) {
    if ((static_cast<unsigned char>(s[k]) & 0xC0) != 0x80) return false;
  }
  return true;
}
}  // namespace

TextStream::TextStream(std::vector<std::string> stops, bool include_stop)
    : stops_(std::move(stops)), include_stop_(include_stop) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
  for (const auto& s : stops_) max_stop_ = std::max(max_stop_, s.size());
}

const std::string& TextStream::matched_stop() const {
  static const std::string kNone;
  return stop_index_ >= 0 ? stops_[stop_index_] : kNone;
}

std::string TextStream::Emit(size_t end, bool final) {
  std::string out;
  size_t i = emitted_;
  while (i < end) {
    const size_t len = Utf8SequenceLength(text_, i);
    if (len > 0 && i + len <= end) {
      out.append(text_, i, len);
      i += len;
    } else if (!final && IncompleteUtf8(text_, i)) {
      break;  // wait for the rest of the character
    } else {
      out += kReplacement;
      ++i;
    }
  }
  emitted_ = i;
  return out;
}

std::string TextStream::Push(std::string_view bytes) {
  if (stopped()) return {};
  text_.append(bytes);
  // A stop string cannot start inside emitted text (such a suffix is always held back).
  size_t best = std::string::npos;
  for (size_t k = 0; k < stops_.size(); ++k) {
    const size_t f = text_.find(stops_[k], emitted_);
    if (f != std::string::npos && (f < best || (f == best && stops_[k].size() > stops_[stop_index_].size()))) {
      best = f;
      stop_index_ = static_cast<int>(k);
    }
  }
  if (stopped()) {
    text_.resize(best + (include_stop_ ? stops_[stop_index_].size() : 0));
    return Emit(text_.size(), /*final=*/true);
  }
  // Hold back the longest suffix that is a prefix of a stop string.
  size_t hold = 0;
  for (const auto& s : stops_) {
    for (size_t n = std::min(s.size() - 1, text_.size() - emitted_); n > hold; --n) {
      if (text_.compare(text_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  return Emit(text_.size() - hold, /*final=*/false);
}

std::string TextStream::Finish() {
  if (stopped()) return {};
  return Emit(text_.size(), /*final=*/true);
}

}  // namespace qkv
