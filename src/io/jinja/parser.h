// The parser's interface: tokens to the syntax tree. Internal to the
// chat-template interpreter.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "io/jinja/ast.h"
#include "io/jinja/lexer.h"

namespace nucleus::jinja {

// Parses `tokens` (lex(src)'s) into the statements of the template, stored
// in *out. A syntax error, an unknown filter or test, an unclosed block or a
// construct outside the supported subset (e.g. {% include %}) is
// kInvalidArgument "chat template line L, column C: <what>", positions in
// `src`.
Status parse(const std::string& src, std::vector<Token> tokens, Body* out);

}  // namespace nucleus::jinja
