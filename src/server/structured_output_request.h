// The structured-output fields of a completion or chat request, compiled
// into the grammar the engine enforces (runtime/structured_output.h):
//   OpenAI: response_format {"type": "text"} (no constraint),
//     {"type": "json_object"}, {"type": "json_schema", "json_schema":
//     {"name", "schema", "strict", "description"}};
//   vLLM: structured_outputs {"json" | "regex" | "choice" | "grammar" |
//     "json_object", "disable_any_whitespace", "disable_fallback",
//     "disable_additional_properties"}, and the older guided_json,
//     guided_regex, guided_choice, guided_grammar (with
//     guided_decoding_backend "xgrammar" or "auto").
// At most one constraint per request. Compiling runs here, on the request's
// thread (milliseconds to seconds for a large schema; repeated schemas come
// from the compiler's cache).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/structured_output.h"
#include "server/protocol.h"

namespace nucleus::server {

// `body` is the parsed request and `text` the body as sent (schemas are taken
// from it with their keys in the client's order: properties are generated in
// schema order). Returns null when the request asks for no constraint. Errors
// (400, naming the field): a malformed field, more than one constraint, a
// schema / regex / grammar the compiler refuses, or a server without
// structured output (model.grammar_compiler null).
std::variant<std::shared_ptr<const CompiledGrammar>, ApiError> parse_structured_output(const nlohmann::json& body,
                                                                                       const std::string& text,
                                                                                       const ModelInfo& model);

}  // namespace nucleus::server
