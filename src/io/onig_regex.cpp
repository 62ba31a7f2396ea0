#include "io/onig_regex.h"

#include <vector>

namespace nucleus {

namespace {

// Code points a property gained between Unicode 14.0.0 and 16.0.0, as PCRE2
// class items ("\x{31350}-\x{323AF}...").
struct ExtraRanges {
  const char* property;
  const char* items;
};
constexpr ExtraRanges kExtraRanges[] = {
#include "io/unicode_ranges.inc"
};

// Script names as tokenizer patterns use them. Oniguruma's and Rust's \p{Han}
// is the Script property; PCRE2 (10.40+) reads a bare script name as
// Script_Extensions, where e.g. U+3002 (ideographic full stop) is Han too, so
// these are written \p{sc:Name}.
constexpr std::string_view kScripts[] = {
    "Arabic",   "Armenian", "Bengali",  "Bopomofo", "Common",   "Cyrillic",   "Devanagari", "Ethiopic", "Georgian",
    "Greek",    "Gujarati", "Gurmukhi", "Han",      "Hangul",   "Hebrew",     "Hiragana",   "Inherited", "Kannada",
    "Katakana", "Khmer",    "Lao",      "Latin",    "Malayalam", "Mongolian", "Myanmar",    "Oriya",    "Sinhala",
    "Tamil",    "Telugu",   "Thai",     "Tibetan",  "Arab",     "Cyrl",       "Deva",       "Grek",     "Hang",
    "Hani",     "Hebr",     "Hira",     "Kana",     "Latn",     "Zyyy",       "Zinh"};

bool is_script(std::string_view name) {
  for (std::string_view s : kScripts)
    if (name == s) return true;
  return false;
}

std::string_view extra_ranges(std::string_view property) {
  if (property == "Hani") property = "Han";
  for (const ExtraRanges& e : kExtraRanges)
    if (property == e.property) return e.items;
  return {};
}

// Oniguruma's \w as class items: Letter, Mark, Decimal_Number,
// Connector_Punctuation, each with its newer code points.
std::string word_items() {
  std::string out;
  for (const char* p : {"L", "M", "Nd", "Pc"}) {
    out += "\\p{";
    out += p;
    out += '}';
    out += extra_ranges(p);
  }
  return out;
}

// Translates the escape at p[i] == '\\' (in a class or not) into `out`;
// returns its length in `p`.
size_t translate_escape(std::string_view p, size_t i, bool in_class, std::string& out) {
  if (i + 1 >= p.size()) {
    out += p[i];
    return 1;
  }
  char e = p[i + 1];
  switch (e) {
    case 's':
      out += R"(\p{White_Space})";
      return 2;
    case 'S':
      out += R"(\P{White_Space})";
      return 2;
    case 'w':
    case 'W':
      // Appended piecewise: "[" + std::string trips a GCC 12 -Wrestrict false positive.
      if (in_class) {
        out += e == 'w' ? word_items() : std::string(R"(\W)");
      } else {
        out += e == 'w' ? "[" : "[^";
        out += word_items();
        out += ']';
      }
      return 2;
    case 'p':
    case 'P': {
      // \pX, \p{X}, \p{^X}, \P{X}.
      size_t len;
      std::string_view name;
      if (i + 2 < p.size() && p[i + 2] == '{') {
        size_t close = p.find('}', i + 3);
        if (close == std::string_view::npos) break;
        name = p.substr(i + 3, close - (i + 3));
        len = close + 1 - i;
      } else if (i + 2 < p.size()) {
        name = p.substr(i + 2, 1);
        len = 3;
      } else {
        break;
      }
      bool negated = e == 'P';
      if (name.starts_with('^')) {
        negated = !negated;
        name.remove_prefix(1);
      }
      std::string property = "\\p{";
      if (is_script(name)) property += "sc:";
      property += name;
      property += '}';
      std::string_view extra = extra_ranges(name);
      if (negated && (extra.empty() || in_class)) {
        // Nothing newer, or not expressible in a class (a known gap).
        property[1] = 'P';
        out += property;
      } else if (negated) {
        out += "[^";
        out += property;
        out += extra;
        out += ']';
      } else {
        if (!in_class && !extra.empty()) out += '[';
        out += property;
        out += extra;
        if (!in_class && !extra.empty()) out += ']';
      }
      return len;
    }
    default:
      break;
  }
  out += p.substr(i, 2);
  return 2;
}

// The index just past the class starting at p[i] == '[' (nested classes
// and POSIX [:name:] included), or p.size() when it is not closed.
size_t class_end(std::string_view p, size_t i) {
  size_t j = i + 1;
  if (j < p.size() && p[j] == '^') ++j;
  if (j < p.size() && p[j] == ']') ++j;  // a ']' first is literal
  int depth = 0;
  while (j < p.size()) {
    char c = p[j];
    if (c == '\\') {
      j += 2;
    } else if (c == '[' && j + 1 < p.size() && p[j + 1] == ':') {
      size_t end = p.find(":]", j + 2);
      j = end == std::string_view::npos ? j + 1 : end + 2;
    } else if (c == '[') {
      ++depth;
      ++j;
      if (j < p.size() && p[j] == '^') ++j;
      if (j < p.size() && p[j] == ']') ++j;
    } else if (c == ']') {
      ++j;
      if (depth-- == 0) return j;
    } else {
      ++j;
    }
  }
  return p.size();
}

// The items of a class body without "&&" at its top level.
std::string translate_items(std::string_view body) {
  std::string out;
  for (size_t i = 0; i < body.size();) {
    if (body[i] == '\\') {
      i += translate_escape(body, i, /*in_class=*/true, out);
    } else if (body[i] == '[' && i + 1 < body.size() && body[i + 1] == ':') {
      size_t end = body.find(":]", i + 2);
      size_t stop = end == std::string_view::npos ? body.size() : end + 2;
      out += body.substr(i, stop - i);
      i = stop;
    } else {
      out += body[i++];
    }
  }
  return out;
}

std::string translate_class(std::string_view cls);

// One operand of an intersection as a PCRE2 class.
std::string translate_operand(std::string_view operand) {
  if (operand.size() >= 2 && operand.front() == '[' && class_end(operand, 0) == operand.size())
    return translate_class(operand);
  std::string out = "[";
  out += translate_items(operand);
  out += ']';
  return out;
}

// A whole class "[...]" (as class_end delimits it) into PCRE2 syntax.
std::string translate_class(std::string_view cls) {
  size_t begin = 1;
  bool negated = begin < cls.size() && cls[begin] == '^';
  if (negated) ++begin;
  size_t end = cls.size() > begin && cls.back() == ']' ? cls.size() - 1 : cls.size();
  std::string_view body = cls.substr(begin, end - begin);

  // Split the body on "&&" outside nested classes.
  std::vector<std::string_view> operands;
  size_t start = 0;
  for (size_t j = 0; j < body.size();) {
    if (body[j] == '\\') {
      j += 2;
    } else if (j == 0 && body[j] == ']') {
      ++j;  // literal
    } else if (body[j] == '[' && !(j + 1 < body.size() && body[j + 1] == ':')) {
      j = class_end(body, j);
    } else if (body[j] == '&' && j + 1 < body.size() && body[j + 1] == '&') {
      operands.push_back(body.substr(start, j - start));
      j += 2;
      start = j;
    } else {
      ++j;
    }
  }
  operands.push_back(body.substr(start));

  std::string out = negated ? "[^" : "[";
  if (operands.size() == 1) {
    out += translate_items(body);
    out += ']';
    return out;
  }
  // One character in every operand: lookaheads for all but the first.
  out = negated ? "(?:(?!" : "(?:";
  for (size_t k = 1; k < operands.size(); ++k) {
    out += "(?=";
    out += translate_operand(operands[k]);
    out += ')';
  }
  out += translate_operand(operands[0]);
  out += negated ? ")(?s:.))" : ")";
  return out;
}

}  // namespace

std::string onig_to_pcre2(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  for (size_t i = 0; i < pattern.size();) {
    char c = pattern[i];
    if (c == '\\') {
      i += translate_escape(pattern, i, /*in_class=*/false, out);
    } else if (c == '[') {
      size_t end = class_end(pattern, i);
      out += translate_class(pattern.substr(i, end - i));
      i = end;
    } else {
      out += c;
      ++i;
    }
  }
  return out;
}

}  // namespace nucleus
