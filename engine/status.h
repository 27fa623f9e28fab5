// Errors as values, as in LevelDB: every fallible engine call returns a Status or a StatusOr<T>.
// The codes mirror gRPC's so that the server translates them in one place without a table of guesses.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace qkv {

enum class StatusCode {
  kOk = 0,
  kCancelled = 1,
  kInvalidArgument = 3,
  kNotFound = 5,
  kAlreadyExists = 6,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message", for logs and tools.
  std::string ToString() const;
  // The code's canonical name, "INVALID_ARGUMENT" (gRPC's spelling).
  static const char* CodeName(StatusCode code);

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }

// A value or the Status that explains why there is none.
template <typename T>
class StatusOr {
 public:
  StatusOr(Status s) : status_(std::move(s)) { assert(!status_.ok()); }  // NOLINT: implicit by design
  StatusOr(T v) : value_(std::move(v)) {}                                // NOLINT: implicit by design
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

#define QKV_RETURN_IF_ERROR(expr) \
  do {                            \
    ::qkv::Status _st = (expr);   \
    if (!_st.ok()) return _st;    \
  } while (0)

#define QKV_CONCAT_INNER(a, b) a##b
#define QKV_CONCAT(a, b) QKV_CONCAT_INNER(a, b)
#define QKV_ASSIGN_OR_RETURN(lhs, expr) QKV_ASSIGN_OR_RETURN_IMPL(QKV_CONCAT(_sor_, __LINE__), lhs, expr)
#define QKV_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

}  // namespace qkv
