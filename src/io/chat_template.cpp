// Jinja2 subset for chat templates: a lexer that applies Jinja's whitespace
// rules while cutting the source into text and tag tokens, a recursive-descent
// parser with Jinja2's operator precedence, and a tree-walking renderer over
// JSON values. Semantics follow Python (truthiness, ==, slicing, str(), float
// repr, json.dumps) because transformers renders these templates with Jinja2
// on Python objects, and prompts must come out byte for byte the same.
#include "io/chat_template.h"
#include "io/utf8.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace nucleus {

// Objects keep their keys in insertion order, as Python dicts do, so that
// tojson and items() print them in the order the request gave.
using json = nlohmann::ordered_json;

namespace {

// Nested macro calls allowed before a render fails (recursive macros).
constexpr int kMaxCallDepth = 64;
// Longest range() (Jinja2's sandbox limit) and largest string or list a
// `*` repetition may build.
constexpr int64_t kMaxRange = 100000;
constexpr size_t kMaxRepeatBytes = size_t{64} << 20;
// A render's budget: statements and expressions evaluated, and the bytes of
// any string it builds (the output included). A template from a checkpoint
// is code the server runs on every chat request; without a budget, nested
// loops or doubling a string in a loop would hang or exhaust the server.
constexpr int64_t kMaxRenderSteps = 5'000'000;
constexpr size_t kMaxStringBytes = kMaxRepeatBytes;

// "line L, column C" for a byte offset of the (normalized) source; columns
// count characters.
std::string line_column(const std::string& src, size_t pos) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < pos && i < src.size(); ++i) {
    if (src[i] == '\n') {
      ++line, col = 1;
    } else if ((static_cast<unsigned char>(src[i]) & 0xC0) != 0x80) {
      ++col;
    }
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(col);
}

std::string location(const std::string& src, size_t pos) { return "chat template " + line_column(src, pos); }

Status error_at(const std::string& src, size_t pos, const std::string& what) {
  return invalid_argument(location(src, pos) + ": " + what);
}

// ---- UTF-8 and Python string helpers ------------------------------------------

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
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// Python's str.isspace() for one code point.
bool py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

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
    while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
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
    if (nd > 1) out += "." + digits.substr(1);
    std::snprintf(buf, sizeof buf, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += buf;
  }
  return out;
}

// ---- JSON output (Python's json.dumps) ------------------------------------------

struct JsonStyle {
  bool pretty = false;  // indent given: one item per line
  std::string indent;
  std::string item_sep = ", ", key_sep = ": ";
  bool ensure_ascii = false;
};

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

// ---- Lexer ------------------------------------------------------------------------

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Token(Tok k, size_t p, std::string t = {}) : kind(k), pos(p), text(std::move(t)) {}
  Tok kind = Tok::kEof;
  size_t pos = 0;
  std::string text;  // kText: the data; kName / kOp: the word; kString: the decoded value
  int64_t int_value = 0;
  double float_value = 0;
};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_ident(char c) { return is_ident_start(c) || is_digit(c); }

int hex_value(char c) {
  if (is_digit(c)) return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Cuts the source into text and tag tokens the way Jinja2's lexer does with
// trim_blocks and lstrip_blocks on: "{%-"/"-%}" strip all whitespace on that
// side, a block or comment tag alone on its line takes the line's leading
// blanks and its newline with it, and "{%+"/"+%}" opt out of that.
class Lexer {
 public:
  explicit Lexer(const std::string& src) : s_(src) {}

  StatusOr<std::vector<Token>> run() {
    const size_t n = s_.size();
    size_t pos = 0;
    bool line_start = true;  // `pos` is at the start of a line
    while (pos < n) {
      size_t at = find_tag(pos);
      std::string text = s_.substr(pos, (at == std::string::npos ? n : at) - pos);
      if (at == std::string::npos) {
        add_text(std::move(text), pos);
        break;
      }
      char kind = s_[at + 1];
      char sign = (at + 2 < n && (s_[at + 2] == '-' || s_[at + 2] == '+')) ? s_[at + 2] : 0;
      if (sign == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: blanks between the line start and a block or comment.
        size_t line = text.rfind('\n');
        line = line == std::string::npos ? 0 : line + 1;
        bool blank = line < text.size() &&
                     std::all_of(text.begin() + line, text.end(), [](char c) { return is_space(c) && c != '\n'; });
        if ((line > 0 || line_start) && blank) text.erase(line);
      }
      add_text(std::move(text), pos);
      size_t p = at + 2 + (sign ? 1 : 0);
      bool strip_after = false, keep_newline = false;
      if (kind == '#') {
        size_t end = s_.find("#}", p);
        if (end == std::string::npos) return error_at(s_, at, "unterminated comment: missing '#}'");
        strip_after = end > p && s_[end - 1] == '-';
        keep_newline = end > p && s_[end - 1] == '+';
        p = end + 2;
      } else if (size_t after = 0; kind == '%' && match_tag_word(p, "raw", &after, &strip_after, &keep_newline)) {
        NUCLEUS_RETURN_IF_ERROR(lex_raw(at, after, strip_after, keep_newline, &p, &strip_after, &keep_newline));
      } else {
        bool block = kind == '%';
        out_.push_back({block ? Tok::kBlockBegin : Tok::kVarBegin, at});
        NUCLEUS_RETURN_IF_ERROR(lex_tag(at, block, &p, &strip_after, &keep_newline));
      }
      if (strip_after) {
        while (p < n && is_space(s_[p])) ++p;
      } else if (kind != '{' && !keep_newline && p < n && s_[p] == '\n') {
        ++p;  // trim_blocks
      }
      pos = p;
      line_start = s_[pos - 1] == '\n';
    }
    out_.push_back({Tok::kEof, n});
    return std::move(out_);
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t at = s_.find('{', from); at != std::string::npos && at + 1 < s_.size(); at = s_.find('{', at + 1)) {
      char c = s_[at + 1];
      if (c == '{' || c == '%' || c == '#') return at;
    }
    return std::string::npos;
  }

  void add_text(std::string text, size_t pos) {
    if (!text.empty()) out_.push_back({Tok::kText, pos, std::move(text)});
  }

  // True when s_[p..] is "<blanks>word<blanks>[-+]%}"; *after is past "%}".
  bool match_tag_word(size_t p, std::string_view word, size_t* after, bool* strip, bool* keep) const {
    while (p < s_.size() && is_space(s_[p])) ++p;
    if (s_.compare(p, word.size(), word) != 0 || (p + word.size() < s_.size() && is_ident(s_[p + word.size()])))
      return false;
    p += word.size();
    while (p < s_.size() && is_space(s_[p])) ++p;
    char sign = p < s_.size() ? s_[p] : 0;
    if (sign == '-' || sign == '+') ++p;
    if (s_.compare(p, 2, "%}") != 0) return false;
    *strip = sign == '-';
    *keep = sign == '+';
    *after = p + 2;
    return true;
  }

  // {% raw %}...{% endraw %}: the body is text, tags in it included.
  Status lex_raw(size_t at, size_t body, bool strip_body, bool keep_newline, size_t* p, bool* strip_after,
                 bool* keep_after) {
    if (strip_body) {
      while (body < s_.size() && is_space(s_[body])) ++body;
    } else if (!keep_newline && body < s_.size() && s_[body] == '\n') {
      ++body;
    }
    for (size_t q = s_.find("{%", body); q != std::string::npos; q = s_.find("{%", q + 2)) {
      char sign = q + 2 < s_.size() ? s_[q + 2] : 0;
      size_t after = 0;
      if (!match_tag_word(q + 2 + (sign == '-' || sign == '+'), "endraw", &after, strip_after, keep_after)) continue;
      std::string text = s_.substr(body, q - body);
      if (sign == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      }
      add_text(std::move(text), body);
      *p = after;
      return ok_status();
    }
    return error_at(s_, at, "{% raw %} without {% endraw %}");
  }

  // The tokens of one {{ }} or {% %} tag; `*p` starts after the opening
  // delimiter and ends after the closing one. The closing delimiter only
  // counts outside brackets, so "{{ {'a': {'b': 1}} }}" works.
  Status lex_tag(size_t begin, bool block, size_t* p, bool* strip_after, bool* keep_newline) {
    const size_t n = s_.size();
    const char* close = block ? "%}" : "}}";
    std::vector<size_t> open;  // positions of unclosed ( [ {
    size_t& i = *p;
    while (true) {
      while (i < n && is_space(s_[i])) ++i;
      if (i >= n)
        return error_at(s_, begin, std::string("unterminated tag: missing '") + close + "'");
      if (open.empty()) {
        if ((s_[i] == '-' || (block && s_[i] == '+')) && s_.compare(i + 1, 2, close) == 0) {
          *strip_after = s_[i] == '-';
          *keep_newline = s_[i] == '+';
          out_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, i});
          i += 3;
          return ok_status();
        }
        if (s_.compare(i, 2, close) == 0) {
          out_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, i});
          i += 2;
          return ok_status();
        }
      }
      size_t start = i;
      char c = s_[i];
      if (is_ident_start(c)) {
        while (i < n && is_ident(s_[i])) ++i;
        out_.push_back({Tok::kName, start, s_.substr(start, i - start)});
      } else if (is_digit(c)) {
        NUCLEUS_RETURN_IF_ERROR(lex_number(p));
      } else if (c == '\'' || c == '"') {
        Token t{Tok::kString, start};
        NUCLEUS_RETURN_IF_ERROR(lex_string(p, &t.text));
        out_.push_back(std::move(t));
      } else {
        static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
        std::string op;
        for (std::string_view two : kTwo)
          if (s_.compare(i, 2, two) == 0) op = two;
        if (op.empty()) {
          if (std::string_view("+-*/%~<>=.,:|()[]{}").find(c) == std::string_view::npos)
            return error_at(s_, i, std::string("unexpected character '") + c + "'");
          op = std::string(1, c);
          if (c == '(' || c == '[' || c == '{') open.push_back(i);
          if (c == ')' || c == ']' || c == '}') {
            char want = open.empty() ? 0 : s_[open.back()] == '(' ? ')' : s_[open.back()] == '[' ? ']' : '}';
            if (c != want)
              return error_at(s_, i, "unexpected '" + op + "'" +
                                         (open.empty() ? std::string()
                                                       : std::string(": the '") + s_[open.back()] + "' at " +
                                                             line_column(s_, open.back()) + " is not closed"));
            open.pop_back();
          }
        }
        i += op.size();
        out_.push_back({Tok::kOp, start, std::move(op)});
      }
    }
  }

  // Digits with optional '_' separators, then a fraction and/or exponent for
  // a float. After '.', only an integer ("x.0.1" is two attribute steps).
  Status lex_number(size_t* p) {
    const size_t n = s_.size();
    size_t start = *p, i = *p;
    auto digits = [&] {
      while (i < n && (is_digit(s_[i]) || (s_[i] == '_' && i + 1 < n && is_digit(s_[i + 1])))) ++i;
    };
    digits();
    bool after_dot = !out_.empty() && out_.back().kind == Tok::kOp && out_.back().text == ".";
    bool is_float = false;
    if (!after_dot && i + 1 < n && s_[i] == '.' && is_digit(s_[i + 1])) {
      is_float = true;
      ++i;
      digits();
    }
    if (!after_dot && i < n && (s_[i] == 'e' || s_[i] == 'E')) {
      size_t j = i + 1;
      if (j < n && (s_[j] == '+' || s_[j] == '-')) ++j;
      if (j < n && is_digit(s_[j])) {
        is_float = true;
        i = j;
        digits();
      }
    }
    std::string text;
    for (size_t k = start; k < i; ++k)
      if (s_[k] != '_') text += s_[k];
    Token t{is_float ? Tok::kFloat : Tok::kInt, start, text};
    if (is_float) {
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      auto r = std::from_chars(text.data(), text.data() + text.size(), t.int_value);
      if (r.ec != std::errc()) return error_at(s_, start, "integer literal " + text + " is too large");
    }
    out_.push_back(std::move(t));
    *p = i;
    return ok_status();
  }

  // A quoted literal with Python's escapes (\n \t \\ \' \" \xhh \uhhhh
  // \Uhhhhhhhh octal, unknown escapes kept as written).
  Status lex_string(size_t* p, std::string* out) {
    const size_t n = s_.size();
    size_t start = *p, i = *p + 1;
    char q = s_[start];
    auto hex = [&](size_t digits, uint32_t* cp) {
      if (i + digits > n) return false;
      *cp = 0;
      for (size_t k = 0; k < digits; ++k) {
        int h = hex_value(s_[i + k]);
        if (h < 0) return false;
        *cp = *cp * 16 + static_cast<uint32_t>(h);
      }
      i += digits;
      return true;
    };
    while (true) {
      if (i >= n) return error_at(s_, start, "unterminated string literal");
      char c = s_[i];
      if (c == q) break;
      if (c != '\\') {
        *out += c;
        ++i;
        continue;
      }
      if (i + 1 >= n) return error_at(s_, start, "unterminated string literal");
      size_t esc = i;
      char e = s_[i + 1];
      i += 2;
      uint32_t cp = 0;
      switch (e) {
        case '\n': break;
        case '\\': *out += '\\'; break;
        case '\'': *out += '\''; break;
        case '"': *out += '"'; break;
        case 'a': *out += '\a'; break;
        case 'b': *out += '\b'; break;
        case 'f': *out += '\f'; break;
        case 'n': *out += '\n'; break;
        case 'r': *out += '\r'; break;
        case 't': *out += '\t'; break;
        case 'v': *out += '\v'; break;
        case 'x':
        case 'u':
        case 'U': {
          if (!hex(e == 'x' ? 2 : e == 'u' ? 4 : 8, &cp) || cp > 0x10FFFF)
            return error_at(s_, esc, std::string("invalid \\") + e + " escape in string literal");
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a UTF-16 pair written as two \u escapes
            uint32_t low = 0;
            if (i + 2 <= n && s_[i] == '\\' && s_[i + 1] == 'u' && (i += 2, hex(4, &low)) && low >= 0xDC00 &&
                low <= 0xDFFF) {
              cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            } else {
              return error_at(s_, esc, "lone surrogate escape in string literal");
            }
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return error_at(s_, esc, "lone surrogate escape in string literal");
          }
          append_utf8(cp, *out);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && i < n && s_[i] >= '0' && s_[i] <= '7'; ++k, ++i) cp = cp * 8 + (s_[i] - '0');
            append_utf8(cp, *out);
          } else {
            *out += '\\';
            *out += e;
          }
      }
    }
    *p = i + 1;
    return ok_status();
  }

  const std::string& s_;
  std::vector<Token> out_;
};

