// Python's str methods, repr() and json.dumps on UTF-8 strings, so that the
// templates' strings behave as the Python strings transformers renders with.
#include "io/jinja/python.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <set>

#include "io/utf8.h"

namespace nucleus::jinja {

namespace {

// Not io/utf8.h's decoder (utf8_next), on purpose: these helpers read a
// sequence's length from its lead byte alone and never look at what follows
// it. On valid UTF-8 the two agree character for character, and a template
// transformers can load is valid UTF-8 (its file is read as UTF-8, string
// escapes refuse lone surrogates). A chat_template.jinja that is not valid
// UTF-8 is still rendered, not refused, and this keeps what it renders
// (lengths, indexes, strip / split points) as it was; utf8_next would count
// each ill-formed subpart as one character instead.

// Length of the UTF-8 sequence led by byte `c` (1 for ASCII and stray bytes).
size_t utf8_len(unsigned char c) {
  if (c >= 0xF0 && c < 0xF8) return 4;
  if (c >= 0xE0) return c < 0xF0 ? 3 : 1;
  if (c >= 0xC0) return 2;
  return 1;
}

// The code point at s[i] and its byte length (clamped to the string; invalid
// bytes read as U+FFFD of length 1).
uint32_t decode_at(std::string_view s, size_t i, size_t* len) {
  auto c = static_cast<unsigned char>(s[i]);
  size_t n = utf8_len(c);
  if (n == 1 || i + n > s.size()) {
    *len = 1;
    return c < 0x80 ? c : 0xFFFD;
  }
  uint32_t cp = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  *len = n;
  return cp;
}

}  // namespace

// The characters of `s` (Python indexes strings by code point).
std::vector<std::string_view> utf8_chars(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = std::min(utf8_len(static_cast<unsigned char>(s[i])), s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

size_t utf8_count(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += !utf8_continuation(static_cast<unsigned char>(c));
  return n;
}

namespace {

// Python's str.isspace() for one code point.
bool py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

}  // namespace

// str.strip / lstrip / rstrip: `chars` null strips whitespace.
std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right) {
  std::set<uint32_t> set;
  if (chars) {
    for (size_t i = 0, n = 0; i < chars->size(); i += n) set.insert(decode_at(*chars, i, &n));
  }
  auto strip_cp = [&](uint32_t cp) { return chars ? set.count(cp) > 0 : py_space(cp); };
  size_t b = 0, e = s.size(), n = 0;
  while (left && b < e && strip_cp(decode_at(s, b, &n))) b += n;
  while (right && e > b) {
    size_t start = e - 1;
    while (start > b && utf8_continuation(static_cast<unsigned char>(s[start]))) --start;
    if (!strip_cp(decode_at(s, start, &n))) break;
    e = start;
  }
  return std::string(s.substr(b, e - b));
}

// str.split(None, maxsplit): runs of whitespace separate, ends are trimmed.
std::vector<std::string> py_split_ws(std::string_view s, int64_t maxsplit) {
  std::vector<std::string> out;
  size_t i = 0, n = 0;
  while (true) {
    while (i < s.size() && py_space(decode_at(s, i, &n))) i += n;
    if (i >= s.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      out.emplace_back(s.substr(i));
      break;
    }
    size_t j = i;
    while (j < s.size() && !py_space(decode_at(s, j, &n))) j += n;
    out.emplace_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

// str.split(sep, maxsplit) / str.rsplit(sep, maxsplit) with a non-empty sep.
std::vector<std::string> py_split(std::string_view s, std::string_view sep, int64_t maxsplit, bool from_right) {
  std::vector<std::string> out;
  if (!from_right) {
    size_t i = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      size_t j = s.find(sep, i);
      if (j == std::string_view::npos) break;
      out.emplace_back(s.substr(i, j - i));
      i = j + sep.size();
    }
    out.emplace_back(s.substr(i));
    return out;
  }
  size_t end = s.size();
  int64_t splits = 0;
  while (maxsplit < 0 || splits < maxsplit) {
    if (end < sep.size()) break;
    size_t j = s.rfind(sep, end - sep.size());
    if (j == std::string_view::npos) break;
    out.emplace_back(s.substr(j + sep.size(), end - j - sep.size()));
    end = j;
    ++splits;
  }
  out.emplace_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

std::string ascii_lower(std::string s) {
  for (char& c : s) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  return s;
}

std::string ascii_upper(std::string s) {
  for (char& c : s) c = (c >= 'a' && c <= 'z') ? static_cast<char>(c - 'a' + 'A') : c;
  return s;
}

// Python's repr() of a str: single quotes unless the text has one and no
// double quote.
void py_repr_string(std::string_view s, std::string& out) {
  char q = (s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos) ? '"' : '\'';
  out += q;
  for (char c : s) {
    if (c == q || c == '\\') {
      out += '\\', out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  out += q;
}

// Python's repr() of a float: the shortest round-trip digits, positional
// when the decimal exponent is in (-4, 16], with ".0" on whole numbers.
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string s(buf, r.ptr);
  std::string out;
  if (s[0] == '-') out = "-", s.erase(0, 1);
  size_t e = s.find('e');
  int exp = std::atoi(s.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; ++i)
    if (s[i] != '.') digits += s[i];
  int decpt = exp + 1, nd = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(-decpt, '0') + digits;
    } else if (decpt >= nd) {
      out += digits + std::string(decpt - nd, '0') + ".0";
    } else {
      out += digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out += digits.substr(0, 1);
    if (nd > 1) out.append(".").append(digits, 1);  // not "." + ...: GCC 12 warns falsely (-Wrestrict)
    std::snprintf(buf, sizeof buf, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += buf;
  }
  return out;
}

// ---- JSON output (Python's json.dumps) ------------------------------------------

namespace {

void dump_json_string(std::string_view s, bool ensure_ascii, std::string& out) {
  out += '"';
  char buf[16];
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else if (c >= 0x80 && ensure_ascii) {
          size_t n = 0;
          uint32_t cp = decode_at(s, i, &n);
          if (cp >= 0x10000) {
            cp -= 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", cp);
          }
          out += buf;
          i += n;
          continue;
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  out += '"';
}

}  // namespace

void dump_json(const json& v, const JsonStyle& st, int level, std::string& out) {
  auto newline = [&](int l) {
    if (!st.pretty) return;
    out += '\n';
    for (int k = 0; k < l; ++k) out += st.indent;
  };
  switch (v.type()) {
    case json::value_t::boolean: out += v.get<bool>() ? "true" : "false"; break;
    case json::value_t::number_integer: out += std::to_string(v.get<int64_t>()); break;
    case json::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); break;
    case json::value_t::number_float: {
      double d = v.get<double>();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : py_float(d);
      break;
    }
    case json::value_t::string: dump_json_string(v.get_ref<const std::string&>(), st.ensure_ascii, out); break;
    case json::value_t::array: {
      if (v.empty()) {
        out += "[]";
        break;
      }
      out += '[';
      for (size_t k = 0; k < v.size(); ++k) {
        if (k) out += st.item_sep;
        newline(level + 1);
        dump_json(v[k], st, level + 1, out);
      }
      newline(level);
      out += ']';
      break;
    }
    case json::value_t::object: {
      if (v.empty()) {
        out += "{}";
        break;
      }
      out += '{';
      bool first = true;
      for (const auto& [key, item] : v.items()) {
        if (!first) out += st.item_sep;
        first = false;
        newline(level + 1);
        dump_json_string(key, st.ensure_ascii, out);
        out += st.key_sep;
        dump_json(item, st, level + 1, out);
      }
      newline(level);
      out += '}';
      break;
    }
    default: out += "null"; break;
  }
}

}  // namespace nucleus::jinja
