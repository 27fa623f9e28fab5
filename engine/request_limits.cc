#include "engine/request_limits.h"

#include <cctype>

namespace qkv {
namespace {

constexpr std::string_view kOverLimit = ") exceeds the server's limit of ";

Status TooMuch(std::string_view what, int64_t got, int64_t limit, std::string_view flag) {
  return ResourceExhausted(std::string(what) + " (" + std::to_string(got) + std::string(kOverLimit) +
                           std::to_string(limit) + " (" + std::string(flag) + ")");
}
}  // namespace

bool IsOverLimit(const Status& s) {
  return s.code() == StatusCode::kResourceExhausted && s.message().find(kOverLimit) != std::string::npos;
}

Status CheckId(std::string_view field, std::string_view id) {
  if (id.empty() || id.size() > RequestLimits::kMaxIdLength) {
    return InvalidArgument(std::string(field) + " must be 1-" + std::to_string(RequestLimits::kMaxIdLength) +
                           " characters (got " + std::to_string(id.size()) + ")");
  }
  for (char c : id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return InvalidArgument(std::string(field) + " may only contain [A-Za-z0-9._-]");
    }
  }
  return {};
}

Status CheckPromptBytes(const RequestLimits& l, std::string_view field, int64_t bytes) {
  if (bytes > l.max_prompt_bytes)
    return TooMuch(std::string(field) + " bytes", bytes, l.max_prompt_bytes, "--max-prompt-bytes");
  return {};
}

Status CheckPromptTokens(const RequestLimits& l, int64_t n, int context) {
  if (l.max_prompt_tokens > 0 && n > l.max_prompt_tokens) {
    return TooMuch("prompt tokens", n, l.max_prompt_tokens, "--max-prompt-tokens");
  }
  if (n > context) {  // cannot fit at all: the same kind of error as the engine's context overflow
    return InvalidArgument("context overflow: prompt (" + std::to_string(n) + " tokens) exceeds the context of " +
                           std::to_string(context) + " tokens");
  }
  return {};
}

Status CheckMessageCount(const RequestLimits& l, int64_t n) {
  if (n > l.max_messages) return TooMuch("messages", n, l.max_messages, "--max-messages");
  return {};
}

Status CheckStopCount(const RequestLimits& l, int64_t n_stops, int64_t n_stop_token_ids) {
  if (n_stops > l.max_stop_strings) return TooMuch("stop strings", n_stops, l.max_stop_strings, "--max-stop-strings");
  if (n_stop_token_ids > l.max_stop_token_ids) {
    return TooMuch("stop_token_ids", n_stop_token_ids, l.max_stop_token_ids, "--max-stop-token-ids");
  }
  return {};
}

Status CheckStopBytes(const RequestLimits& l, int64_t bytes) {
  if (bytes > l.max_stop_bytes) return TooMuch("stop string bytes", bytes, l.max_stop_bytes, "--max-stop-bytes");
  return {};
}

}  // namespace qkv
