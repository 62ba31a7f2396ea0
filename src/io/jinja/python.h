// Python's semantics for strings on UTF-8 text: characters (code points),
// the str methods the templates call (strip, split, lower, upper), repr() of
// str and float, and json.dumps. Internal to the chat-template interpreter.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/jinja/common.h"

namespace nucleus::jinja {

// The characters of `s` (Python indexes strings by code point), as views
// into `s`.
std::vector<std::string_view> utf8_chars(std::string_view s);

// The number of characters of `s` (Python's len()).
size_t utf8_count(std::string_view s);

// str.strip / lstrip / rstrip: `chars` null strips whitespace.
std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right);

// str.split(None, maxsplit): runs of whitespace separate, ends are trimmed;
// maxsplit < 0 splits all.
std::vector<std::string> py_split_ws(std::string_view s, int64_t maxsplit);

// str.split(sep, maxsplit) / str.rsplit(sep, maxsplit) with a non-empty sep;
// maxsplit < 0 splits all.
std::vector<std::string> py_split(std::string_view s, std::string_view sep, int64_t maxsplit, bool from_right);

// `s` with ASCII letters lowered / raised (other characters unchanged).
std::string ascii_lower(std::string s);
std::string ascii_upper(std::string s);

// Python's repr() of a str, appended to `out`: single quotes unless the text
// has one and no double quote.
void py_repr_string(std::string_view s, std::string& out);

// Python's repr() of a float: the shortest round-trip digits, positional
// when the decimal exponent is in (-4, 16], with ".0" on whole numbers.
std::string py_float(double d);

// ---- JSON output (Python's json.dumps) ------------------------------------------

// json.dumps' formatting arguments.
struct JsonStyle {
  bool pretty = false;  // indent given: one item per line
  std::string indent;
  std::string item_sep = ", ", key_sep = ": ";
  bool ensure_ascii = false;
};

// json.dumps(v) with style `st`, appended to `out`; `level` is the nesting
// depth of `v` (0 at the top) for the indentation.
void dump_json(const json& v, const JsonStyle& st, int level, std::string& out);

}  // namespace nucleus::jinja
