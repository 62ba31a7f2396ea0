// The lexer: cuts a template's source into text and tag tokens with Jinja2's
// whitespace rules (trim_blocks, lstrip_blocks, {%- -%}, {%+), decoding
// string literals with Python's escapes.
#include "io/jinja/lexer.h"

#include <algorithm>
#include <charconv>

#include "io/jinja/common.h"
#include "io/utf8.h"

namespace nucleus::jinja {

namespace {

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

}  // namespace

StatusOr<std::vector<Token>> lex(const std::string& src) { return Lexer(src).run(); }

}  // namespace nucleus::jinja
