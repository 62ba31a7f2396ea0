// Positions in a template's source for error messages: "chat template
// line L, column C: <what>".
#include "io/jinja/common.h"

#include "io/utf8.h"

namespace nucleus::jinja {

// "line L, column C" for a byte offset of the (normalized) source; columns
// count characters.
std::string line_column(const std::string& src, size_t pos) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < pos && i < src.size(); ++i) {
    if (src[i] == '\n') {
      ++line, col = 1;
    } else if (!utf8_continuation(static_cast<unsigned char>(src[i]))) {
      ++col;
    }
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(col);
}

namespace {

std::string location(const std::string& src, size_t pos) { return "chat template " + line_column(src, pos); }

}  // namespace

Status error_at(const std::string& src, size_t pos, const std::string& what) {
  return invalid_argument(location(src, pos) + ": " + what);
}

}  // namespace nucleus::jinja
