#include "engine/request.h"

namespace qkv {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "";
}

bool RequestStream::Next(StreamEvent* out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  if (!cv_.wait_for(l, timeout, [&] { return !events_.empty(); })) return false;
  *out = std::move(events_.front());
  events_.pop_front();
  return true;
}

bool RequestStream::finished() const {
  std::lock_guard<std::mutex> l(mu_);
  return final_pushed_;
}

void RequestStream::Push(StreamEvent e) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (final_pushed_) return;
    final_pushed_ = e.final;
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

}  // namespace qkv
