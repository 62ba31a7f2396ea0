// Status and StatusOr: errors that input can cause (a bad request, a flag, a
// corrupt file) travel as values with a message naming the thing and the fix.
// Broken invariants (bugs) use NUCLEUS_CHECK in check.h instead.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace nucleus {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // bad input: request field, flag, config value
  kNotFound,           // a file or tensor that should exist does not
  kOutOfRange,         // a value or offset outside its valid range
  kUnsupported,        // valid input this engine does not handle (yet)
  kResourceExhausted,  // KV cache, memory, queue capacity
  kDataLoss,           // corrupt or truncated file
  kFailedPrecondition, // call made in the wrong state
  kAborted,            // request aborted by the client or shutdown
  kInternal,           // a bug surfaced as a value (prefer NUCLEUS_CHECK)
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: <message>"
  std::string to_string() const;

  // Returns a copy whose message is "<context>: <message>".
  Status with_context(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status ok_status() { return Status(); }
inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status out_of_range(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
inline Status resource_exhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status data_loss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status failed_precondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// A value or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : v_(std::move(status)) { assert(!std::get<Status>(v_).ok()); }
  StatusOr(T value) : v_(std::move(value)) {}

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<Status, T> v_;
};

}  // namespace nucleus

#define NUCLEUS_STATUS_CONCAT_INNER(a, b) a##b
#define NUCLEUS_STATUS_CONCAT(a, b) NUCLEUS_STATUS_CONCAT_INNER(a, b)

#define NUCLEUS_RETURN_IF_ERROR(expr)              \
  do {                                             \
    ::nucleus::Status nucleus_status_ = (expr);    \
    if (!nucleus_status_.ok()) return nucleus_status_; \
  } while (0)

#define NUCLEUS_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

// NUCLEUS_ASSIGN_OR_RETURN(auto x, f()); returns f()'s Status on error.
#define NUCLEUS_ASSIGN_OR_RETURN(lhs, expr) \
  NUCLEUS_ASSIGN_OR_RETURN_IMPL(NUCLEUS_STATUS_CONCAT(nucleus_or_, __LINE__), lhs, expr)
