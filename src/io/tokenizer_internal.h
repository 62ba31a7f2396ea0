// Helpers shared by the tokenizer's translation units (tokenizer.cpp,
// tokenizer_tiktoken.cpp): UTF-8 stepping, the GPT-2 byte alphabet, JSON
// field access. Internal to src/io; not part of the Tokenizer interface.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "io/utf8.h"

namespace nucleus::tokenizer_internal {

using json = nlohmann::json;

// Ids index dense tables; this bounds them (real vocabularies: ~130k).
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// ---- UTF-8 -----------------------------------------------------------------

// Length of the valid UTF-8 character at s[i] (storing its code point in
// *cp), or 0 when the bytes there are not one (stray continuation byte,
// truncated or overlong sequence, surrogate, past U+10FFFF).
inline size_t utf8_char_len(std::string_view s, size_t i, uint32_t* cp = nullptr) {
  size_t next = i;
  return utf8_next(s, next, cp) == Utf8Seq::kValid ? next - i : 0;
}

// Bytes to step over at s[i]: one character, or one byte of invalid UTF-8.
inline size_t char_step(std::string_view s, size_t i) {
  size_t n = utf8_char_len(s, i);
  return n ? n : 1;
}

// Start of the character just before s[end] (end > 0); end - 1 when the
// bytes there do not end a valid character.
inline size_t prev_char_start(std::string_view s, size_t end) {
  for (size_t back = 1; back <= 4 && back <= end; ++back) {
    auto b = static_cast<unsigned char>(s[end - back]);
    if (!utf8_continuation(b)) return utf8_char_len(s, end - back) == back ? end - back : end - 1;
  }
  return end - 1;
}


// Unicode White_Space, which Rust's regex \s (used by HF for lstrip/rstrip of
// added tokens) matches.
inline bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

inline bool white_space_at(std::string_view s, size_t i, size_t* len) {
  uint32_t cp = 0;
  *len = utf8_char_len(s, i, &cp);
  return *len != 0 && is_white_space(cp);
}

// ---- GPT-2 byte <-> character alphabet ------------------------------------

// bytes_to_unicode(): printable Latin-1 bytes stand for themselves; the other
// 68 bytes map in order to U+0100.. so that every byte is a visible character.
struct ByteAlphabet {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of the character
  std::array<int16_t, 324> char_to_byte;      // code point -> byte, -1 if none

  ByteAlphabet() {
    char_to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
      append_utf8(cp, byte_to_char[b]);
      char_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

inline const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

// HF's ByteLevel decoder for one token: each character back to its byte, or
// the token's own text when a character is outside the alphabet.
inline std::string byte_level_decode(const std::string& token) {
  const ByteAlphabet& a = byte_alphabet();
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    uint32_t cp = 0;
    size_t n = utf8_char_len(token, i, &cp);
    if (n == 0 || cp >= a.char_to_byte.size() || a.char_to_byte[cp] < 0) return token;
    out += static_cast<char>(a.char_to_byte[cp]);
    i += n;
  }
  return out;
}

// ---- JSON field access ------------------------------------------------------

// The value of `key` in `obj`, or nullptr when `obj` is not an object or the
// key is missing or null.
inline const json* field(const json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// A JSON value for an error message, cut short: a bad value can be large.
inline std::string short_dump(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() <= 80 ? s : s.substr(0, 77) + "...";
}

}  // namespace nucleus::tokenizer_internal
