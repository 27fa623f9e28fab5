#include "engine/status.h"

namespace qkv {

std::string Status::ToString() const {
  const char* name = "UNKNOWN";
  switch (code_) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: name = "CANCELLED"; break;
    case StatusCode::kInvalidArgument: name = "INVALID_ARGUMENT"; break;
    case StatusCode::kNotFound: name = "NOT_FOUND"; break;
    case StatusCode::kAlreadyExists: name = "ALREADY_EXISTS"; break;
    case StatusCode::kResourceExhausted: name = "RESOURCE_EXHAUSTED"; break;
    case StatusCode::kFailedPrecondition: name = "FAILED_PRECONDITION"; break;
    case StatusCode::kOutOfRange: name = "OUT_OF_RANGE"; break;
    case StatusCode::kUnimplemented: name = "UNIMPLEMENTED"; break;
    case StatusCode::kInternal: name = "INTERNAL"; break;
    case StatusCode::kUnavailable: name = "UNAVAILABLE"; break;
    case StatusCode::kDataLoss: name = "DATA_LOSS"; break;
    case StatusCode::kUnauthenticated: name = "UNAUTHENTICATED"; break;
  }
  return std::string(name) + ": " + message_;
}

}  // namespace qkv
