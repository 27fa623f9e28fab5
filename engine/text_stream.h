// Turns generated token bytes into text deltas that are safe to show:
//   * every delta is valid UTF-8: a character split across tokens is held back until complete, and
//     bytes that can never form a character become U+FFFD (a stream never fails on bad model output);
//   * text that may be the start of a stop string is held back until it is known not to be one;
//   * the concatenated deltas equal the text up to (and, if asked, including) the first stop string.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace qkv {

class TextStream {
 public:
  explicit TextStream(std::vector<std::string> stops = {}, bool include_stop = false);
  // Appends one token's bytes; returns the text that became safe to emit (possibly empty).
  std::string Push(std::string_view bytes);
  // At the end of generation: everything still held back (a dangling partial character becomes U+FFFD).
  std::string Finish();
  bool stopped() const { return stop_index_ >= 0; }
  // The stop string that ended the text, if any.
  const std::string& matched_stop() const;

 private:
  std::string Emit(size_t end, bool final);
  std::vector<std::string> stops_;
  bool include_stop_;
  size_t max_stop_ = 0;
  std::string text_;    // all bytes pushed (sanitized as emitted)
  size_t emitted_ = 0;  // bytes of text_ already turned into deltas
  int stop_index_ = -1;
};

}  // namespace qkv
