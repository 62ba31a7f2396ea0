// Chat templates: the subset of Jinja2 that Hugging Face chat templates
// (tokenizer_config.json "chat_template", chat_template.jinja) are written in,
// rendered the way transformers' apply_chat_template renders them: an
// ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and the
// loopcontrols extension, raise_exception() and strftime_now() as globals and
// a tojson filter that is Python's json.dumps (", " / ": " separators, no
// ASCII escaping).
//
// Supported (enough for the DeepSeek-V3 / V3.1 / R1 and Kimi-K2 templates):
//   Template syntax: {{ }}, {% %}, {# #}, whitespace control {%- -%} {{- -}}
//     {#- -#} and {%+, trim_blocks / lstrip_blocks, {% raw %}.
//   Statements: if / elif / else, for (tuple targets, "for x in xs if c",
//     else, loop.index / index0 / revindex / revindex0 / first / last / length
//     / previtem / nextitem / cycle()), break / continue, set (names, tuples,
//     ns.attr, {% set x %}...{% endset %}), macro (parameters with defaults,
//     keyword arguments), generation (transformers' assistant-mask block,
//     rendered as its body).
//   Expressions: literals (strings with Python escapes, ints, floats,
//     true/false/none in either case, lists, tuples, dicts), variables,
//     m.attr, m['key'], slices [a:b:c], + - * / // % **, ~, comparisons
//     (chained), and / or / not (Python semantics: `a or b` yields a value),
//     in / not in, is [not] <test>, a if c else b, filters, calls.
//   Filters: abs capitalize count d default e escape first float indent int
//     items join last length list lower map max min reject rejectattr replace
//     reverse round safe select selectattr sort string sum title tojson trim
//     unique upper.
//   Tests: boolean callable defined divisibleby eq equalto even false float ge
//     gt in integer iterable le lower lt mapping ne none number odd sameas
//     sequence string true undefined upper == != < <= > >=.
//   Methods: str.startswith endswith split rsplit strip lstrip rstrip lower
//     upper title capitalize replace find count join; dict.get items keys
//     values.
//   Globals: range, namespace, dict, raise_exception, strftime_now.
// Values are JSON values plus Undefined, namespaces and macros. Differences
// from Jinja2: attribute or item access on an undefined value gives
// undefined (Jinja2's ChainableUndefined); `d.items` without a call looks up
// the key "items"; tuples and d.items() pairs are lists, so printing one
// shows [a, b] where Python shows (a, b). Lists and dicts are immutable
// (as in transformers' sandbox: no .append()); lower/upper/title change ASCII
// letters only.
#pragma once

#include <concepts>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/status.h"

namespace nucleus {

namespace detail {
// The parsed template (defined in io/jinja/ast.h).
struct TemplateProgram;
}  // namespace detail

class ChatTemplate {
 public:
  // Parses a Jinja2 template. A syntax error, an unknown filter or test, or a
  // construct outside the subset above (e.g. {% include %}) is
  // kInvalidArgument "chat template line L, column C: <what>".
  static StatusOr<ChatTemplate> parse(const std::string& source);

  // Renders with the variables of `context`, a JSON object such as
  // {"messages": [...], "add_generation_prompt": true, "bos_token": "...",
  //  "eos_token": "...", "tools": [...]}. Errors are kInvalidArgument:
  // raise_exception(msg) in the template gives exactly `msg`; other runtime
  // errors (a type error, calling an undefined function, too deep macro
  // recursion) give "chat template line L, column C: <what>". `context` not
  // an object is an error too. Thread-safe: a template may be rendered by
  // many threads at once.
  // nlohmann::json keeps object keys sorted, so `tools | tojson` and
  // d.items() see them sorted; the ordered_json overload keeps the order
  // they were parsed in, which is what transformers (Python dicts) prints.
  StatusOr<std::string> render(const nlohmann::json& context) const;
  // A template so that a braced context, render({{"messages", ...}}), still
  // picks the overload above.
  template <typename Json>
    requires std::same_as<Json, nlohmann::ordered_json>
  StatusOr<std::string> render(const Json& context) const {
    return render_ordered(context);
  }

 private:
  StatusOr<std::string> render_ordered(const nlohmann::ordered_json& context) const;
  explicit ChatTemplate(std::shared_ptr<const detail::TemplateProgram> program) : program_(std::move(program)) {}
  std::shared_ptr<const detail::TemplateProgram> program_;
};

}  // namespace nucleus
