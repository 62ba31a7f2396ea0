// NUCLEUS_CHECK: a broken invariant is a bug; stop with file:line and the
// values. Errors that input can cause return a Status instead (status.h).
#pragma once

#include <fmt/format.h>

namespace nucleus::detail {
[[noreturn]] void check_failed(const char* file, int line, const char* expr, const std::string& msg);
}  // namespace nucleus::detail

// NUCLEUS_CHECK(cond) or NUCLEUS_CHECK(cond, "fmt {}", args...)
#define NUCLEUS_CHECK(cond, ...)                                                     \
  do {                                                                               \
    if (!(cond)) [[unlikely]] {                                                      \
      ::nucleus::detail::check_failed(__FILE__, __LINE__, #cond,                     \
                                      ::nucleus::detail::check_message(__VA_ARGS__)); \
    }                                                                                \
  } while (0)

namespace nucleus::detail {
inline std::string check_message() { return {}; }
template <typename... Args>
std::string check_message(fmt::format_string<Args...> f, Args&&... args) {
  return fmt::format(f, std::forward<Args>(args)...);
}
}  // namespace nucleus::detail

// Aborts if a Status-returning expression fails (for callers that cannot fail
// on valid programs, such as tests' fixtures and internal wiring).
#define NUCLEUS_CHECK_OK(expr)                                   \
  do {                                                           \
    ::nucleus::Status nucleus_check_status_ = (expr);            \
    NUCLEUS_CHECK(nucleus_check_status_.ok(), "{}", nucleus_check_status_.to_string()); \
  } while (0)
