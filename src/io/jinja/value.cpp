// Template values with Python's semantics: type names, truthiness, str()
// and repr(), ==, ordering and slicing.
#include "io/jinja/value.h"

#include <algorithm>

#include "io/jinja/python.h"

namespace nucleus::jinja {

Value child(const Value& parent, const json& item) { return Value::ref(item, parent.keep); }

Value namespace_value(std::shared_ptr<Namespace> ns) {
  Value v;
  v.kind = Value::Kind::kNamespace;
  v.ns = std::move(ns);
  return v;
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNamespace: return "Namespace";
    case Value::Kind::kMacro: return "Macro";
    case Value::Kind::kFunction: return "builtin_function_or_method";
    case Value::Kind::kJson: break;
  }
  switch (v.j->type()) {
    case json::value_t::null: return "NoneType";
    case json::value_t::boolean: return "bool";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "int";
    case json::value_t::number_float: return "float";
    case json::value_t::string: return "str";
    case json::value_t::array: return "list";
    case json::value_t::object: return "dict";
    default: return "object";
  }
}

// Python numbers: bool and int are integers, float is not.
bool is_number(const json& j) { return j.is_number() || j.is_boolean(); }
bool is_integral(const json& j) { return j.is_number_integer() || j.is_boolean(); }
int64_t as_int(const json& j) {
  if (j.is_boolean()) return j.get<bool>() ? 1 : 0;
  if (j.is_number_unsigned()) return static_cast<int64_t>(j.get<uint64_t>());
  if (j.is_number_float()) return static_cast<int64_t>(j.get<double>());
  return j.get<int64_t>();
}
double as_double(const json& j) { return j.is_boolean() ? (j.get<bool>() ? 1.0 : 0.0) : j.get<double>(); }
bool is_int_value(const Value& v) { return v.is_json() && is_integral(*v.j); }
bool is_num_value(const Value& v) { return v.is_json() && is_number(*v.j); }

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return false;
    case Value::Kind::kJson: break;
    default: return true;
  }
  const json& j = *v.j;
  switch (j.type()) {
    case json::value_t::null: return false;
    case json::value_t::boolean: return j.get<bool>();
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return as_int(j) != 0;
    case json::value_t::number_float: return j.get<double>() != 0.0;
    case json::value_t::string: return !j.get_ref<const std::string&>().empty();  // json::empty() is false for strings
    case json::value_t::array:
    case json::value_t::object: return !j.empty();
    default: return false;
  }
}

namespace {

// Python's str(): what {{ value }} prints.
void py_str(const json& j, std::string& out) {
  switch (j.type()) {
    case json::value_t::null: out += "None"; break;
    case json::value_t::boolean: out += j.get<bool>() ? "True" : "False"; break;
    case json::value_t::number_integer: out += std::to_string(j.get<int64_t>()); break;
    case json::value_t::number_unsigned: out += std::to_string(j.get<uint64_t>()); break;
    case json::value_t::number_float: out += py_float(j.get<double>()); break;
    case json::value_t::string: out += j.get_ref<const std::string&>(); break;
    default: py_repr(j, out); break;
  }
}

}  // namespace

void py_repr(const json& j, std::string& out) {
  if (j.is_string()) {
    py_repr_string(j.get_ref<const std::string&>(), out);
  } else if (j.is_array()) {
    out += '[';
    for (size_t k = 0; k < j.size(); ++k) {
      if (k) out += ", ";
      py_repr(j[k], out);
    }
    out += ']';
  } else if (j.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [key, item] : j.items()) {
      if (!first) out += ", ";
      first = false;
      py_repr_string(key, out);
      out += ": ";
      py_repr(item, out);
    }
    out += '}';
  } else {
    py_str(j, out);
  }
}

void append_str(const Value& v, std::string& out) {
  switch (v.kind) {
    case Value::Kind::kUndefined: break;
    case Value::Kind::kJson: py_str(*v.j, out); break;
    case Value::Kind::kNamespace: out += "<Namespace>"; break;
    case Value::Kind::kMacro: out += "<Macro '" + v.macro->text + "'>"; break;
    case Value::Kind::kFunction: out += "<built-in function " + v.name + ">"; break;
  }
}

std::string to_str(const Value& v) {
  if (v.is_string()) return v.str();
  std::string s;
  append_str(v, s);
  return s;
}

// Python ==, with 1 == 1.0 == True.
bool json_eq(const json& a, const json& b) {
  if (is_number(a) && is_number(b)) {
    if (is_integral(a) && is_integral(b)) return as_int(a) == as_int(b);
    if (a.is_number_unsigned() || b.is_number_unsigned()) return a == b;
    return as_double(a) == as_double(b);
  }
  if (a.type() != b.type()) return false;
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (size_t k = 0; k < a.size(); ++k)
      if (!json_eq(a[k], b[k])) return false;
    return true;
  }
  if (a.is_object()) {
    if (a.size() != b.size()) return false;
    for (const auto& [key, item] : a.items()) {
      auto it = b.find(key);
      if (it == b.end() || !json_eq(item, *it)) return false;
    }
    return true;
  }
  return a == b;
}

bool values_eq(const Value& a, const Value& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined: return true;
    case Value::Kind::kJson: return json_eq(*a.j, *b.j);
    case Value::Kind::kNamespace: return a.ns == b.ns;
    case Value::Kind::kMacro: return a.macro == b.macro;
    case Value::Kind::kFunction: return a.name == b.name;
  }
  return false;
}

// Python ordering (<0, 0, >0) of numbers, strings and lists; nullopt when
// Python would raise TypeError.
std::optional<int> json_cmp(const json& a, const json& b) {
  if (is_number(a) && is_number(b)) {
    if (is_integral(a) && is_integral(b)) {
      int64_t x = as_int(a), y = as_int(b);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    double x = as_double(a), y = as_double(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    int c = a.get_ref<const std::string&>().compare(b.get_ref<const std::string&>());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_array() && b.is_array()) {
    for (size_t k = 0; k < a.size() && k < b.size(); ++k) {
      if (json_eq(a[k], b[k])) continue;
      return json_cmp(a[k], b[k]);
    }
    return a.size() < b.size() ? -1 : a.size() > b.size() ? 1 : 0;
  }
  return std::nullopt;
}

// Python slicing of a sequence of `n` items: the indexes taken, in order.
std::vector<size_t> slice_indexes(int64_t n, std::optional<int64_t> start, std::optional<int64_t> stop, int64_t step) {
  std::vector<size_t> out;
  auto clamp = [&](std::optional<int64_t> v, int64_t def, int64_t lo, int64_t hi) {
    if (!v) return def;
    int64_t x = *v < 0 ? *v + n : *v;
    return std::clamp(x, lo, hi);
  };
  if (step > 0) {
    int64_t b = clamp(start, 0, 0, n), e = clamp(stop, n, 0, n);
    for (int64_t i = b; i < e; i += step) out.push_back(static_cast<size_t>(i));
  } else {
    int64_t b = clamp(start, n - 1, -1, n - 1), e = clamp(stop, -1, -1, n - 1);
    for (int64_t i = b; i > e; i += step) out.push_back(static_cast<size_t>(i));
  }
  return out;
}

}  // namespace nucleus::jinja
