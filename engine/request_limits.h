// How big one request may be, checked before any work proportional to its size (tokenization, the engine
// thread's stop-string scans). Every front (gRPC today, HTTP later) checks through these functions, so the
// limits and their messages are the same everywhere. "Too much" is RESOURCE_EXHAUSTED and names the flag
// that raises the limit; malformed input is INVALID_ARGUMENT. Ids are never echoed back: a message names
// the field, not the value.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "engine/status.h"

namespace qkv {

struct RequestLimits {
  int64_t max_prompt_bytes = 4 << 20;       // --max-prompt-bytes: text, or all message contents together
  int max_prompt_tokens = 0;                // --max-prompt-tokens: after tokenization (0: the context length)
  int max_messages = 1024;                  // --max-messages
  int max_stop_strings = 64;                // --max-stop-strings
  int64_t max_stop_bytes = 16 << 10;        // --max-stop-bytes: all stop strings together
  int max_stop_token_ids = 1024;            // --max-stop-token-ids
  static constexpr int kMaxIdLength = 128;  // request and session ids (fixed: ids are keys)
};

// An id: 1..128 characters of [A-Za-z0-9._-].
Status CheckId(std::string_view field, std::string_view id);
// Prompt text (or the total of message contents) against max_prompt_bytes.
Status CheckPromptBytes(const RequestLimits& l, std::string_view field, int64_t bytes);
// Token count against max_prompt_tokens (RESOURCE_EXHAUSTED) and the context (INVALID_ARGUMENT).
Status CheckPromptTokens(const RequestLimits& l, int64_t n, int context);
Status CheckMessageCount(const RequestLimits& l, int64_t n);
// Stop strings and stop token ids: counts, then the strings' total bytes. Any container of strings (a
// std::vector, a protobuf repeated field) is read in place; the counts come first, so a request with far
// too many stop strings is refused without reading them.
Status CheckStopCount(const RequestLimits& l, int64_t n_stops, int64_t n_stop_token_ids);
Status CheckStopBytes(const RequestLimits& l, int64_t bytes);
// Whether a status is one of these limits' refusals (a request too large, as opposed to a full queue or
// quota): the HTTP front answers 413 for these and 429 for other RESOURCE_EXHAUSTED.
bool IsOverLimit(const Status& s);
template <typename Strings>
Status CheckStops(const RequestLimits& l, const Strings& stops, int64_t n_stop_token_ids) {
  QKV_RETURN_IF_ERROR(CheckStopCount(l, static_cast<int64_t>(stops.size()), n_stop_token_ids));
  int64_t bytes = 0;
  for (const auto& s : stops) bytes += static_cast<int64_t>(s.size());
  return CheckStopBytes(l, bytes);
}

}  // namespace qkv
