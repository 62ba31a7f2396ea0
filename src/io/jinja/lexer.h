// The lexer's interface: the tokens a template's source is cut into (text
// between tags, tag delimiters, and the names, literals and operators inside
// tags), and the character classes the lexer and the renderer share.
// Internal to the chat-template interpreter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace nucleus::jinja {

// What a token is: template text, a tag delimiter ({{ }} {% %}), or a word,
// literal or operator inside a tag.
enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

// One token; `pos` is its byte offset in the source.
struct Token {
  Token(Tok k, size_t p, std::string t = {}) : kind(k), pos(p), text(std::move(t)) {}
  Tok kind = Tok::kEof;
  size_t pos = 0;
  std::string text;  // kText: the data; kName / kOp: the word; kString: the decoded value
  int64_t int_value = 0;
  double float_value = 0;
};

// ASCII character classes of the template syntax (Python's whitespace within
// ASCII; identifiers [A-Za-z_][A-Za-z0-9_]*).
inline bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
inline bool is_digit(char c) { return c >= '0' && c <= '9'; }
inline bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
inline bool is_ident(char c) { return is_ident_start(c) || is_digit(c); }

// Cuts the (normalized: "\n" line ends) source `src` into tokens, the last
// one kEof. Jinja2's whitespace control applies: "{%-"/"-%}" strip all
// whitespace on that side; with trim_blocks and lstrip_blocks, a block or
// comment tag alone on its line takes the line's leading blanks and its
// newline with it; "{%+"/"+%}" opt out. A malformed tag, string or number is
// kInvalidArgument "chat template line L, column C: <what>".
StatusOr<std::vector<Token>> lex(const std::string& src);

}  // namespace nucleus::jinja
