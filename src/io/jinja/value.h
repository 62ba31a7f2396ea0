// Template values: JSON values (borrowed or owned), Undefined, namespaces,
// macros and global functions, with Python's semantics (truthiness, str(),
// repr(), ==, ordering, slicing), and the arguments of a call. Internal to
// the chat-template interpreter.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "io/jinja/ast.h"
#include "io/jinja/common.h"

namespace nucleus::jinja {

struct Namespace;

// A template value: a JSON value (borrowed from the context or the syntax
// tree, or owned through `keep`), Undefined, a namespace, a macro or a
// global function. Copies are cheap: JSON is shared, never copied, when a
// value is passed around or an item of it taken.
struct Value {
  enum class Kind { kUndefined, kJson, kNamespace, kMacro, kFunction };
  Kind kind = Kind::kUndefined;
  const json* j = nullptr;
  std::shared_ptr<const json> keep;  // owner of *j; null when *j outlives the render
  std::shared_ptr<Namespace> ns;
  const Node* macro = nullptr;
  std::string name;  // kUndefined: the error to report if it is used; kFunction: its name

  static Value undefined(std::string why) {
    Value v;
    v.name = std::move(why);
    return v;
  }
  static Value of(json value) {
    auto p = std::make_shared<const json>(std::move(value));
    Value v;
    v.kind = Kind::kJson;
    v.j = p.get();
    v.keep = std::move(p);
    return v;
  }
  // A value inside `parent` (or in the context / syntax tree).
  static Value ref(const json& value, const std::shared_ptr<const json>& keep = nullptr) {
    Value v;
    v.kind = Kind::kJson;
    v.j = &value;
    v.keep = keep;
    return v;
  }

  bool is_json() const { return kind == Kind::kJson; }
  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_string() const { return is_json() && j->is_string(); }
  bool is_array() const { return is_json() && j->is_array(); }
  bool is_object() const { return is_json() && j->is_object(); }
  const std::string& str() const { return j->get_ref<const std::string&>(); }
};

struct Namespace {
  std::map<std::string, Value> attrs;
  bool is_loop = false;  // the `loop` variable, which has cycle()
};

// A value inside `parent`, kept alive with it.
Value child(const Value& parent, const json& item);

// A value for namespace `ns`.
Value namespace_value(std::shared_ptr<Namespace> ns);

// Python's type name of `v` ("str", "int", "NoneType", ...) for errors.
const char* type_name(const Value& v);

// Python numbers: bool and int are integers, float is not.
bool is_number(const json& j);
bool is_integral(const json& j);
// The number `j` (is_number) as an int (floats truncated) or a double.
int64_t as_int(const json& j);
double as_double(const json& j);
bool is_int_value(const Value& v);
bool is_num_value(const Value& v);

// Python's truthiness; undefined is false, namespaces, macros and functions
// are true.
bool truthy(const Value& v);

// Python's repr() of a JSON value inside a container, appended to `out`.
void py_repr(const json& j, std::string& out);

// Python's str() of `v` (what {{ v }} prints; undefined prints nothing),
// appended to `out` / returned.
void append_str(const Value& v, std::string& out);
std::string to_str(const Value& v);

// Python ==, with 1 == 1.0 == True.
bool json_eq(const json& a, const json& b);
bool values_eq(const Value& a, const Value& b);

// Python ordering (<0, 0, >0) of numbers, strings and lists; nullopt when
// Python would raise TypeError.
std::optional<int> json_cmp(const json& a, const json& b);

// Positional and keyword arguments of a call, filter or test.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;

  // The argument at position `i` or named `name`; null when not given.
  const Value* get(size_t i, std::string_view name) const {
    if (i < pos.size()) return &pos[i];
    return kwarg(name);
  }
  // The keyword argument `name`; null when not given.
  const Value* kwarg(std::string_view name) const {
    for (const auto& [k, v] : kw)
      if (k == name) return &v;
    return nullptr;
  }
};

// Python slicing of a sequence of `n` items: the indexes taken, in order.
std::vector<size_t> slice_indexes(int64_t n, std::optional<int64_t> start, std::optional<int64_t> stop, int64_t step);

}  // namespace nucleus::jinja
