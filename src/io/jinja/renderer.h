// The renderer: walks the syntax tree over template values, within the
// render budget below. Its core (statements, expressions, calls, operators)
// is in renderer.cpp; str / dict methods, tests and filters in filters.cpp.
// Internal to the chat-template interpreter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "io/jinja/ast.h"
#include "io/jinja/common.h"
#include "io/jinja/value.h"

namespace nucleus::jinja {

// Nested macro calls allowed before a render fails (recursive macros).
constexpr int kMaxCallDepth = 64;
// Longest range() (Jinja2's sandbox limit) and largest string or list a
// `*` repetition may build.
constexpr int64_t kMaxRange = 100000;
constexpr size_t kMaxRepeatBytes = size_t{64} << 20;
// A render's budget: statements and expressions evaluated, and the bytes of
// any string it builds (the output included). A template from a checkpoint
// is code the server runs on every chat request; without a budget, nested
// loops or doubling a string in a loop would hang or exhaust the server.
constexpr int64_t kMaxRenderSteps = 5'000'000;
constexpr size_t kMaxStringBytes = kMaxRepeatBytes;

// Variables of one scope; lookups go to the parent, the template's top
// level being the last scope before the render context and the globals.
struct Scope {
  Scope* parent = nullptr;
  std::unordered_map<std::string, Value> vars;
};

// Renders a parsed template with a context: walks the syntax tree, keeping
// the variables in scopes and counting the render's budget.
class Renderer {
 public:
  Renderer(const detail::TemplateProgram& program, const json& context) : prog_(program), ctx_(context) {}

  // Renders the template into `out`. Errors are kInvalidArgument: a
  // raise_exception(msg) gives `msg`; other runtime errors "chat template
  // line L, column C: <what>". A Renderer renders once.
  Status render(std::string& out) { return exec(prog_.body, top_, out); }

 private:
  Status err(size_t pos, const std::string& what) const { return error_at(prog_.source, pos, what); }

  // Runs `body`; stops early when a break / continue is pending.
  Status exec(const Body& body, Scope& scope, std::string& out);

  // Counts one step of the render against kMaxRenderSteps.
  Status step(size_t pos);
  // Fails when a string of `bytes` would pass kMaxStringBytes.
  Status check_size(size_t bytes, size_t pos) const;
  // Runs one statement, appending what it prints to `out`.
  Status exec_node(const Node& node, Scope& scope, std::string& out);

  // Assigns `v` to one name, or unpacks a list over several.
  Status bind(const std::vector<std::string>& targets, const Value& v, Scope& scope, size_t pos);

  // The items a for loop (or a filter) walks: list items, dict keys, string
  // characters; nothing for undefined.
  Status iterate(const Value& v, size_t pos, std::vector<Value>& items);

  // {% for %}: binds the targets per item, with the `loop` variable.
  Status exec_for(const Node& node, Scope& scope, std::string& out);

  // A variable: the scopes outward, then the context, then the globals;
  // undefined when none has it.
  StatusOr<Value> lookup(const std::string& name, Scope& scope);

  // The value of an expression.
  StatusOr<Value> eval(const Expr& e, Scope& scope);

  // The arguments of a call, filter or test: e.args from `first` on and e.kwargs.
  StatusOr<Args> eval_args(const Expr& e, size_t first, Scope& scope);

  // A JSON value for storing in a list or dict (undefined becomes null unless
  // `strict`, as for tojson).
  StatusOr<json> to_json(const Value& v, size_t pos, bool strict);

  // x.name: a dict key or a namespace attribute; undefined otherwise
  // (chainable: attributes of undefined are undefined).
  Value get_attr(const Value& target, const std::string& name);

  // x[key]: list / string index (negative from the end), dict key.
  Value get_item(const Value& target, const Value& key);

  // x[a:b:c] of a list or string.
  StatusOr<Value> eval_slice(const Expr& e, Scope& scope);

  // f(...): a macro, a global function, or a method (x.name(...)).
  StatusOr<Value> eval_call(const Expr& e, Scope& scope);
  StatusOr<Value> call_macro(const Node& m, const Args& args, size_t pos);
  StatusOr<Value> call_global(const std::string& name, const Args& args, size_t pos);

  // Whether `target` has the method `name` (str and dict methods,
  // loop.cycle); filters.cpp.
  static bool has_method(const Value& target, const std::string& name);
  StatusOr<Value> call_method(const Value& target, const std::string& name, const Args& args, size_t pos);

  // str.replace; an empty `from` inserts `to` around every character.
  static std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t count);

  // a <op> b for + - * / // % ** with Python's semantics.
  StatusOr<Value> arithmetic(const std::string& op, const Value& a, const Value& b, size_t pos);
  // a <op> b for == != < <= > >=.
  StatusOr<bool> compare(const std::string& op, const Value& a, const Value& b, size_t pos);
  // item in seq (list item, dict key, substring, namespace attribute).
  StatusOr<bool> contains(const Value& seq, const Value& item, size_t pos);
  // Python's len() (0 for undefined).
  StatusOr<int64_t> length(const Value& v, size_t pos);

  // v is <name>(args) and v | <name>(args); filters.cpp.
  StatusOr<bool> apply_test(const std::string& name, const Value& v, const Args& args, size_t pos);
  StatusOr<Value> apply_filter(const std::string& name, const Value& in, const Args& args, size_t pos);

  // A list value of `items`.
  StatusOr<Value> list_of(const std::vector<Value>& items, size_t pos);

  // transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None,
  // separators=None, sort_keys=False), keyword arguments as in json.dumps.
  StatusOr<Value> tojson(const Value& in, const Args& args, size_t pos);

  const detail::TemplateProgram& prog_;
  const json& ctx_;
  Scope top_;  // the template's top-level variables
  int depth_ = 0;
  int64_t steps_ = 0;  // statements and expressions evaluated so far
  enum class Flow { kNormal, kBreak, kContinue } flow_ = Flow::kNormal;
};

}  // namespace nucleus::jinja