// ---- Syntax tree ---------------------------------------------------------------------

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // args: items
    kTuple,     // args: items (a list at run time)
    kDict,      // args: key, value, key, value, ...
    kGetAttr,   // args[0].name
    kGetItem,   // args[0][args[1]]
    kSlice,     // args[0][args[1]:args[2]:args[3]], missing parts null
    kCall,      // args[0](args[1..], kwargs)
    kFilter,    // args[0] | name(args[1..], kwargs)
    kTest,      // args[0] is [not] name(args[1..])
    kNeg,       // -args[0]
    kPos,       // +args[0]
    kNot,       // not args[0]
    kBinary,    // args[0] <name> args[1], name one of + - * / // % **
    kAnd,       // args[0] and args[1]
    kOr,        // args[0] or args[1]
    kCompare,   // args[0] ops[0] args[1] ops[1] args[2] ... (chained as in Python)
    kConcat,    // args[0] ~ args[1] ~ ...
    kCond,      // args[0] if args[1] else args[2] (args[2] may be null)
  };
  Kind kind = Kind::kLiteral;
  size_t pos = 0;
  std::string name;
  json literal;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  bool negated = false;
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // branches, else_body
    kFor,       // for targets in expr [if filter]: body [else else_body]
    kSet,       // set targets = expr
    kSetAttr,   // set targets[0].targets[1] = expr
    kSetBlock,  // set targets[0] %} body {% endset
    kMacro,     // macro text(targets = defaults): body
    kBreak,
    kContinue,
  };
  Kind kind = Kind::kText;
  size_t pos = 0;
  std::string text;
  std::vector<std::string> targets;
  ExprPtr expr, filter;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body, else_body;
  std::vector<ExprPtr> defaults;
};

const std::set<std::string, std::less<>>& known_filters() {
  static const std::set<std::string, std::less<>> s = {
      "abs",     "capitalize", "count",  "d",          "default", "e",       "escape", "first",  "float",
      "indent",  "int",        "items",  "join",       "last",    "length",  "list",   "lower",  "map",
      "max",     "min",        "reject", "rejectattr", "replace", "reverse", "round",  "safe",   "select",
      "selectattr", "sort",    "string", "sum",        "title",   "tojson",  "trim",   "unique", "upper"};
  return s;
}

const std::set<std::string, std::less<>>& known_tests() {
  static const std::set<std::string, std::less<>> s = {
      "boolean", "callable", "defined", "divisibleby", "eq",    "equalto", "even",     "false",    "float",
      "ge",      "gt",       "in",      "integer",     "iterable", "le",   "lower",    "lt",       "mapping",
      "ne",      "none",     "number",  "odd",         "sameas", "sequence", "string", "true",     "undefined",
      "upper",   "==",       "!=",      "<",           "<=",     ">",        ">="};
  return s;
}

}  // namespace

namespace detail {
struct TemplateProgram {
  std::string source;  // normalized: "\n" line ends, one trailing newline dropped
  Body body;
};
}  // namespace detail

namespace {

// ---- Parser ---------------------------------------------------------------------------

// Recursive descent over the token stream with Jinja2's grammar:
//   expression := or ["if" or ["else" expression]]
//   or := and ("or" and)*        and := not ("and" not)*
//   not := "not" not | compare   compare := math1 (cmp_op math1)*
//   math1 := concat (("+"|"-") concat)*   concat := math2 ("~" math2)*
//   math2 := pow (("*"|"/"|"//"|"%") pow)*   pow := unary ("**" unary)*
//   unary := ("-"|"+") unary | primary postfix* (filter | test | call)*
class Parser {
 public:
  Parser(const std::string& src, std::vector<Token> tokens) : src_(src), toks_(std::move(tokens)) {}

  Status parse(Body* out) {
    std::string end;
    return parse_body(*out, {}, nullptr, &end);
  }

 private:
  const Token& cur() const { return toks_[i_]; }
  const Token& peek(size_t k = 1) const { return toks_[std::min(i_ + k, toks_.size() - 1)]; }
  bool is_op(std::string_view op) const { return cur().kind == Tok::kOp && cur().text == op; }
  bool is_name(std::string_view w) const { return cur().kind == Tok::kName && cur().text == w; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    ++i_;
    return true;
  }
  bool skip_name(std::string_view w) {
    if (!is_name(w)) return false;
    ++i_;
    return true;
  }

  Status error(const Token& t, const std::string& what) const { return error_at(src_, t.pos, what); }

  static std::string describe(const Token& t) {
    switch (t.kind) {
      case Tok::kText: return "template text";
      case Tok::kVarBegin: return "'{{'";
      case Tok::kVarEnd: return "'}}'";
      case Tok::kBlockBegin: return "'{%'";
      case Tok::kBlockEnd: return "'%}'";
      case Tok::kName: return "'" + t.text + "'";
      case Tok::kString: return "a string";
      case Tok::kInt:
      case Tok::kFloat: return "a number";
      case Tok::kOp: return "'" + t.text + "'";
      case Tok::kEof: return "end of template";
    }
    return "?";
  }

  Status expect_op(std::string_view op) {
    if (skip_op(op)) return ok_status();
    return error(cur(), "expected '" + std::string(op) + "', got " + describe(cur()));
  }

  Status expect_block_end() {
    if (cur().kind == Tok::kBlockEnd) {
      ++i_;
      return ok_status();
    }
    return error(cur(), "expected '%}', got " + describe(cur()));
  }

  StatusOr<std::string> expect_name(const char* what) {
    if (cur().kind != Tok::kName) return error(cur(), std::string("expected ") + what + ", got " + describe(cur()));
    return toks_[i_++].text;
  }

  // Template text and tags until a block tag named in `ends`, whose name is
  // consumed and returned in *end. `opener` is the tag being closed.
  Status parse_body(Body& out, std::vector<std::string_view> ends, const Token* opener, std::string* end) {
    while (true) {
      const Token& t = cur();
      if (t.kind == Tok::kText) {
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kText;
        node->pos = t.pos;
        node->text = t.text;
        out.push_back(std::move(node));
        ++i_;
      } else if (t.kind == Tok::kVarBegin) {
        ++i_;
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kOutput;
        node->pos = t.pos;
        NUCLEUS_ASSIGN_OR_RETURN(node->expr, parse_expression(true));
        if (cur().kind != Tok::kVarEnd) return error(cur(), "expected '}}', got " + describe(cur()));
        ++i_;
        out.push_back(std::move(node));
      } else if (t.kind == Tok::kBlockBegin) {
        const Token& word = peek();
        if (word.kind != Tok::kName) return error(word, "expected a tag name, got " + describe(word));
        if (std::find(ends.begin(), ends.end(), word.text) != ends.end()) {
          *end = word.text;
          i_ += 2;
          return ok_status();
        }
        bool closer = word.text.rfind("end", 0) == 0 || word.text == "else" || word.text == "elif";
        if (closer && opener)
          return error(word, "unexpected tag '" + word.text + "': the {% " + opener->text + " %} at " +
                                 line_column(src_, opener->pos) + " needs {% " + std::string(ends.back()) + " %}");
        i_ += 2;
        NUCLEUS_RETURN_IF_ERROR(parse_statement(word, out));
      } else if (t.kind == Tok::kEof) {
        if (ends.empty()) return ok_status();
        return error(t, "unexpected end of template: the {% " + opener->text + " %} at " +
                            line_column(src_, opener->pos) + " needs {% " + std::string(ends.back()) +
                            " %}");
      } else {
        return error(t, "unexpected " + describe(t));
      }
    }
  }

  Status parse_statement(const Token& word, Body& out) {
    const std::string& w = word.text;
    auto node = std::make_unique<Node>();
    node->pos = word.pos;
    std::string end;
    if (w == "if") {
      node->kind = Node::Kind::kIf;
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr cond, parse_expression(true));
      while (true) {
        NUCLEUS_RETURN_IF_ERROR(expect_block_end());
        Body body;
        NUCLEUS_RETURN_IF_ERROR(parse_body(body, {"elif", "else", "endif"}, &word, &end));
        node->branches.emplace_back(std::move(cond), std::move(body));
        if (end != "elif") break;
        NUCLEUS_ASSIGN_OR_RETURN(cond, parse_expression(true));
      }
      if (end == "else") {
        NUCLEUS_RETURN_IF_ERROR(expect_block_end());
        NUCLEUS_RETURN_IF_ERROR(parse_body(node->else_body, {"endif"}, &word, &end));
      }
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "for") {
      node->kind = Node::Kind::kFor;
      bool paren = skip_op("(");
      do {
        NUCLEUS_ASSIGN_OR_RETURN(std::string target, expect_name("a loop variable"));
        node->targets.push_back(std::move(target));
      } while (skip_op(","));
      if (paren) NUCLEUS_RETURN_IF_ERROR(expect_op(")"));
      if (!skip_name("in")) return error(cur(), "expected 'in', got " + describe(cur()));
      NUCLEUS_ASSIGN_OR_RETURN(node->expr, parse_expression(false));
      if (skip_name("if")) {
        NUCLEUS_ASSIGN_OR_RETURN(node->filter, parse_expression(true));
      }
      if (is_name("recursive")) return error(cur(), "recursive for loops are not supported");
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
      ++loop_depth_;
      Status s = parse_body(node->body, {"else", "endfor"}, &word, &end);
      --loop_depth_;
      NUCLEUS_RETURN_IF_ERROR(s);
      if (end == "else") {
        NUCLEUS_RETURN_IF_ERROR(expect_block_end());
        NUCLEUS_RETURN_IF_ERROR(parse_body(node->else_body, {"endfor"}, &word, &end));
      }
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "set") {
      NUCLEUS_ASSIGN_OR_RETURN(std::string name, expect_name("a variable name"));
      node->targets.push_back(std::move(name));
      if (skip_op(".")) {
        node->kind = Node::Kind::kSetAttr;
        NUCLEUS_ASSIGN_OR_RETURN(std::string attr, expect_name("an attribute name"));
        node->targets.push_back(std::move(attr));
      } else {
        node->kind = Node::Kind::kSet;
        while (skip_op(",")) {
          NUCLEUS_ASSIGN_OR_RETURN(std::string more, expect_name("a variable name"));
          node->targets.push_back(std::move(more));
        }
      }
      if (node->kind == Node::Kind::kSet && node->targets.size() == 1 && cur().kind == Tok::kBlockEnd) {
        node->kind = Node::Kind::kSetBlock;
        ++i_;
        NUCLEUS_RETURN_IF_ERROR(parse_body(node->body, {"endset"}, &word, &end));
      } else {
        NUCLEUS_RETURN_IF_ERROR(expect_op("="));
        NUCLEUS_ASSIGN_OR_RETURN(node->expr, parse_tuple_expression());
      }
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "macro") {
      node->kind = Node::Kind::kMacro;
      NUCLEUS_ASSIGN_OR_RETURN(node->text, expect_name("a macro name"));
      NUCLEUS_RETURN_IF_ERROR(expect_op("("));
      while (!is_op(")")) {
        NUCLEUS_ASSIGN_OR_RETURN(std::string param, expect_name("a parameter name"));
        node->targets.push_back(std::move(param));
        ExprPtr def;
        if (skip_op("=")) {
          NUCLEUS_ASSIGN_OR_RETURN(def, parse_expression(true));
        }
        node->defaults.push_back(std::move(def));
        if (!skip_op(",")) break;
      }
      NUCLEUS_RETURN_IF_ERROR(expect_op(")"));
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
      int saved = loop_depth_;
      loop_depth_ = 0;
      Status s = parse_body(node->body, {"endmacro"}, &word, &end);
      loop_depth_ = saved;
      NUCLEUS_RETURN_IF_ERROR(s);
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "break" || w == "continue") {
      if (loop_depth_ == 0) return error(word, "'" + w + "' outside of a for loop");
      node->kind = w == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "generation") {
      // transformers' {% generation %} marks assistant text for masks; it
      // renders as its body.
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
      NUCLEUS_RETURN_IF_ERROR(parse_body(out, {"endgeneration"}, &word, &end));
      return expect_block_end();
    } else if (w == "include" || w == "import" || w == "from" || w == "extends" || w == "block" || w == "call" ||
               w == "filter" || w == "with" || w == "autoescape" || w == "do") {
      return error(word, "the {% " + w + " %} tag is not supported");
    } else {
      return error(word, "unexpected tag '" + w + "'");
    }
    out.push_back(std::move(node));
    return ok_status();
  }

