// UTF-8 helpers shared by the tokenizer and the chat templates.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace nucleus {

// Appends code point `cp` (<= 0x10FFFF) to `out` as UTF-8.
inline void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// One step of decoding `bytes` from `i` as Python's bytes.decode("utf-8",
// errors="replace") segments it: advances `i` past one valid sequence (true)
// or one maximal ill-formed subpart, which decodes to one U+FFFD (false).
inline bool utf8_step(std::string_view bytes, size_t& i) {
  const auto c = static_cast<unsigned char>(bytes[i++]);
  int need = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  }
  const bool lead_ok = c < 0x80 || need > 0;
  for (; need > 0 && i < bytes.size(); --need, lo = 0x80, hi = 0xBF) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    if (b < lo || b > hi) break;
    ++i;
  }
  return lead_ok && need == 0;
}

// The characters (code points) `bytes` decodes to as Python's
// bytes.decode("utf-8", errors="replace") counts them (its len): a valid
// sequence is one, and so is each maximal ill-formed subpart (one U+FFFD).
inline int64_t utf8_length(std::string_view bytes) {
  int64_t n = 0;
  for (size_t i = 0; i < bytes.size(); ++n) utf8_step(bytes, i);
  return n;
}

// `bytes` as valid UTF-8: each valid sequence copied, each maximal ill-formed
// subpart replaced by U+FFFD (Python's bytes.decode("utf-8",
// errors="replace"); the characters utf8_length counts).
inline std::string utf8_replace_invalid(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const size_t start = i;
    if (utf8_step(bytes, i))
      out.append(bytes.substr(start, i - start));
    else
      out += "\xEF\xBF\xBD";
  }
  return out;
}

}  // namespace nucleus
