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

bool RequestStream::TryNext(StreamEvent* out) {
  std::lock_guard<std::mutex> l(mu_);
  if (events_.empty()) return false;
  *out = std::move(events_.front());
  events_.pop_front();
  return true;
}

void RequestStream::SetListener(std::function<void()> fn) {
  std::unique_lock<std::mutex> l(listener_mu_);
  // A call on this very thread (the listener itself detaching) cannot be waited for.
  listener_cv_.wait(l, [&] { return !listener_running_ || listener_thread_ == std::this_thread::get_id(); });
  listener_ = std::move(fn);
}

void RequestStream::Push(StreamEvent e) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (final_pushed_) return;
    final_pushed_ = e.final;
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
  // The listener runs outside listener_mu_ (one lock order: a consumer's lock, then the stream's); a
  // concurrent SetListener waits until it returns.
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> l(listener_mu_);
    if (!listener_) return;
    fn = listener_;
    listener_running_ = true;
    listener_thread_ = std::this_thread::get_id();
  }
  fn();
  {
    std::lock_guard<std::mutex> l(listener_mu_);
    listener_running_ = false;
  }
  listener_cv_.notify_all();
}

}  // namespace qkv