  static ExprPtr make(Expr::Kind kind, size_t pos) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    return e;
  }

  // An expression, or an implicit tuple "a, b" (right side of set).
  StatusOr<ExprPtr> parse_tuple_expression() {
    size_t pos = cur().pos;
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr first, parse_expression(true));
    if (!is_op(",")) return first;
    ExprPtr t = make(Expr::Kind::kTuple, pos);
    t->args.push_back(std::move(first));
    while (skip_op(",")) {
      if (cur().kind == Tok::kBlockEnd) break;
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr item, parse_expression(true));
      t->args.push_back(std::move(item));
    }
    return t;
  }

  StatusOr<ExprPtr> parse_expression(bool with_condition) {
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr e, parse_or());
    while (with_condition && is_name("if")) {
      size_t pos = cur().pos;
      ++i_;
      ExprPtr cond = make(Expr::Kind::kCond, pos);
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr test, parse_or());
      ExprPtr otherwise;
      if (skip_name("else")) {
        NUCLEUS_ASSIGN_OR_RETURN(otherwise, parse_expression(true));
      }
      cond->args.push_back(std::move(e));
      cond->args.push_back(std::move(test));
      cond->args.push_back(std::move(otherwise));
      e = std::move(cond);
    }
    return e;
  }

  StatusOr<ExprPtr> parse_or() {
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr e, parse_and());
    while (is_name("or")) {
      ExprPtr b = make(Expr::Kind::kOr, toks_[i_++].pos);
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr r, parse_and());
      b->args.push_back(std::move(e));
      b->args.push_back(std::move(r));
      e = std::move(b);
    }
    return e;
  }

  StatusOr<ExprPtr> parse_and() {
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr e, parse_not());
    while (is_name("and")) {
      ExprPtr b = make(Expr::Kind::kAnd, toks_[i_++].pos);
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr r, parse_not());
      b->args.push_back(std::move(e));
      b->args.push_back(std::move(r));
      e = std::move(b);
    }
    return e;
  }

  StatusOr<ExprPtr> parse_not() {
    if (is_name("not")) {
      ExprPtr e = make(Expr::Kind::kNot, toks_[i_++].pos);
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr inner, parse_not());
      e->args.push_back(std::move(inner));
      return e;
    }
    return parse_compare();
  }

  StatusOr<ExprPtr> parse_compare() {
    size_t pos = cur().pos;
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr first, parse_math1());
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().kind == Tok::kOp &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op("<=") || is_op(">") || is_op(">="))) {
        op = toks_[i_++].text;
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && peek().kind == Tok::kName && peek().text == "in") {
        i_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Kind::kCompare, pos);
        cmp->args.push_back(std::move(first));
      }
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr r, parse_math1());
      cmp->ops.push_back(std::move(op));
      cmp->args.push_back(std::move(r));
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  // Left-associative binary operators at one precedence level.
  template <typename Next>
  StatusOr<ExprPtr> parse_binary(std::initializer_list<std::string_view> ops, Next next) {
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr e, (this->*next)());
    while (true) {
      std::string op;
      for (std::string_view o : ops)
        if (is_op(o)) op = o;
      if (op.empty()) return e;
      ExprPtr b = make(Expr::Kind::kBinary, toks_[i_++].pos);
      b->name = op;
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr r, (this->*next)());
      b->args.push_back(std::move(e));
      b->args.push_back(std::move(r));
      e = std::move(b);
    }
  }

  StatusOr<ExprPtr> parse_math1() { return parse_binary({"+", "-"}, &Parser::parse_concat); }

  StatusOr<ExprPtr> parse_concat() {
    size_t pos = cur().pos;
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr first, parse_math2());
    if (!is_op("~")) return first;
    ExprPtr c = make(Expr::Kind::kConcat, pos);
    c->args.push_back(std::move(first));
    while (skip_op("~")) {
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr r, parse_math2());
      c->args.push_back(std::move(r));
    }
    return c;
  }

  StatusOr<ExprPtr> parse_math2() { return parse_binary({"*", "/", "//", "%"}, &Parser::parse_pow); }
  StatusOr<ExprPtr> parse_pow() { return parse_binary({"**"}, &Parser::parse_unary_filtered); }
  StatusOr<ExprPtr> parse_unary_filtered() { return parse_unary(true); }

  StatusOr<ExprPtr> parse_unary(bool with_filter) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      e = make(is_op("-") ? Expr::Kind::kNeg : Expr::Kind::kPos, cur().pos);
      ++i_;
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr inner, parse_unary(false));
      e->args.push_back(std::move(inner));
    } else {
      NUCLEUS_ASSIGN_OR_RETURN(e, parse_primary());
    }
    NUCLEUS_ASSIGN_OR_RETURN(e, parse_postfix(std::move(e)));
    if (with_filter) {
      NUCLEUS_ASSIGN_OR_RETURN(e, parse_filters(std::move(e)));
    }
    return e;
  }

  StatusOr<ExprPtr> parse_primary() {
    const Token& t = cur();
    if (t.kind == Tok::kName) {
      ++i_;
      ExprPtr e = make(Expr::Kind::kLiteral, t.pos);
      if (t.text == "true" || t.text == "True") {
        e->literal = true;
      } else if (t.text == "false" || t.text == "False") {
        e->literal = false;
      } else if (t.text == "none" || t.text == "None") {
        e->literal = nullptr;
      } else {
        e->kind = Expr::Kind::kName;
        e->name = t.text;
      }
      return e;
    }
    if (t.kind == Tok::kString) {
      ExprPtr e = make(Expr::Kind::kLiteral, t.pos);
      std::string s;
      while (cur().kind == Tok::kString) s += toks_[i_++].text;  // adjacent literals join
      e->literal = std::move(s);
      return e;
    }
    if (t.kind == Tok::kInt || t.kind == Tok::kFloat) {
      ++i_;
      ExprPtr e = make(Expr::Kind::kLiteral, t.pos);
      if (t.kind == Tok::kInt) {
        e->literal = t.int_value;
      } else {
        e->literal = t.float_value;
      }
      return e;
    }
    if (skip_op("(")) {
      if (skip_op(")")) return make(Expr::Kind::kTuple, t.pos);
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr e, parse_expression(true));
      if (is_op(",")) {
        ExprPtr tuple = make(Expr::Kind::kTuple, t.pos);
        tuple->args.push_back(std::move(e));
        while (skip_op(",") && !is_op(")")) {
          NUCLEUS_ASSIGN_OR_RETURN(ExprPtr item, parse_expression(true));
          tuple->args.push_back(std::move(item));
        }
        e = std::move(tuple);
      }
      NUCLEUS_RETURN_IF_ERROR(expect_op(")"));
      return e;
    }
    if (skip_op("[")) {
      ExprPtr e = make(Expr::Kind::kList, t.pos);
      while (!is_op("]")) {
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr item, parse_expression(true));
        e->args.push_back(std::move(item));
        if (!skip_op(",")) break;
      }
      NUCLEUS_RETURN_IF_ERROR(expect_op("]"));
      return e;
    }
    if (skip_op("{")) {
      ExprPtr e = make(Expr::Kind::kDict, t.pos);
      while (!is_op("}")) {
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr key, parse_expression(true));
        NUCLEUS_RETURN_IF_ERROR(expect_op(":"));
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr value, parse_expression(true));
        e->args.push_back(std::move(key));
        e->args.push_back(std::move(value));
        if (!skip_op(",")) break;
      }
      NUCLEUS_RETURN_IF_ERROR(expect_op("}"));
      return e;
    }
    return error(t, "expected an expression, got " + describe(t));
  }

  // .name, .0, [index], [a:b:c], (args)
  StatusOr<ExprPtr> parse_postfix(ExprPtr e) {
    while (true) {
      size_t pos = cur().pos;
      if (skip_op(".")) {
        if (cur().kind == Tok::kInt) {
          ExprPtr item = make(Expr::Kind::kGetItem, pos);
          ExprPtr index = make(Expr::Kind::kLiteral, cur().pos);
          index->literal = toks_[i_++].int_value;
          item->args.push_back(std::move(e));
          item->args.push_back(std::move(index));
          e = std::move(item);
          continue;
        }
        ExprPtr attr = make(Expr::Kind::kGetAttr, pos);
        NUCLEUS_ASSIGN_OR_RETURN(attr->name, expect_name("an attribute name"));
        attr->args.push_back(std::move(e));
        e = std::move(attr);
      } else if (is_op("[")) {
        NUCLEUS_ASSIGN_OR_RETURN(e, parse_subscript(std::move(e)));
      } else if (is_op("(")) {
        NUCLEUS_ASSIGN_OR_RETURN(e, parse_call(std::move(e)));
      } else {
        return e;
      }
    }
  }

  StatusOr<ExprPtr> parse_subscript(ExprPtr target) {
    size_t pos = cur().pos;
    NUCLEUS_RETURN_IF_ERROR(expect_op("["));
    ExprPtr parts[3];
    bool slice = false;
    if (!is_op(":")) {
      NUCLEUS_ASSIGN_OR_RETURN(parts[0], parse_expression(true));
    }
    if (skip_op(":")) {
      slice = true;
      if (!is_op("]") && !is_op(":")) {
        NUCLEUS_ASSIGN_OR_RETURN(parts[1], parse_expression(true));
      }
      if (skip_op(":") && !is_op("]")) {
        NUCLEUS_ASSIGN_OR_RETURN(parts[2], parse_expression(true));
      }
    }
    NUCLEUS_RETURN_IF_ERROR(expect_op("]"));
    ExprPtr e = make(slice ? Expr::Kind::kSlice : Expr::Kind::kGetItem, pos);
    e->args.push_back(std::move(target));
    e->args.push_back(std::move(parts[0]));
    if (slice) {
      e->args.push_back(std::move(parts[1]));
      e->args.push_back(std::move(parts[2]));
    }
    return e;
  }

  // "(" [arg ("," arg)*] ")" into e->args (after what is already there) and
  // e->kwargs; arg := name "=" expression | expression.
  Status parse_args(Expr& e) {
    NUCLEUS_RETURN_IF_ERROR(expect_op("("));
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) return error(cur(), "*args and **kwargs in calls are not supported");
      if (cur().kind == Tok::kName && peek().kind == Tok::kOp && peek().text == "=") {
        std::string key = toks_[i_].text;
        i_ += 2;
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr value, parse_expression(true));
        e.kwargs.emplace_back(std::move(key), std::move(value));
      } else {
        if (!e.kwargs.empty()) return error(cur(), "positional argument follows keyword argument");
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr value, parse_expression(true));
        e.args.push_back(std::move(value));
      }
      if (!skip_op(",")) break;
    }
    return expect_op(")");
  }

  StatusOr<ExprPtr> parse_call(ExprPtr callee) {
    ExprPtr e = make(Expr::Kind::kCall, cur().pos);
    e->args.push_back(std::move(callee));
    NUCLEUS_RETURN_IF_ERROR(parse_args(*e));
    return e;
  }

  // Filters, tests and calls after a unary expression: x | f(a) is not none.
  StatusOr<ExprPtr> parse_filters(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        ++i_;
        ExprPtr f = make(Expr::Kind::kFilter, cur().pos);
        NUCLEUS_ASSIGN_OR_RETURN(f->name, expect_name("a filter name"));
        if (!known_filters().count(f->name)) return error_at(src_, f->pos, "no filter named '" + f->name + "'");
        f->args.push_back(std::move(e));
        if (is_op("(")) NUCLEUS_RETURN_IF_ERROR(parse_args(*f));
        e = std::move(f);
      } else if (is_name("is")) {
        ++i_;
        ExprPtr t = make(Expr::Kind::kTest, cur().pos);
        t->negated = skip_name("not");
        if (cur().kind == Tok::kName) {
          t->name = toks_[i_++].text;
        } else {
          return error(cur(), "expected a test name, got " + describe(cur()));
        }
        if (!known_tests().count(t->name)) return error_at(src_, t->pos, "no test named '" + t->name + "'");
        t->args.push_back(std::move(e));
        const Token& c = cur();
        bool arg_start = c.kind == Tok::kName || c.kind == Tok::kString || c.kind == Tok::kInt ||
                         c.kind == Tok::kFloat || (c.kind == Tok::kOp && (c.text == "[" || c.text == "{"));
        if (is_op("(")) {
          NUCLEUS_RETURN_IF_ERROR(parse_args(*t));
        } else if (arg_start && !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") &&
                   !is_name("is")) {
          // One argument without parentheses: "x is divisibleby 3".
          NUCLEUS_ASSIGN_OR_RETURN(ExprPtr arg, parse_primary());
          NUCLEUS_ASSIGN_OR_RETURN(arg, parse_postfix(std::move(arg)));
          t->args.push_back(std::move(arg));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        NUCLEUS_ASSIGN_OR_RETURN(e, parse_call(std::move(e)));
      } else {
        return e;
      }
    }
  }

  const std::string& src_;
  std::vector<Token> toks_;
  size_t i_ = 0;
  int loop_depth_ = 0;  // enclosing for loops, for break / continue
};

