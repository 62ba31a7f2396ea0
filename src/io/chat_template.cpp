// Chat templates: the public entry of the Jinja2 subset interpreter in
// io/jinja/ (lexer, parser, values, Python string semantics, renderer,
// filters). Parsing normalizes line ends as Jinja2 does, then lexes and
// parses; rendering walks the tree over the context. Semantics follow Python
// (truthiness, ==, slicing, str(), float repr, json.dumps) because
// transformers renders these templates with Jinja2 on Python objects, and
// prompts must come out byte for byte the same.
#include "io/chat_template.h"

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/jinja/ast.h"
#include "io/jinja/lexer.h"
#include "io/jinja/parser.h"
#include "io/jinja/renderer.h"

namespace nucleus {

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
  NUCLEUS_ASSIGN_OR_RETURN(std::vector<jinja::Token> tokens, jinja::lex(src));
  NUCLEUS_RETURN_IF_ERROR(jinja::parse(src, std::move(tokens), &program->body));
  return ChatTemplate(std::move(program));
}

StatusOr<std::string> ChatTemplate::render_ordered(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) return invalid_argument("chat template context must be a JSON object");
  std::string out;
  NUCLEUS_RETURN_IF_ERROR(jinja::Renderer(*program_, context).render(out));
  return out;
}

StatusOr<std::string> ChatTemplate::render(const nlohmann::json& context) const {
  if (!context.is_object()) return invalid_argument("chat template context must be a JSON object");
  return render_ordered(nlohmann::ordered_json(context));
}

}  // namespace nucleus
