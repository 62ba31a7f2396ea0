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

// How one decoding step (utf8_next) ended.
enum class Utf8Seq {
  kValid,      // a valid sequence: one character
  kInvalid,    // a maximal ill-formed subpart: one U+FFFD
  kTruncated,  // the valid start of a sequence that `bytes` ends inside
};

// One step of decoding `bytes` from `i` as Python's bytes.decode("utf-8",
// errors="replace") segments it: advances `i` past one valid sequence
// (kValid; its code point in *cp when cp is not null) or one maximal
// ill-formed subpart, which decodes to one U+FFFD (kInvalid, or kTruncated
// when the subpart is a valid start cut off by the end of `bytes`: a
// streaming decoder waits for more bytes there). *cp is only written for
// kValid. The one UTF-8 decoder of src/; i < bytes.size() on entry.
inline Utf8Seq utf8_next(std::string_view bytes, size_t& i, uint32_t* cp = nullptr) {
  const auto c = static_cast<unsigned char>(bytes[i++]);
  int need = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  uint32_t v = c;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1, v = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2, v = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3, v = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  }
  const bool lead_ok = c < 0x80 || need > 0;
  for (; need > 0 && i < bytes.size(); --need, lo = 0x80, hi = 0xBF) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    if (b < lo || b > hi) break;
    v = (v << 6) | (b & 0x3F);
    ++i;
  }
  if (!lead_ok) return Utf8Seq::kInvalid;
  if (need == 0) {
    if (cp) *cp = v;
    return Utf8Seq::kValid;
  }
  return i == bytes.size() ? Utf8Seq::kTruncated : Utf8Seq::kInvalid;
}

// utf8_next as a yes / no: whether the step from `i` took a valid sequence.
inline bool utf8_step(std::string_view bytes, size_t& i) { return utf8_next(bytes, i) == Utf8Seq::kValid; }

// Whether byte `b` is a UTF-8 continuation byte (10xxxxxx): one that never
// starts a character.
inline bool utf8_continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

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