// ---- Values ---------------------------------------------------------------------------

struct Namespace;

// A template value: a JSON value (borrowed from the context or the syntax
// tree, or owned through `keep`), Undefined, a namespace, a macro or a
// global function. Copies are cheap: JSON is shared, never copied, when a
// value is passed around or an item of it taken.
struct Value {
  enum class Kind { kUndefined, kJson, kNamespace, kMacro, kFunction };
  Kind kind = Kind::kUndefined;
  const json* j = nullptr;
  std::shared_ptr<const json> keep;  // owner of *j; null when *j outlives the render
  std::shared_ptr<Namespace> ns;
  const Node* macro = nullptr;
  std::string name;  // kUndefined: the error to report if it is used; kFunction: its name

  static Value undefined(std::string why) {
    Value v;
    v.name = std::move(why);
    return v;
  }
  static Value of(json value) {
    auto p = std::make_shared<const json>(std::move(value));
    Value v;
    v.kind = Kind::kJson;
    v.j = p.get();
    v.keep = std::move(p);
    return v;
  }
  // A value inside `parent` (or in the context / syntax tree).
  static Value ref(const json& value, const std::shared_ptr<const json>& keep = nullptr) {
    Value v;
    v.kind = Kind::kJson;
    v.j = &value;
    v.keep = keep;
    return v;
  }

  bool is_json() const { return kind == Kind::kJson; }
  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_string() const { return is_json() && j->is_string(); }
  bool is_array() const { return is_json() && j->is_array(); }
  bool is_object() const { return is_json() && j->is_object(); }
  const std::string& str() const { return j->get_ref<const std::string&>(); }
};

struct Namespace {
  std::map<std::string, Value> attrs;
  bool is_loop = false;  // the `loop` variable, which has cycle()
};

Value child(const Value& parent, const json& item) { return Value::ref(item, parent.keep); }

Value namespace_value(std::shared_ptr<Namespace> ns) {
  Value v;
  v.kind = Value::Kind::kNamespace;
  v.ns = std::move(ns);
  return v;
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNamespace: return "Namespace";
    case Value::Kind::kMacro: return "Macro";
    case Value::Kind::kFunction: return "builtin_function_or_method";
    case Value::Kind::kJson: break;
  }
  switch (v.j->type()) {
    case json::value_t::null: return "NoneType";
    case json::value_t::boolean: return "bool";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "int";
    case json::value_t::number_float: return "float";
    case json::value_t::string: return "str";
    case json::value_t::array: return "list";
    case json::value_t::object: return "dict";
    default: return "object";
  }
}

// Python numbers: bool and int are integers, float is not.
bool is_number(const json& j) { return j.is_number() || j.is_boolean(); }
bool is_integral(const json& j) { return j.is_number_integer() || j.is_boolean(); }
int64_t as_int(const json& j) {
  if (j.is_boolean()) return j.get<bool>() ? 1 : 0;
  if (j.is_number_unsigned()) return static_cast<int64_t>(j.get<uint64_t>());
  if (j.is_number_float()) return static_cast<int64_t>(j.get<double>());
  return j.get<int64_t>();
}
double as_double(const json& j) { return j.is_boolean() ? (j.get<bool>() ? 1.0 : 0.0) : j.get<double>(); }
bool is_int_value(const Value& v) { return v.is_json() && is_integral(*v.j); }
bool is_num_value(const Value& v) { return v.is_json() && is_number(*v.j); }

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return false;
    case Value::Kind::kJson: break;
    default: return true;
  }
  const json& j = *v.j;
  switch (j.type()) {
    case json::value_t::null: return false;
    case json::value_t::boolean: return j.get<bool>();
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return as_int(j) != 0;
    case json::value_t::number_float: return j.get<double>() != 0.0;
    case json::value_t::string: return !j.get_ref<const std::string&>().empty();  // json::empty() is false for strings
    case json::value_t::array:
    case json::value_t::object: return !j.empty();
    default: return false;
  }
}

// Python's repr() of a JSON value inside a container.
void py_repr(const json& j, std::string& out);

// Python's str(): what {{ value }} prints.
void py_str(const json& j, std::string& out) {
  switch (j.type()) {
    case json::value_t::null: out += "None"; break;
    case json::value_t::boolean: out += j.get<bool>() ? "True" : "False"; break;
    case json::value_t::number_integer: out += std::to_string(j.get<int64_t>()); break;
    case json::value_t::number_unsigned: out += std::to_string(j.get<uint64_t>()); break;
    case json::value_t::number_float: out += py_float(j.get<double>()); break;
    case json::value_t::string: out += j.get_ref<const std::string&>(); break;
    default: py_repr(j, out); break;
  }
}

void py_repr(const json& j, std::string& out) {
  if (j.is_string()) {
    py_repr_string(j.get_ref<const std::string&>(), out);
  } else if (j.is_array()) {
    out += '[';
    for (size_t k = 0; k < j.size(); ++k) {
      if (k) out += ", ";
      py_repr(j[k], out);
    }
    out += ']';
  } else if (j.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [key, item] : j.items()) {
      if (!first) out += ", ";
      first = false;
      py_repr_string(key, out);
      out += ": ";
      py_repr(item, out);
    }
    out += '}';
  } else {
    py_str(j, out);
  }
}

void append_str(const Value& v, std::string& out) {
  switch (v.kind) {
    case Value::Kind::kUndefined: break;
    case Value::Kind::kJson: py_str(*v.j, out); break;
    case Value::Kind::kNamespace: out += "<Namespace>"; break;
    case Value::Kind::kMacro: out += "<Macro '" + v.macro->text + "'>"; break;
    case Value::Kind::kFunction: out += "<built-in function " + v.name + ">"; break;
  }
}

std::string to_str(const Value& v) {
  if (v.is_string()) return v.str();
  std::string s;
  append_str(v, s);
  return s;
}

// Python ==, with 1 == 1.0 == True.
bool json_eq(const json& a, const json& b) {
  if (is_number(a) && is_number(b)) {
    if (is_integral(a) && is_integral(b)) return as_int(a) == as_int(b);
    if (a.is_number_unsigned() || b.is_number_unsigned()) return a == b;
    return as_double(a) == as_double(b);
  }
  if (a.type() != b.type()) return false;
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (size_t k = 0; k < a.size(); ++k)
      if (!json_eq(a[k], b[k])) return false;
    return true;
  }
  if (a.is_object()) {
    if (a.size() != b.size()) return false;
    for (const auto& [key, item] : a.items()) {
      auto it = b.find(key);
      if (it == b.end() || !json_eq(item, *it)) return false;
    }
    return true;
  }
  return a == b;
}

bool values_eq(const Value& a, const Value& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined: return true;
    case Value::Kind::kJson: return json_eq(*a.j, *b.j);
    case Value::Kind::kNamespace: return a.ns == b.ns;
    case Value::Kind::kMacro: return a.macro == b.macro;
    case Value::Kind::kFunction: return a.name == b.name;
  }
  return false;
}

