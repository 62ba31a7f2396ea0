// Shared by the layers of the chat-template interpreter (lexer, parser,
// values, renderer): the JSON type values are held in and the positions in
// the source that errors name. Internal to src/io; the interface is
// io/chat_template.h.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

#include "core/status.h"

namespace nucleus::jinja {

// Objects keep their keys in insertion order, as Python dicts do, so that
// tojson and items() print them in the order the request gave.
using json = nlohmann::ordered_json;

// "line L, column C" for byte offset `pos` of the (normalized: "\n" line
// ends) source `src`; lines and columns count from 1, columns in characters.
std::string line_column(const std::string& src, size_t pos);

// kInvalidArgument "chat template line L, column C: <what>" for byte offset
// `pos` of `src`.
Status error_at(const std::string& src, size_t pos, const std::string& what);

}  // namespace nucleus::jinja