// Python ordering (<0, 0, >0) of numbers, strings and lists; nullopt when
// Python would raise TypeError.
std::optional<int> json_cmp(const json& a, const json& b) {
  if (is_number(a) && is_number(b)) {
    if (is_integral(a) && is_integral(b)) {
      int64_t x = as_int(a), y = as_int(b);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    double x = as_double(a), y = as_double(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    int c = a.get_ref<const std::string&>().compare(b.get_ref<const std::string&>());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_array() && b.is_array()) {
    for (size_t k = 0; k < a.size() && k < b.size(); ++k) {
      if (json_eq(a[k], b[k])) continue;
      return json_cmp(a[k], b[k]);
    }
    return a.size() < b.size() ? -1 : a.size() > b.size() ? 1 : 0;
  }
  return std::nullopt;
}

// Positional and keyword arguments of a call, filter or test.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;

  // The argument at position `i` or named `name`; null when not given.
  const Value* get(size_t i, std::string_view name) const {
    if (i < pos.size()) return &pos[i];
    return kwarg(name);
  }
  // The keyword argument `name`; null when not given.
  const Value* kwarg(std::string_view name) const {
    for (const auto& [k, v] : kw)
      if (k == name) return &v;
    return nullptr;
  }
};

// Python slicing of a sequence of `n` items: the indexes taken, in order.
std::vector<size_t> slice_indexes(int64_t n, std::optional<int64_t> start, std::optional<int64_t> stop, int64_t step) {
  std::vector<size_t> out;
  auto clamp = [&](std::optional<int64_t> v, int64_t def, int64_t lo, int64_t hi) {
    if (!v) return def;
    int64_t x = *v < 0 ? *v + n : *v;
    return std::clamp(x, lo, hi);
  };
  if (step > 0) {
    int64_t b = clamp(start, 0, 0, n), e = clamp(stop, n, 0, n);
    for (int64_t i = b; i < e; i += step) out.push_back(static_cast<size_t>(i));
  } else {
    int64_t b = clamp(start, n - 1, -1, n - 1), e = clamp(stop, -1, -1, n - 1);
    for (int64_t i = b; i > e; i += step) out.push_back(static_cast<size_t>(i));
  }
  return out;
}

// ---- Renderer -------------------------------------------------------------------------

// Variables of one scope; lookups go to the parent, the template's top
// level being the last scope before the render context and the globals.
struct Scope {
  Scope* parent = nullptr;
  std::unordered_map<std::string, Value> vars;
};

class Renderer {
 public:
  Renderer(const detail::TemplateProgram& program, const json& context) : prog_(program), ctx_(context) {}

  Status render(std::string& out) { return exec(prog_.body, top_, out); }

 private:
  Status err(size_t pos, const std::string& what) const { return error_at(prog_.source, pos, what); }

  // Runs `body`; stops early when a break / continue is pending.
  Status exec(const Body& body, Scope& scope, std::string& out) {
    for (const auto& node : body) {
      NUCLEUS_RETURN_IF_ERROR(exec_node(*node, scope, out));
      if (flow_ != Flow::kNormal) break;
    }
    return ok_status();
  }

  // Counts one step of the render against kMaxRenderSteps.
  Status step(size_t pos) {
    if (++steps_ > kMaxRenderSteps)
      return err(pos, "the template ran more than " + std::to_string(kMaxRenderSteps) + " steps (a runaway loop?)");
    return ok_status();
  }
  Status check_size(size_t bytes, size_t pos) const {
    if (bytes > kMaxStringBytes)
      return err(pos, "the template built a string of more than " + std::to_string(kMaxStringBytes) + " bytes");
    return ok_status();
  }

  Status exec_node(const Node& node, Scope& scope, std::string& out) {
    NUCLEUS_RETURN_IF_ERROR(step(node.pos));
    NUCLEUS_RETURN_IF_ERROR(check_size(out.size(), node.pos));
    switch (node.kind) {
      case Node::Kind::kText: out += node.text; return ok_status();
      case Node::Kind::kOutput: {
        NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*node.expr, scope));
        append_str(v, out);
        return ok_status();
      }
      case Node::Kind::kIf:
        for (const auto& [cond, body] : node.branches) {
          NUCLEUS_ASSIGN_OR_RETURN(Value c, eval(*cond, scope));
          if (truthy(c)) return exec(body, scope, out);
        }
        return exec(node.else_body, scope, out);
      case Node::Kind::kFor: return exec_for(node, scope, out);
      case Node::Kind::kSet: {
        NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*node.expr, scope));
        return bind(node.targets, v, scope, node.pos);
      }
      case Node::Kind::kSetAttr: {
        NUCLEUS_ASSIGN_OR_RETURN(Value target, lookup(node.targets[0], scope));
        if (target.kind != Value::Kind::kNamespace || target.ns->is_loop)
          return err(node.pos, "cannot assign attribute '" + node.targets[1] + "' of '" + node.targets[0] +
                                   "': it is not a namespace()");
        NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*node.expr, scope));
        target.ns->attrs[node.targets[1]] = std::move(v);
        return ok_status();
      }
      case Node::Kind::kSetBlock: {
        std::string text;
        NUCLEUS_RETURN_IF_ERROR(exec(node.body, scope, text));
        scope.vars[node.targets[0]] = Value::of(std::move(text));
        return ok_status();
      }
      case Node::Kind::kMacro: {
        Value m;
        m.kind = Value::Kind::kMacro;
        m.macro = &node;
        scope.vars[node.text] = std::move(m);
        return ok_status();
      }
      case Node::Kind::kBreak: flow_ = Flow::kBreak; return ok_status();
      case Node::Kind::kContinue: flow_ = Flow::kContinue; return ok_status();
    }
    return ok_status();
  }

  // Assigns `v` to one name, or unpacks a list over several.
  Status bind(const std::vector<std::string>& targets, const Value& v, Scope& scope, size_t pos) {
    if (targets.size() == 1) {
      scope.vars[targets[0]] = v;
      return ok_status();
    }
    if (!v.is_array() || v.j->size() != targets.size())
      return err(pos, std::string("cannot unpack a ") + type_name(v) + " into " + std::to_string(targets.size()) +
                          " variables");
    for (size_t k = 0; k < targets.size(); ++k) scope.vars[targets[k]] = child(v, (*v.j)[k]);
    return ok_status();
  }

  // The items a for loop (or a filter) walks: list items, dict keys, string
  // characters; nothing for undefined.
  Status iterate(const Value& v, size_t pos, std::vector<Value>& items) {
    if (v.is_undefined()) return ok_status();
    if (v.is_array()) {
      for (const json& item : *v.j) items.push_back(child(v, item));
    } else if (v.is_object()) {
      for (const auto& [key, item] : v.j->items()) items.push_back(Value::of(key));
    } else if (v.is_string()) {
      for (std::string_view c : utf8_chars(v.str())) items.push_back(Value::of(std::string(c)));
    } else {
      return err(pos, std::string("'") + type_name(v) + "' object is not iterable");
    }
    return ok_status();
  }

  Status exec_for(const Node& node, Scope& scope, std::string& out) {
    NUCLEUS_ASSIGN_OR_RETURN(Value seq, eval(*node.expr, scope));
    std::vector<Value> items;
    NUCLEUS_RETURN_IF_ERROR(iterate(seq, node.expr->pos, items));
    if (node.filter) {
      std::vector<Value> kept;
      for (Value& item : items) {
        Scope s{&scope, {}};
        NUCLEUS_RETURN_IF_ERROR(bind(node.targets, item, s, node.pos));
        NUCLEUS_ASSIGN_OR_RETURN(Value keep, eval(*node.filter, s));
        if (truthy(keep)) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      Scope s{&scope, {}};
      return exec(node.else_body, s, out);
    }
    const auto n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      // Each iteration starts from the enclosing scope: what the body sets
      // is gone at the next one (Jinja2 semantics). An iteration is a step,
      // even of an empty body.
      NUCLEUS_RETURN_IF_ERROR(step(node.pos));
      Scope s{&scope, {}};
      NUCLEUS_RETURN_IF_ERROR(bind(node.targets, items[k], s, node.pos));
      auto loop = std::make_shared<Namespace>();
      loop->is_loop = true;
      auto& a = loop->attrs;
      a["index"] = Value::of(k + 1);
      a["index0"] = Value::of(k);
      a["revindex"] = Value::of(n - k);
      a["revindex0"] = Value::of(n - k - 1);
      a["first"] = Value::of(k == 0);
      a["last"] = Value::of(k == n - 1);
      a["length"] = Value::of(n);
      a["depth"] = Value::of(1);
      a["depth0"] = Value::of(0);
      a["previtem"] = k > 0 ? items[k - 1] : Value::undefined("there is no previous item");
      a["nextitem"] = k + 1 < n ? items[k + 1] : Value::undefined("there is no next item");
      s.vars["loop"] = namespace_value(std::move(loop));
      NUCLEUS_RETURN_IF_ERROR(exec(node.body, s, out));
      Flow f = flow_;
      flow_ = Flow::kNormal;
      if (f == Flow::kBreak) break;
    }
    return ok_status();
  }

  StatusOr<Value> lookup(const std::string& name, Scope& scope) {
    for (Scope* s = &scope; s; s = s->parent) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return it->second;
    }
    if (ctx_.is_object()) {
      auto it = ctx_.find(name);
      if (it != ctx_.end()) return Value::ref(*it);
    }
    static const std::set<std::string, std::less<>> kGlobals = {"range", "namespace", "dict", "raise_exception",
                                                                "strftime_now"};
    if (kGlobals.count(name)) {
      Value f;
      f.kind = Value::Kind::kFunction;
      f.name = name;
      return f;
    }
    return Value::undefined("'" + name + "' is undefined");
  }

  StatusOr<Value> eval(const Expr& e, Scope& scope) {
    NUCLEUS_RETURN_IF_ERROR(step(e.pos));
    switch (e.kind) {
      case Expr::Kind::kLiteral: return Value::ref(e.literal);
      case Expr::Kind::kName: return lookup(e.name, scope);
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        json list = json::array();
        for (const auto& item : e.args) {
          NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*item, scope));
          NUCLEUS_ASSIGN_OR_RETURN(json j, to_json(v, item->pos, false));
          list.push_back(std::move(j));
        }
        return Value::of(std::move(list));
      }
      case Expr::Kind::kDict: {
        json dict = json::object();
        for (size_t k = 0; k < e.args.size(); k += 2) {
          NUCLEUS_ASSIGN_OR_RETURN(Value key, eval(*e.args[k], scope));
          if (!key.is_string()) return err(e.args[k]->pos, "dict keys must be strings");
          NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[k + 1], scope));
          NUCLEUS_ASSIGN_OR_RETURN(dict[key.str()], to_json(v, e.args[k + 1]->pos, false));
        }
        return Value::of(std::move(dict));
      }
      case Expr::Kind::kGetAttr: {
        NUCLEUS_ASSIGN_OR_RETURN(Value target, eval(*e.args[0], scope));
        return get_attr(target, e.name);
      }
      case Expr::Kind::kGetItem: {
        NUCLEUS_ASSIGN_OR_RETURN(Value target, eval(*e.args[0], scope));
        NUCLEUS_ASSIGN_OR_RETURN(Value key, eval(*e.args[1], scope));
        return get_item(target, key);
      }
      case Expr::Kind::kSlice: return eval_slice(e, scope);
      case Expr::Kind::kCall: return eval_call(e, scope);
      case Expr::Kind::kFilter: {
        NUCLEUS_ASSIGN_OR_RETURN(Value input, eval(*e.args[0], scope));
        NUCLEUS_ASSIGN_OR_RETURN(Args args, eval_args(e, 1, scope));
        return apply_filter(e.name, input, args, e.pos);
      }
      case Expr::Kind::kTest: {
        NUCLEUS_ASSIGN_OR_RETURN(Value input, eval(*e.args[0], scope));
        NUCLEUS_ASSIGN_OR_RETURN(Args args, eval_args(e, 1, scope));
        NUCLEUS_ASSIGN_OR_RETURN(bool r, apply_test(e.name, input, args, e.pos));
        return Value::of(r != e.negated);
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[0], scope));
        if (v.is_undefined()) return err(e.pos, v.name);
        if (!is_num_value(v))
          return err(e.pos, std::string("bad operand type for unary ") + (e.kind == Expr::Kind::kNeg ? "-" : "+") +
                                ": '" + type_name(v) + "'");
        if (e.kind == Expr::Kind::kPos) return v;
        if (is_integral(*v.j)) return Value::of(-as_int(*v.j));
        return Value::of(-as_double(*v.j));
      }
      case Expr::Kind::kNot: {
        NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[0], scope));
        return Value::of(!truthy(v));
      }
      case Expr::Kind::kBinary: {
        NUCLEUS_ASSIGN_OR_RETURN(Value a, eval(*e.args[0], scope));
        NUCLEUS_ASSIGN_OR_RETURN(Value b, eval(*e.args[1], scope));
        return arithmetic(e.name, a, b, e.pos);
      }
      case Expr::Kind::kAnd:
      case Expr::Kind::kOr: {
        // Python semantics: the deciding operand itself, not a bool.
        NUCLEUS_ASSIGN_OR_RETURN(Value a, eval(*e.args[0], scope));
        if (truthy(a) == (e.kind == Expr::Kind::kOr)) return a;
        return eval(*e.args[1], scope);
      }
      case Expr::Kind::kCompare: {
        NUCLEUS_ASSIGN_OR_RETURN(Value left, eval(*e.args[0], scope));
        for (size_t k = 0; k < e.ops.size(); ++k) {
          NUCLEUS_ASSIGN_OR_RETURN(Value right, eval(*e.args[k + 1], scope));
          NUCLEUS_ASSIGN_OR_RETURN(bool r, compare(e.ops[k], left, right, e.args[k + 1]->pos));
          if (!r) return Value::of(false);
          left = std::move(right);
        }
        return Value::of(true);
      }
      case Expr::Kind::kConcat: {
        std::string s;
        for (const auto& part : e.args) {
          NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*part, scope));
          append_str(v, s);
          NUCLEUS_RETURN_IF_ERROR(check_size(s.size(), e.pos));
        }
        return Value::of(std::move(s));
      }
      case Expr::Kind::kCond: {
        NUCLEUS_ASSIGN_OR_RETURN(Value c, eval(*e.args[1], scope));
        if (truthy(c)) return eval(*e.args[0], scope);
        if (e.args[2]) return eval(*e.args[2], scope);
        return Value::undefined("the inline if expression has no else branch");
      }
    }
    return err(e.pos, "internal error: unknown expression");
  }

  StatusOr<Args> eval_args(const Expr& e, size_t first, Scope& scope) {
    Args a;
    for (size_t k = first; k < e.args.size(); ++k) {
      NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[k], scope));
      a.pos.push_back(std::move(v));
    }
    for (const auto& [key, expr] : e.kwargs) {
      NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*expr, scope));
      a.kw.emplace_back(key, std::move(v));
    }
    return a;
  }

  // A JSON value for storing in a list or dict (undefined becomes null unless
  // `strict`, as for tojson).
  StatusOr<json> to_json(const Value& v, size_t pos, bool strict) {
    switch (v.kind) {
      case Value::Kind::kJson: return *v.j;
      case Value::Kind::kUndefined:
        if (strict) return err(pos, "Object of type Undefined is not JSON serializable");
        return json(nullptr);
      default: return err(pos, std::string("Object of type ") + type_name(v) + " is not JSON serializable");
    }
  }

  // x.name: a dict key or a namespace attribute; undefined otherwise
  // (chainable: attributes of undefined are undefined).
  Value get_attr(const Value& target, const std::string& name) {
    if (target.is_object()) {
      auto it = target.j->find(name);
      if (it != target.j->end()) return child(target, *it);
      return Value::undefined("'dict object' has no attribute '" + name + "'");
    }
    if (target.kind == Value::Kind::kNamespace) {
      auto it = target.ns->attrs.find(name);
      if (it != target.ns->attrs.end()) return it->second;
      return Value::undefined("'namespace' has no attribute '" + name + "'");
    }
    if (target.is_undefined()) return target;
    return Value::undefined(std::string("'") + type_name(target) + " object' has no attribute '" + name + "'");
  }

  // x[key]: list / string index (negative from the end), dict key.
  Value get_item(const Value& target, const Value& key) {
    if (target.is_undefined()) return target;
    if (key.is_string() && (target.is_object() || target.kind == Value::Kind::kNamespace))
      return get_attr(target, key.str());
    if (is_int_value(key) && (target.is_array() || target.is_string())) {
      int64_t i = as_int(*key.j);
      if (target.is_array()) {
        auto n = static_cast<int64_t>(target.j->size());
        if (i < 0) i += n;
        if (i >= 0 && i < n) return child(target, (*target.j)[static_cast<size_t>(i)]);
      } else {
        auto chars = utf8_chars(target.str());
        auto n = static_cast<int64_t>(chars.size());
        if (i < 0) i += n;
        if (i >= 0 && i < n) return Value::of(std::string(chars[static_cast<size_t>(i)]));
      }
      return Value::undefined(std::string("index ") + std::to_string(as_int(*key.j)) + " out of range");
    }
    std::string k;
    if (key.is_json()) py_repr(*key.j, k);
    return Value::undefined(std::string("'") + type_name(target) + " object' has no item " + k);
  }

  StatusOr<Value> eval_slice(const Expr& e, Scope& scope) {
    NUCLEUS_ASSIGN_OR_RETURN(Value target, eval(*e.args[0], scope));
    std::optional<int64_t> parts[3];
    for (int k = 0; k < 3; ++k) {
      if (!e.args[k + 1]) continue;
      NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[k + 1], scope));
      if (v.is_undefined() || (v.is_json() && v.j->is_null())) continue;
      if (!is_int_value(v)) return err(e.args[k + 1]->pos, "slice indices must be integers or none");
      parts[k] = as_int(*v.j);
    }
    int64_t step = parts[2].value_or(1);
    if (step == 0) return err(e.pos, "slice step cannot be zero");
    if (target.is_array()) {
      json out = json::array();
      for (size_t i : slice_indexes(static_cast<int64_t>(target.j->size()), parts[0], parts[1], step))
        out.push_back((*target.j)[i]);
      return Value::of(std::move(out));
    }
    if (target.is_string()) {
      auto chars = utf8_chars(target.str());
      std::string out;
      for (size_t i : slice_indexes(static_cast<int64_t>(chars.size()), parts[0], parts[1], step)) out += chars[i];
      return Value::of(std::move(out));
    }
    if (target.is_undefined()) return target;
    return err(e.pos, std::string("'") + type_name(target) + "' object is not subscriptable");
  }

  StatusOr<Value> eval_call(const Expr& e, Scope& scope) {
    const Expr& callee = *e.args[0];
    Value fn;
    if (callee.kind == Expr::Kind::kGetAttr) {
      // obj.method(...) on strings, dicts and loop: no bound-method values.
      NUCLEUS_ASSIGN_OR_RETURN(Value target, eval(*callee.args[0], scope));
      if (has_method(target, callee.name)) {
        NUCLEUS_ASSIGN_OR_RETURN(Args args, eval_args(e, 1, scope));
        return call_method(target, callee.name, args, e.pos);
      }
      fn = get_attr(target, callee.name);
    } else {
      NUCLEUS_ASSIGN_OR_RETURN(fn, eval(callee, scope));
    }
    NUCLEUS_ASSIGN_OR_RETURN(Args args, eval_args(e, 1, scope));
    switch (fn.kind) {
      case Value::Kind::kMacro: return call_macro(*fn.macro, args, e.pos);
      case Value::Kind::kFunction: return call_global(fn.name, args, e.pos);
      case Value::Kind::kUndefined: return err(e.pos, fn.name);
      default: return err(e.pos, std::string("'") + type_name(fn) + "' object is not callable");
    }
  }

  StatusOr<Value> call_macro(const Node& m, const Args& args, size_t pos) {
    if (args.pos.size() > m.targets.size())
      return err(pos, "macro '" + m.text + "' takes at most " + std::to_string(m.targets.size()) + " arguments (" +
                          std::to_string(args.pos.size()) + " given)");
    for (const auto& [key, v] : args.kw)
      if (std::find(m.targets.begin(), m.targets.end(), key) == m.targets.end())
        return err(pos, "macro '" + m.text + "' has no parameter named '" + key + "'");
    if (depth_ >= kMaxCallDepth) return err(pos, "macro calls nested too deeply (recursion?)");
    // A macro sees the template's top-level variables and its parameters,
    // not the caller's locals.
    Scope s{&top_, {}};
    for (size_t k = 0; k < m.targets.size(); ++k) {
      if (const Value* v = args.get(k, m.targets[k])) {
        s.vars[m.targets[k]] = *v;
      } else if (m.defaults[k]) {
        NUCLEUS_ASSIGN_OR_RETURN(s.vars[m.targets[k]], eval(*m.defaults[k], s));
      } else {
        s.vars[m.targets[k]] = Value::undefined("'" + m.targets[k] + "' is undefined");
      }
    }
    ++depth_;
    std::string out;
    Status st = exec(m.body, s, out);
    --depth_;
    flow_ = Flow::kNormal;
    NUCLEUS_RETURN_IF_ERROR(st);
    return Value::of(std::move(out));
  }

  StatusOr<Value> call_global(const std::string& name, const Args& args, size_t pos) {
    if (name == "raise_exception") {
      // The template's own message, for the client: no location prefix.
      const Value* msg = args.get(0, "message");
      return invalid_argument(msg ? to_str(*msg) : "raise_exception() called");
    }
    if (name == "range") {
      int64_t v[3] = {0, 0, 1};
      if (args.pos.empty() || args.pos.size() > 3) return err(pos, "range() takes 1 to 3 integer arguments");
      for (size_t k = 0; k < args.pos.size(); ++k) {
        if (!is_int_value(args.pos[k])) return err(pos, "range() arguments must be integers");
        v[args.pos.size() == 1 ? 1 : k] = as_int(*args.pos[k].j);
      }
      if (v[2] == 0) return err(pos, "range() step must not be zero");
      __int128 span = v[2] > 0 ? __int128{v[1]} - v[0] : __int128{v[0]} - v[1];
      __int128 step = v[2] > 0 ? v[2] : -__int128{v[2]};
      __int128 count = span > 0 ? (span + step - 1) / step : 0;
      if (count > kMaxRange) return err(pos, "range() is too large (over " + std::to_string(kMaxRange) + " items)");
      json out = json::array();
      for (int64_t k = 0; k < static_cast<int64_t>(count); ++k) out.push_back(v[0] + k * v[2]);
      return Value::of(std::move(out));
    }
    if (name == "namespace" || name == "dict") {
      auto ns = std::make_shared<Namespace>();
      json d = json::object();
      if (!args.pos.empty()) {
        if (args.pos.size() > 1 || !args.pos[0].is_object())
          return err(pos, name + "() takes one optional dict and keyword arguments");
        for (const auto& [key, item] : args.pos[0].j->items()) {
          ns->attrs[key] = child(args.pos[0], item);
          d[key] = item;
        }
      }
      for (const auto& [key, v] : args.kw) {
        ns->attrs[key] = v;
        if (name == "dict") {
          NUCLEUS_ASSIGN_OR_RETURN(d[key], to_json(v, pos, false));
        }
      }
      if (name == "dict") return Value::of(std::move(d));
      return namespace_value(std::move(ns));
    }
    if (name == "strftime_now") {
      const Value* fmt = args.get(0, "format");
      if (!fmt || !fmt->is_string()) return err(pos, "strftime_now() needs a format string");
      std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      std::string buf(256 + fmt->str().size() * 8, '\0');
      size_t n = std::strftime(buf.data(), buf.size(), fmt->str().c_str(), &tm);
      buf.resize(n);
      return Value::of(std::move(buf));
    }
    return err(pos, "unknown function '" + name + "'");
  }

  static bool has_method(const Value& target, const std::string& name) {
    static const std::set<std::string, std::less<>> kStr = {
        "startswith", "endswith", "split", "rsplit", "strip",   "lstrip", "rstrip",
        "lower",      "upper",    "title", "capitalize", "replace", "find", "count", "join"};
    static const std::set<std::string, std::less<>> kDict = {"get", "items", "keys", "values"};
    if (target.is_string()) return kStr.count(name) > 0;
    if (target.is_object()) return kDict.count(name) > 0;
    return target.kind == Value::Kind::kNamespace && target.ns->is_loop && name == "cycle";
  }

  StatusOr<Value> call_method(const Value& target, const std::string& name, const Args& args, size_t pos) {
    if (target.kind == Value::Kind::kNamespace) {  // loop.cycle(a, b, ...)
      if (args.pos.empty()) return err(pos, "loop.cycle() needs at least one argument");
      auto index = static_cast<size_t>(as_int(*target.ns->attrs["index0"].j));
      return args.pos[index % args.pos.size()];
    }
    if (target.is_object()) {
      const json& d = *target.j;
      if (name == "get") {
        const Value* key = args.get(0, "key");
        if (!key) return err(pos, "dict.get() needs a key");
        if (key->is_string()) {
          auto it = d.find(key->str());
          if (it != d.end()) return child(target, *it);
        }
        const Value* def = args.get(1, "default");
        return def ? *def : Value::of(nullptr);
      }
      json out = json::array();
      for (const auto& [key, item] : d.items()) {
        if (name == "items") {
          out.push_back(json::array({key, item}));
        } else if (name == "keys") {
          out.push_back(key);
        } else {
          out.push_back(item);
        }
      }
      return Value::of(std::move(out));
    }
    const std::string& s = target.str();
    auto str_arg = [&](size_t i, const char* key) -> StatusOr<const std::string*> {
      const Value* v = args.get(i, key);
      if (!v || v->is_undefined() || (v->is_json() && v->j->is_null())) return nullptr;
      if (!v->is_string())
        return err(pos, "str." + name + "() argument must be a string, not '" + type_name(*v) + "'");
      return &v->str();
    };
    auto int_arg = [&](size_t i, const char* key, int64_t def) -> StatusOr<int64_t> {
      const Value* v = args.get(i, key);
      if (!v || v->is_undefined()) return def;
      if (!is_int_value(*v)) return err(pos, "str." + name + "() argument '" + key + "' must be an integer");
      return as_int(*v->j);
    };
    if (name == "startswith" || name == "endswith") {
      const Value* p = args.get(0, "prefix");
      if (!p) return err(pos, "str." + name + "() needs an argument");
      std::vector<const json*> options;
      if (p->is_array()) {
        for (const json& o : *p->j) options.push_back(&o);
      } else {
        options.push_back(p->j);
      }
      for (const json* o : options) {
        if (!o || !o->is_string()) return err(pos, "str." + name + "() arguments must be strings");
        const std::string& x = o->get_ref<const std::string&>();
        bool hit = name == "startswith" ? s.compare(0, x.size(), x) == 0
                                        : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
        if (hit) return Value::of(true);
      }
      return Value::of(false);
    }
    if (name == "split" || name == "rsplit") {
      NUCLEUS_ASSIGN_OR_RETURN(const std::string* sep, str_arg(0, "sep"));
      NUCLEUS_ASSIGN_OR_RETURN(int64_t maxsplit, int_arg(1, "maxsplit", -1));
      std::vector<std::string> parts;
      if (!sep) {
        if (name == "rsplit" && maxsplit >= 0) {
          // Mirror of split(): split the reversed characters.
          auto chars = utf8_chars(s);
          std::string rev;
          for (auto it = chars.rbegin(); it != chars.rend(); ++it) rev += *it;
          for (auto& part : py_split_ws(rev, maxsplit)) {
            auto pc = utf8_chars(part);
            std::string back;
            for (auto it = pc.rbegin(); it != pc.rend(); ++it) back += *it;
            parts.push_back(std::move(back));
          }
          std::reverse(parts.begin(), parts.end());
        } else {
          parts = py_split_ws(s, maxsplit);
        }
      } else {
        if (sep->empty()) return err(pos, "empty separator");
        parts = py_split(s, *sep, maxsplit, name == "rsplit");
      }
      return Value::of(json(parts));
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      NUCLEUS_ASSIGN_OR_RETURN(const std::string* chars, str_arg(0, "chars"));
      return Value::of(py_strip(s, chars, name != "rstrip", name != "lstrip"));
    }
    if (name == "lower") return Value::of(ascii_lower(s));
    if (name == "upper") return Value::of(ascii_upper(s));
    if (name == "title" || name == "capitalize") return apply_filter(name, target, Args{}, pos);
    if (name == "replace") {
      NUCLEUS_ASSIGN_OR_RETURN(const std::string* from, str_arg(0, "old"));
      NUCLEUS_ASSIGN_OR_RETURN(const std::string* to, str_arg(1, "new"));
      if (!from || !to) return err(pos, "str.replace() needs two strings");
      NUCLEUS_ASSIGN_OR_RETURN(int64_t count, int_arg(2, "count", -1));
      return Value::of(replace(s, *from, *to, count));
    }
    if (name == "find" || name == "count") {
      NUCLEUS_ASSIGN_OR_RETURN(const std::string* sub, str_arg(0, "sub"));
      if (!sub) return err(pos, "str." + name + "() needs a string");
      if (name == "find") {
        size_t at = s.find(*sub);
        return Value::of(at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(utf8_count(s.substr(0, at))));
      }
      if (sub->empty()) return Value::of(static_cast<int64_t>(utf8_count(s) + 1));
      int64_t count = 0;
      for (size_t at = s.find(*sub); at != std::string::npos; at = s.find(*sub, at + sub->size())) ++count;
      return Value::of(count);
    }
    // join
    const Value* seq = args.get(0, "iterable");
    if (!seq) return err(pos, "str.join() needs a list");
    std::vector<Value> items;
    NUCLEUS_RETURN_IF_ERROR(iterate(*seq, pos, items));
    std::string out;
    for (size_t k = 0; k < items.size(); ++k) {
      if (!items[k].is_string())
        return err(pos, "sequence item " + std::to_string(k) + ": expected str instance, " + type_name(items[k]) +
                            " found");
      if (k) out += s;
      out += items[k].str();
    }
    return Value::of(std::move(out));
  }

  // str.replace; an empty `from` inserts `to` around every character.
  static std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
    std::string out;
    int64_t done = 0;
    if (from.empty()) {
      auto chars = utf8_chars(s);
      for (size_t k = 0; k <= chars.size(); ++k) {
        if (count < 0 || done < count) out += to, ++done;
        if (k < chars.size()) out += chars[k];
      }
      return out;
    }
    size_t i = 0;
    while (count < 0 || done < count) {
      size_t at = s.find(from, i);
      if (at == std::string::npos) break;
      out.append(s, i, at - i);
      out += to;
      i = at + from.size();
      ++done;
    }
    out.append(s, i, std::string::npos);
    return out;
  }

  StatusOr<Value> arithmetic(const std::string& op, const Value& a, const Value& b, size_t pos) {
    if (a.is_undefined()) return err(pos, a.name);
    if (b.is_undefined()) return err(pos, b.name);
    auto unsupported_op = [&] {
      return err(pos, "unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
    };
    if (is_num_value(a) && is_num_value(b)) {
      const json &x = *a.j, &y = *b.j;
      if (is_integral(x) && is_integral(y) && op != "/") {
        int64_t p = as_int(x), q = as_int(y), r = 0;
        bool overflow = false;
        if (op == "+") {
          overflow = __builtin_add_overflow(p, q, &r);
        } else if (op == "-") {
          overflow = __builtin_sub_overflow(p, q, &r);
        } else if (op == "*") {
          overflow = __builtin_mul_overflow(p, q, &r);
        } else if (op == "//" || op == "%") {
          if (q == 0) return err(pos, "integer division or modulo by zero");
          if (p == INT64_MIN && q == -1) {
            overflow = op == "//";
          } else {
            int64_t quot = p / q, rem = p % q;
            if (rem != 0 && ((rem < 0) != (q < 0))) --quot, rem += q;  // floor, as Python
            r = op == "//" ? quot : rem;
          }
        } else if (q >= 0) {  // **
          r = 1;
          for (int64_t k = 0; k < q && !overflow; ++k) overflow = __builtin_mul_overflow(r, p, &r);
        } else {
          return Value::of(std::pow(static_cast<double>(p), static_cast<double>(q)));
        }
        if (overflow) return err(pos, "integer overflow in '" + op + "'");
        return Value::of(r);
      }
      double p = as_double(x), q = as_double(y);
      if (op == "+") return Value::of(p + q);
      if (op == "-") return Value::of(p - q);
      if (op == "*") return Value::of(p * q);
      if (op == "**") return Value::of(std::pow(p, q));
      if (q == 0) return err(pos, "division by zero");
      if (op == "/") return Value::of(p / q);
      if (op == "//") return Value::of(std::floor(p / q));
      double r = std::fmod(p, q);
      if (r != 0 && ((r < 0) != (q < 0))) r += q;
      return Value::of(r);
    }
    if (op == "+") {
      if (a.is_string() && b.is_string()) {
        NUCLEUS_RETURN_IF_ERROR(check_size(a.str().size() + b.str().size(), pos));
        return Value::of(a.str() + b.str());
      }
      if (a.is_array() && b.is_array()) {
        NUCLEUS_RETURN_IF_ERROR(check_size(a.j->size() + b.j->size(), pos));
        json out = *a.j;
        for (const json& item : *b.j) out.push_back(item);
        return Value::of(std::move(out));
      }
    }
    if (op == "*") {
      const Value* seq = is_int_value(a) ? &b : &a;
      const Value* times = is_int_value(a) ? &a : &b;
      if (is_int_value(*times) && (seq->is_string() || seq->is_array())) {
        int64_t n = std::max<int64_t>(0, as_int(*times->j));
        size_t unit = seq->is_string() ? seq->str().size() : seq->j->dump().size();
        if (unit && static_cast<uint64_t>(n) > kMaxRepeatBytes / unit) return err(pos, "repetition result too large");
        if (seq->is_string()) {
          std::string out;
          for (int64_t k = 0; k < n; ++k) out += seq->str();
          return Value::of(std::move(out));
        }
        json out = json::array();
        for (int64_t k = 0; k < n; ++k)
          for (const json& item : *seq->j) out.push_back(item);
        return Value::of(std::move(out));
      }
    }
    if (op == "%" && a.is_string()) return err(pos, "printf-style string formatting ('%') is not supported");
    return unsupported_op();
  }

  StatusOr<bool> compare(const std::string& op, const Value& a, const Value& b, size_t pos) {
    if (op == "==") return values_eq(a, b);
    if (op == "!=") return !values_eq(a, b);
    if (op == "in" || op == "not in") {
      NUCLEUS_ASSIGN_OR_RETURN(bool in, contains(b, a, pos));
      return in == (op == "in");
    }
    std::optional<int> c;
    if (a.is_json() && b.is_json()) c = json_cmp(*a.j, *b.j);
    if (!c)
      return err(pos, "'" + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) +
                          "'");
    if (op == "<") return *c < 0;
    if (op == "<=") return *c <= 0;
    if (op == ">") return *c > 0;
    return *c >= 0;
  }

  StatusOr<bool> contains(const Value& seq, const Value& item, size_t pos) {
    if (seq.is_undefined()) return false;
    if (seq.is_string()) {
      if (!item.is_string())
        return err(pos, std::string("'in <string>' requires string as left operand, not ") + type_name(item));
      return seq.str().find(item.str()) != std::string::npos;
    }
    if (seq.is_array()) {
      if (!item.is_json()) return false;
      for (const json& x : *seq.j)
        if (json_eq(x, *item.j)) return true;
      return false;
    }
    if (seq.is_object()) return item.is_string() && seq.j->contains(item.str());
    if (seq.kind == Value::Kind::kNamespace) return item.is_string() && seq.ns->attrs.count(item.str()) > 0;
    return err(pos, std::string("argument of type '") + type_name(seq) + "' is not iterable");
  }

  StatusOr<int64_t> length(const Value& v, size_t pos) {
    if (v.is_undefined()) return 0;
    if (v.is_string()) return static_cast<int64_t>(utf8_count(v.str()));
    if (v.is_array() || v.is_object()) return static_cast<int64_t>(v.j->size());
    if (v.kind == Value::Kind::kNamespace) return static_cast<int64_t>(v.ns->attrs.size());
    return err(pos, std::string("object of type '") + type_name(v) + "' has no len()");
  }

  StatusOr<bool> apply_test(const std::string& name, const Value& v, const Args& args, size_t pos) {
    const json* j = v.is_json() ? v.j : nullptr;
    const Value* arg = args.get(0, "value");
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return j && j->is_null();
    if (name == "boolean") return j && j->is_boolean();
    if (name == "true") return j && j->is_boolean() && j->get<bool>();
    if (name == "false") return j && j->is_boolean() && !j->get<bool>();
    if (name == "string") return j && j->is_string();
    if (name == "number") return j && is_number(*j);
    if (name == "integer") return j && j->is_number_integer();
    if (name == "float") return j && j->is_number_float();
    if (name == "mapping") return j && j->is_object();
    if (name == "iterable") return v.is_undefined() || (j && (j->is_string() || j->is_array() || j->is_object()));
    if (name == "sequence") return j && (j->is_string() || j->is_array() || j->is_object());
    if (name == "callable") return v.kind == Value::Kind::kMacro || v.kind == Value::Kind::kFunction;
    if (name == "lower" || name == "upper") {
      if (!v.is_string()) return false;
      const std::string& s = v.str();
      bool cased = std::any_of(s.begin(), s.end(), [](char c) { return std::isalpha(static_cast<unsigned char>(c)); });
      return cased && s == (name == "lower" ? ascii_lower(s) : ascii_upper(s));
    }
    if (name == "odd" || name == "even" || name == "divisibleby") {
      // value % 2 == 1 etc., with Python's % (floats allowed).
      Value divisor = Value::of(2);
      if (name == "divisibleby") {
        if (!arg) return err(pos, "test 'divisibleby' needs an argument");
        divisor = *arg;
      }
      NUCLEUS_ASSIGN_OR_RETURN(Value rem, arithmetic("%", v, divisor, pos));
      return json_eq(*rem.j, json(name == "odd" ? 1 : 0));
    }
    if (!arg) return err(pos, "test '" + name + "' needs an argument");
    if (name == "in") return contains(*arg, v, pos);
    if (name == "sameas") {
      if (!j || !arg->is_json()) return v.kind == arg->kind && values_eq(v, *arg);
      if (j->is_null() || j->is_boolean()) return j->type() == arg->j->type() && *j == *arg->j;
      return j == arg->j;
    }
    static const std::map<std::string, std::string, std::less<>> kOps = {
        {"eq", "=="}, {"equalto", "=="}, {"==", "=="}, {"ne", "!="}, {"!=", "!="}, {"lt", "<"}, {"<", "<"},
        {"le", "<="}, {"<=", "<="},      {"gt", ">"},  {">", ">"},   {"ge", ">="}, {">=", ">="}};
    auto it = kOps.find(name);
    if (it == kOps.end()) return err(pos, "no test named '" + name + "'");
    return compare(it->second, v, *arg, pos);
  }

  StatusOr<Value> apply_filter(const std::string& name, const Value& in, const Args& args, size_t pos) {
    // Filters on text take str() of their input, "" for undefined, as Jinja2.
    if (name == "trim") {
      const Value* chars = args.get(0, "chars");
      std::string c = chars && chars->is_string() ? chars->str() : "";
      return Value::of(py_strip(to_str(in), chars && chars->is_string() ? &c : nullptr, true, true));
    }
    if (name == "lower") return Value::of(ascii_lower(to_str(in)));
    if (name == "upper") return Value::of(ascii_upper(to_str(in)));
    if (name == "string") return in.is_string() ? in : Value::of(to_str(in));
    if (name == "safe") return in;
    if (name == "capitalize") {
      std::string s = ascii_lower(to_str(in));
      if (!s.empty()) s[0] = ascii_upper(s.substr(0, 1))[0];
      return Value::of(std::move(s));
    }
    if (name == "title") {
      std::string s = to_str(in);
      bool start = true;
      for (char& c : s) {
        if (start) {
          c = ascii_upper(std::string(1, c))[0];
        } else {
          c = ascii_lower(std::string(1, c))[0];
        }
        start = is_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
      }
      return Value::of(std::move(s));
    }
    if (name == "replace") {
      const Value* from = args.get(0, "old");
      const Value* to = args.get(1, "new");
      const Value* count = args.get(2, "count");
      if (!from || !to) return err(pos, "filter 'replace' needs two arguments");
      int64_t n = count && is_int_value(*count) ? as_int(*count->j) : -1;
      return Value::of(replace(to_str(in), to_str(*from), to_str(*to), n));
    }
    if (name == "e" || name == "escape") {
      std::string out;
      for (char c : to_str(in)) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
      }
      return Value::of(std::move(out));
    }
    if (name == "indent") {
      const Value* width = args.get(0, "width");
      const Value* first = args.get(1, "first");
      const Value* blank = args.get(2, "blank");
      std::string pad = width && width->is_string() ? width->str()
                        : std::string(width && is_int_value(*width) ? std::max<int64_t>(0, as_int(*width->j)) : 4, ' ');
      // Jinja2: lines = (s + "\n").splitlines(); the first line is not
      // indented, nor are empty lines unless `blank`.
      std::vector<std::string> lines = py_split(to_str(in) + "\n", "\n", -1, false);
      lines.pop_back();
      std::string out = lines[0];
      for (size_t k = 1; k < lines.size(); ++k) {
        out += '\n';
        if (!lines[k].empty() || (blank && truthy(*blank))) out += pad;
        out += lines[k];
      }
      if (first && truthy(*first)) out = pad + out;
      return Value::of(std::move(out));
    }
    if (name == "length" || name == "count") {
      NUCLEUS_ASSIGN_OR_RETURN(int64_t n, length(in, pos));
      return Value::of(n);
    }
    if (name == "default" || name == "d") {
      const Value* def = args.get(0, "default_value");
      const Value* boolean = args.get(1, "boolean");
      if (in.is_undefined() || (boolean && truthy(*boolean) && !truthy(in))) return def ? *def : Value::of("");
      return in;
    }
    if (name == "tojson") return tojson(in, args, pos);
    if (name == "abs") {
      if (!is_num_value(in)) return err(pos, std::string("bad operand type for abs(): '") + type_name(in) + "'");
      if (is_integral(*in.j)) return Value::of(std::abs(as_int(*in.j)));
      return Value::of(std::fabs(as_double(*in.j)));
    }
    if (name == "int" || name == "float") {
      const Value* def = args.get(0, "default");
      std::optional<double> d;
      std::optional<int64_t> i;
      if (is_num_value(in)) {
        if (is_integral(*in.j)) i = as_int(*in.j);
        d = as_double(*in.j);
      } else if (in.is_string()) {
        std::string s = py_strip(in.str(), nullptr, true, true);
        int64_t iv = 0;
        auto r = std::from_chars(s.data(), s.data() + s.size(), iv);
        if (!s.empty() && r.ec == std::errc() && r.ptr == s.data() + s.size()) i = iv, d = static_cast<double>(iv);
        char* end = nullptr;
        double dv = std::strtod(s.c_str(), &end);
        if (!i && !s.empty() && end == s.c_str() + s.size()) d = dv;
      }
      if (name == "float") return d ? Value::of(*d) : (def ? *def : Value::of(0.0));
      if (!i && d && std::isfinite(*d)) i = static_cast<int64_t>(*d);
      return i ? Value::of(*i) : (def ? *def : Value::of(0));
    }
    if (name == "round") {
      if (!is_num_value(in)) return err(pos, "filter 'round' needs a number");
      const Value* precision = args.get(0, "precision");
      const Value* method = args.get(1, "method");
      int64_t p = precision && is_int_value(*precision) ? as_int(*precision->j) : 0;
      std::string m = method && method->is_string() ? method->str() : "common";
      double scale = std::pow(10.0, static_cast<double>(p)), x = as_double(*in.j) * scale;
      // "common" is Python's round(): halves go to the even neighbour.
      x = m == "ceil" ? std::ceil(x) : m == "floor" ? std::floor(x) : std::nearbyint(x);
      return Value::of(x / scale);
    }
    // Filters over sequences.
    std::vector<Value> items;
    if (name == "first" || name == "last") {
      NUCLEUS_RETURN_IF_ERROR(iterate(in, pos, items));
      if (items.empty()) return Value::undefined("no " + name + " item, the sequence was empty");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "items") {
      if (in.is_undefined()) return Value::of(json::array());
      if (!in.is_object()) return err(pos, std::string("filter 'items' needs a dict, got '") + type_name(in) + "'");
      return call_method(in, "items", Args{}, pos);
    }
    NUCLEUS_RETURN_IF_ERROR(iterate(in, pos, items));
    if (name == "list") return list_of(items, pos);
    if (name == "reverse") {
      if (in.is_string()) {
        auto chars = utf8_chars(in.str());
        std::string out;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
        return Value::of(std::move(out));
      }
      std::reverse(items.begin(), items.end());
      return list_of(items, pos);
    }
    if (name == "join") {
      const Value* sep = args.get(0, "d");
      const Value* attribute = args.get(1, "attribute");
      std::string out, s = sep ? to_str(*sep) : "";
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += s;
        append_str(attribute ? get_item(items[k], *attribute) : items[k], out);
      }
      return Value::of(std::move(out));
    }
    if (name == "map") {
      const Value* attribute = args.kwarg("attribute");
      std::vector<Value> out;
      if (attribute) {
        const Value* def = args.kwarg("default");
        for (const Value& item : items) {
          Value v = get_item(item, *attribute);
          out.push_back(v.is_undefined() && def ? *def : v);
        }
      } else {
        if (args.pos.empty() || !args.pos[0].is_string()) return err(pos, "filter 'map' needs a filter name or attribute=");
        const std::string& filter = args.pos[0].str();
        if (!known_filters().count(filter)) return err(pos, "no filter named '" + filter + "'");
        Args rest{std::vector<Value>(args.pos.begin() + 1, args.pos.end()), args.kw};
        for (const Value& item : items) {
          NUCLEUS_ASSIGN_OR_RETURN(Value v, apply_filter(filter, item, rest, pos));
          out.push_back(std::move(v));
        }
      }
      return list_of(out, pos);
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      bool by_attr = name.size() > 6;
      bool want = name[0] == 's';
      size_t test_at = by_attr ? 1 : 0;
      if (by_attr && (args.pos.empty() || !args.pos[0].is_string()))
        return err(pos, "filter '" + name + "' needs an attribute name");
      std::string test;
      if (args.pos.size() > test_at) {
        if (!args.pos[test_at].is_string()) return err(pos, "filter '" + name + "' needs a test name");
        test = args.pos[test_at].str();
        if (!known_tests().count(test)) return err(pos, "no test named '" + test + "'");
      }
      Args test_args;
      if (args.pos.size() > test_at + 1) test_args.pos.assign(args.pos.begin() + test_at + 1, args.pos.end());
      std::vector<Value> out;
      for (const Value& item : items) {
        Value v = by_attr ? get_item(item, args.pos[0]) : item;
        bool r = truthy(v);
        if (!test.empty()) {
          NUCLEUS_ASSIGN_OR_RETURN(r, apply_test(test, v, test_args, pos));
        }
        if (r == want) out.push_back(item);
      }
      return list_of(out, pos);
    }
    if (name == "sort" || name == "unique" || name == "min" || name == "max") {
      const Value* reverse = name == "sort" ? args.get(0, "reverse") : nullptr;
      const Value* case_sensitive = args.get(name == "sort" ? 1 : 0, "case_sensitive");
      const Value* attribute = args.get(name == "sort" ? 2 : 1, "attribute");
      bool fold = !(case_sensitive && truthy(*case_sensitive));
      // Sort keys: the attribute if asked for, strings lowercased unless
      // case_sensitive (Jinja2's default).
      std::vector<json> keys;
      for (const Value& item : items) {
        Value k = attribute ? get_item(item, *attribute) : item;
        NUCLEUS_ASSIGN_OR_RETURN(json key, to_json(k, pos, false));
        if (fold && key.is_string()) key = ascii_lower(key.get<std::string>());
        keys.push_back(std::move(key));
      }
      if (name == "unique") {
        std::vector<Value> out;
        std::vector<json> seen;
        for (size_t k = 0; k < items.size(); ++k) {
          if (std::any_of(seen.begin(), seen.end(), [&](const json& s) { return json_eq(s, keys[k]); })) continue;
          seen.push_back(keys[k]);
          out.push_back(items[k]);
        }
        return list_of(out, pos);
      }
      std::vector<size_t> order(items.size());
      for (size_t k = 0; k < order.size(); ++k) order[k] = k;
      bool bad = false;
      std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
        auto c = json_cmp(keys[x], keys[y]);
        if (!c) bad = true;
        return c.value_or(0) < 0;
      });
      if (bad) return err(pos, "filter '" + name + "': the items cannot be ordered");
      if (name == "min" || name == "max") {
        if (items.empty()) return Value::undefined("no " + name + " item, the sequence was empty");
        return name == "min" ? items[order.front()] : items[order.back()];
      }
      if (reverse && truthy(*reverse)) std::reverse(order.begin(), order.end());
      std::vector<Value> out;
      for (size_t k : order) out.push_back(items[k]);
      return list_of(out, pos);
    }
    if (name == "sum") {
      const Value* attribute = args.get(0, "attribute");
      const Value* start = args.get(1, "start");
      Value total = start ? *start : Value::of(0);
      for (const Value& item : items) {
        NUCLEUS_ASSIGN_OR_RETURN(total, arithmetic("+", total, attribute ? get_item(item, *attribute) : item, pos));
      }
      return total;
    }
    return err(pos, "no filter named '" + name + "'");
  }

  StatusOr<Value> list_of(const std::vector<Value>& items, size_t pos) {
    json out = json::array();
    for (const Value& v : items) {
      NUCLEUS_ASSIGN_OR_RETURN(json j, to_json(v, pos, false));
      out.push_back(std::move(j));
    }
    return Value::of(std::move(out));
  }

  // transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None,
  // separators=None, sort_keys=False), keyword arguments as in json.dumps.
  StatusOr<Value> tojson(const Value& in, const Args& args, size_t pos) {
    JsonStyle st;
    const Value* indent = args.get(0, "indent");
    if (indent && indent->is_json() && !indent->j->is_null()) {
      st.pretty = true;
      st.item_sep = ",";
      st.indent = indent->is_string() ? indent->str() : std::string(std::max<int64_t>(0, as_int(*indent->j)), ' ');
    }
    for (const auto& [key, v] : args.kw) {
      if (key == "ensure_ascii") {
        st.ensure_ascii = truthy(v);
      } else if (key == "separators") {
        if (v.is_json() && v.j->is_null()) continue;
        if (!v.is_array() || v.j->size() != 2 || !(*v.j)[0].is_string() || !(*v.j)[1].is_string())
          return err(pos, "tojson separators must be a pair of strings");
        st.item_sep = (*v.j)[0].get<std::string>();
        st.key_sep = (*v.j)[1].get<std::string>();
      } else if (key != "indent" && key != "sort_keys") {  // keys are always sorted here
        return err(pos, "tojson() got an unexpected keyword argument '" + key + "'");
      }
    }
    if (!in.is_json()) return err(pos, std::string("Object of type ") + type_name(in) + " is not JSON serializable");
    std::string out;
    dump_json(*in.j, st, 0, out);
    return Value::of(std::move(out));
  }

  const detail::TemplateProgram& prog_;
  const json& ctx_;
  Scope top_;  // the template's top-level variables
  int depth_ = 0;
  int64_t steps_ = 0;  // statements and expressions evaluated so far
  enum class Flow { kNormal, kBreak, kContinue } flow_ = Flow::kNormal;
};

}  // namespace

StatusOr<ChatTemplate> ChatTemplate::parse(const std::string& source) {
  auto program = std::make_shared<detail::TemplateProgram>();
  // As Jinja2: line ends become "\n" and one trailing newline is dropped.
  std::string& src = program->source;
  src.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      src += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      src += source[i];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();
  NUCLEUS_ASSIGN_OR_RETURN(std::vector<Token> tokens, Lexer(src).run());
  NUCLEUS_RETURN_IF_ERROR(Parser(src, std::move(tokens)).parse(&program->body));
  return ChatTemplate(std::move(program));
}

StatusOr<std::string> ChatTemplate::render_ordered(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) return invalid_argument("chat template context must be a JSON object");
  std::string out;
  NUCLEUS_RETURN_IF_ERROR(Renderer(*program_, context).render(out));
  return out;
}

StatusOr<std::string> ChatTemplate::render(const nlohmann::json& context) const {
  if (!context.is_object()) return invalid_argument("chat template context must be a JSON object");
  return render_ordered(nlohmann::ordered_json(context));
}

}  // namespace nucleus
