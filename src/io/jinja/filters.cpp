// The renderer's built-ins on values: str and dict methods, tests (`is`),
// filters (`|`) and tojson, with the names the parser accepts.
#include <algorithm>
#include <charconv>
#include <cmath>

#include "io/jinja/lexer.h"
#include "io/jinja/python.h"
#include "io/jinja/renderer.h"

namespace nucleus::jinja {

const std::set<std::string, std::less<>>& known_filters() {
  static const std::set<std::string, std::less<>> s = {
      "abs",     "capitalize", "count",  "d",          "default", "e",       "escape", "first",  "float",
      "indent",  "int",        "items",  "join",       "last",    "length",  "list",   "lower",  "map",
      "max",     "min",        "reject", "rejectattr", "replace", "reverse", "round",  "safe",   "select",
      "selectattr", "sort",    "string", "sum",        "title",   "tojson",  "trim",   "unique", "upper"};
  return s;
}

const std::set<std::string, std::less<>>& known_tests() {
  static const std::set<std::string, std::less<>> s = {
      "boolean", "callable", "defined", "divisibleby", "eq",    "equalto", "even",     "false",    "float",
      "ge",      "gt",       "in",      "integer",     "iterable", "le",   "lower",    "lt",       "mapping",
      "ne",      "none",     "number",  "odd",         "sameas", "sequence", "string", "true",     "undefined",
      "upper",   "==",       "!=",      "<",           "<=",     ">",        ">="};
  return s;
}

bool Renderer::has_method(const Value& target, const std::string& name) {
  static const std::set<std::string, std::less<>> kStr = {
      "startswith", "endswith", "split", "rsplit", "strip",   "lstrip", "rstrip",
      "lower",      "upper",    "title", "capitalize", "replace", "find", "count", "join"};
  static const std::set<std::string, std::less<>> kDict = {"get", "items", "keys", "values"};
  if (target.is_string()) return kStr.count(name) > 0;
  if (target.is_object()) return kDict.count(name) > 0;
  return target.kind == Value::Kind::kNamespace && target.ns->is_loop && name == "cycle";
}

StatusOr<Value> Renderer::call_method(const Value& target, const std::string& name, const Args& args, size_t pos) {
  if (target.kind == Value::Kind::kNamespace) {  // loop.cycle(a, b, ...)
    if (args.pos.empty()) return err(pos, "loop.cycle() needs at least one argument");
    auto index = static_cast<size_t>(as_int(*target.ns->attrs["index0"].j));
    return args.pos[index % args.pos.size()];
  }
  if (target.is_object()) {
    const json& d = *target.j;
    if (name == "get") {
      const Value* key = args.get(0, "key");
      if (!key) return err(pos, "dict.get() needs a key");
      if (key->is_string()) {
        auto it = d.find(key->str());
        if (it != d.end()) return child(target, *it);
      }
      const Value* def = args.get(1, "default");
      return def ? *def : Value::of(nullptr);
    }
    json out = json::array();
    for (const auto& [key, item] : d.items()) {
      if (name == "items") {
        out.push_back(json::array({key, item}));
      } else if (name == "keys") {
        out.push_back(key);
      } else {
        out.push_back(item);
      }
    }
    return Value::of(std::move(out));
  }
  const std::string& s = target.str();
  auto str_arg = [&](size_t i, const char* key) -> StatusOr<const std::string*> {
    const Value* v = args.get(i, key);
    if (!v || v->is_undefined() || (v->is_json() && v->j->is_null())) return nullptr;
    if (!v->is_string())
      return err(pos, "str." + name + "() argument must be a string, not '" + type_name(*v) + "'");
    return &v->str();
  };
  auto int_arg = [&](size_t i, const char* key, int64_t def) -> StatusOr<int64_t> {
    const Value* v = args.get(i, key);
    if (!v || v->is_undefined()) return def;
    if (!is_int_value(*v)) return err(pos, "str." + name + "() argument '" + key + "' must be an integer");
    return as_int(*v->j);
  };
  if (name == "startswith" || name == "endswith") {
    const Value* p = args.get(0, "prefix");
    if (!p) return err(pos, "str." + name + "() needs an argument");
    std::vector<const json*> options;
    if (p->is_array()) {
      for (const json& o : *p->j) options.push_back(&o);
    } else {
      options.push_back(p->j);
    }
    for (const json* o : options) {
      if (!o || !o->is_string()) return err(pos, "str." + name + "() arguments must be strings");
      const std::string& x = o->get_ref<const std::string&>();
      bool hit = name == "startswith" ? s.compare(0, x.size(), x) == 0
                                      : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
      if (hit) return Value::of(true);
    }
    return Value::of(false);
  }
  if (name == "split" || name == "rsplit") {
    NUCLEUS_ASSIGN_OR_RETURN(const std::string* sep, str_arg(0, "sep"));
    NUCLEUS_ASSIGN_OR_RETURN(int64_t maxsplit, int_arg(1, "maxsplit", -1));
    std::vector<std::string> parts;
    if (!sep) {
      if (name == "rsplit" && maxsplit >= 0) {
        // Mirror of split(): split the reversed characters.
        auto chars = utf8_chars(s);
        std::string rev;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) rev += *it;
        for (auto& part : py_split_ws(rev, maxsplit)) {
          auto pc = utf8_chars(part);
          std::string back;
          for (auto it = pc.rbegin(); it != pc.rend(); ++it) back += *it;
          parts.push_back(std::move(back));
        }
        std::reverse(parts.begin(), parts.end());
      } else {
        parts = py_split_ws(s, maxsplit);
      }
    } else {
      if (sep->empty()) return err(pos, "empty separator");
      parts = py_split(s, *sep, maxsplit, name == "rsplit");
    }
    return Value::of(json(parts));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    NUCLEUS_ASSIGN_OR_RETURN(const std::string* chars, str_arg(0, "chars"));
    return Value::of(py_strip(s, chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "lower") return Value::of(ascii_lower(s));
  if (name == "upper") return Value::of(ascii_upper(s));
  if (name == "title" || name == "capitalize") return apply_filter(name, target, Args{}, pos);
  if (name == "replace") {
    NUCLEUS_ASSIGN_OR_RETURN(const std::string* from, str_arg(0, "old"));
    NUCLEUS_ASSIGN_OR_RETURN(const std::string* to, str_arg(1, "new"));
    if (!from || !to) return err(pos, "str.replace() needs two strings");
    NUCLEUS_ASSIGN_OR_RETURN(int64_t count, int_arg(2, "count", -1));
    return Value::of(replace(s, *from, *to, count));
  }
  if (name == "find" || name == "count") {
    NUCLEUS_ASSIGN_OR_RETURN(const std::string* sub, str_arg(0, "sub"));
    if (!sub) return err(pos, "str." + name + "() needs a string");
    if (name == "find") {
      size_t at = s.find(*sub);
      return Value::of(at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(utf8_count(s.substr(0, at))));
    }
    if (sub->empty()) return Value::of(static_cast<int64_t>(utf8_count(s) + 1));
    int64_t count = 0;
    for (size_t at = s.find(*sub); at != std::string::npos; at = s.find(*sub, at + sub->size())) ++count;
    return Value::of(count);
  }
  // join
  const Value* seq = args.get(0, "iterable");
  if (!seq) return err(pos, "str.join() needs a list");
  std::vector<Value> items;
  NUCLEUS_RETURN_IF_ERROR(iterate(*seq, pos, items));
  std::string out;
  for (size_t k = 0; k < items.size(); ++k) {
    if (!items[k].is_string())
      return err(pos, "sequence item " + std::to_string(k) + ": expected str instance, " + type_name(items[k]) +
                          " found");
    if (k) out += s;
    out += items[k].str();
  }
  return Value::of(std::move(out));
}

std::string Renderer::replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  int64_t done = 0;
  if (from.empty()) {
    auto chars = utf8_chars(s);
    for (size_t k = 0; k <= chars.size(); ++k) {
      if (count < 0 || done < count) out += to, ++done;
      if (k < chars.size()) out += chars[k];
    }
    return out;
  }
  size_t i = 0;
  while (count < 0 || done < count) {
    size_t at = s.find(from, i);
    if (at == std::string::npos) break;
    out.append(s, i, at - i);
    out += to;
    i = at + from.size();
    ++done;
  }
  out.append(s, i, std::string::npos);
  return out;
}

StatusOr<bool> Renderer::apply_test(const std::string& name, const Value& v, const Args& args, size_t pos) {
  const json* j = v.is_json() ? v.j : nullptr;
  const Value* arg = args.get(0, "value");
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return j && j->is_null();
  if (name == "boolean") return j && j->is_boolean();
  if (name == "true") return j && j->is_boolean() && j->get<bool>();
  if (name == "false") return j && j->is_boolean() && !j->get<bool>();
  if (name == "string") return j && j->is_string();
  if (name == "number") return j && is_number(*j);
  if (name == "integer") return j && j->is_number_integer();
  if (name == "float") return j && j->is_number_float();
  if (name == "mapping") return j && j->is_object();
  if (name == "iterable") return v.is_undefined() || (j && (j->is_string() || j->is_array() || j->is_object()));
  if (name == "sequence") return j && (j->is_string() || j->is_array() || j->is_object());
  if (name == "callable") return v.kind == Value::Kind::kMacro || v.kind == Value::Kind::kFunction;
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    const std::string& s = v.str();
    bool cased = std::any_of(s.begin(), s.end(), [](char c) { return std::isalpha(static_cast<unsigned char>(c)); });
    return cased && s == (name == "lower" ? ascii_lower(s) : ascii_upper(s));
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    // value % 2 == 1 etc., with Python's % (floats allowed).
    Value divisor = Value::of(2);
    if (name == "divisibleby") {
      if (!arg) return err(pos, "test 'divisibleby' needs an argument");
      divisor = *arg;
    }
    NUCLEUS_ASSIGN_OR_RETURN(Value rem, arithmetic("%", v, divisor, pos));
    return json_eq(*rem.j, json(name == "odd" ? 1 : 0));
  }
  if (!arg) return err(pos, "test '" + name + "' needs an argument");
  if (name == "in") return contains(*arg, v, pos);
  if (name == "sameas") {
    if (!j || !arg->is_json()) return v.kind == arg->kind && values_eq(v, *arg);
    if (j->is_null() || j->is_boolean()) return j->type() == arg->j->type() && *j == *arg->j;
    return j == arg->j;
  }
  static const std::map<std::string, std::string, std::less<>> kOps = {
      {"eq", "=="}, {"equalto", "=="}, {"==", "=="}, {"ne", "!="}, {"!=", "!="}, {"lt", "<"}, {"<", "<"},
      {"le", "<="}, {"<=", "<="},      {"gt", ">"},  {">", ">"},   {"ge", ">="}, {">=", ">="}};
  auto it = kOps.find(name);
  if (it == kOps.end()) return err(pos, "no test named '" + name + "'");
  return compare(it->second, v, *arg, pos);
}

StatusOr<Value> Renderer::apply_filter(const std::string& name, const Value& in, const Args& args, size_t pos) {
  // Filters on text take str() of their input, "" for undefined, as Jinja2.
  if (name == "trim") {
    const Value* chars = args.get(0, "chars");
    std::string c = chars && chars->is_string() ? chars->str() : "";
    return Value::of(py_strip(to_str(in), chars && chars->is_string() ? &c : nullptr, true, true));
  }
  if (name == "lower") return Value::of(ascii_lower(to_str(in)));
  if (name == "upper") return Value::of(ascii_upper(to_str(in)));
  if (name == "string") return in.is_string() ? in : Value::of(to_str(in));
  if (name == "safe") return in;
  if (name == "capitalize") {
    std::string s = ascii_lower(to_str(in));
    if (!s.empty()) s[0] = ascii_upper(s.substr(0, 1))[0];
    return Value::of(std::move(s));
  }
  if (name == "title") {
    std::string s = to_str(in);
    bool start = true;
    for (char& c : s) {
      if (start) {
        c = ascii_upper(std::string(1, c))[0];
      } else {
        c = ascii_lower(std::string(1, c))[0];
      }
      start = is_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    }
    return Value::of(std::move(s));
  }
  if (name == "replace") {
    const Value* from = args.get(0, "old");
    const Value* to = args.get(1, "new");
    const Value* count = args.get(2, "count");
    if (!from || !to) return err(pos, "filter 'replace' needs two arguments");
    int64_t n = count && is_int_value(*count) ? as_int(*count->j) : -1;
    return Value::of(replace(to_str(in), to_str(*from), to_str(*to), n));
  }
  if (name == "e" || name == "escape") {
    std::string out;
    for (char c : to_str(in)) {
      switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&#34;"; break;
        case '\'': out += "&#39;"; break;
        default: out += c;
      }
    }
    return Value::of(std::move(out));
  }
  if (name == "indent") {
    const Value* width = args.get(0, "width");
    const Value* first = args.get(1, "first");
    const Value* blank = args.get(2, "blank");
    std::string pad = width && width->is_string() ? width->str()
                      : std::string(width && is_int_value(*width) ? std::max<int64_t>(0, as_int(*width->j)) : 4, ' ');
    // Jinja2: lines = (s + "\n").splitlines(); the first line is not
    // indented, nor are empty lines unless `blank`.
    std::vector<std::string> lines = py_split(to_str(in) + "\n", "\n", -1, false);
    lines.pop_back();
    std::string out = lines[0];
    for (size_t k = 1; k < lines.size(); ++k) {
      out += '\n';
      if (!lines[k].empty() || (blank && truthy(*blank))) out += pad;
      out += lines[k];
    }
    if (first && truthy(*first)) out = pad + out;
    return Value::of(std::move(out));
  }
  if (name == "length" || name == "count") {
    NUCLEUS_ASSIGN_OR_RETURN(int64_t n, length(in, pos));
    return Value::of(n);
  }
  if (name == "default" || name == "d") {
    const Value* def = args.get(0, "default_value");
    const Value* boolean = args.get(1, "boolean");
    if (in.is_undefined() || (boolean && truthy(*boolean) && !truthy(in))) return def ? *def : Value::of("");
    return in;
  }
  if (name == "tojson") return tojson(in, args, pos);
  if (name == "abs") {
    if (!is_num_value(in)) return err(pos, std::string("bad operand type for abs(): '") + type_name(in) + "'");
    if (is_integral(*in.j)) return Value::of(std::abs(as_int(*in.j)));
    return Value::of(std::fabs(as_double(*in.j)));
  }
  if (name == "int" || name == "float") {
    const Value* def = args.get(0, "default");
    std::optional<double> d;
    std::optional<int64_t> i;
    if (is_num_value(in)) {
      if (is_integral(*in.j)) i = as_int(*in.j);
      d = as_double(*in.j);
    } else if (in.is_string()) {
      std::string s = py_strip(in.str(), nullptr, true, true);
      int64_t iv = 0;
      auto r = std::from_chars(s.data(), s.data() + s.size(), iv);
      if (!s.empty() && r.ec == std::errc() && r.ptr == s.data() + s.size()) i = iv, d = static_cast<double>(iv);
      char* end = nullptr;
      double dv = std::strtod(s.c_str(), &end);
      if (!i && !s.empty() && end == s.c_str() + s.size()) d = dv;
    }
    if (name == "float") return d ? Value::of(*d) : (def ? *def : Value::of(0.0));
    if (!i && d && std::isfinite(*d)) i = static_cast<int64_t>(*d);
    return i ? Value::of(*i) : (def ? *def : Value::of(0));
  }
  if (name == "round") {
    if (!is_num_value(in)) return err(pos, "filter 'round' needs a number");
    const Value* precision = args.get(0, "precision");
    const Value* method = args.get(1, "method");
    int64_t p = precision && is_int_value(*precision) ? as_int(*precision->j) : 0;
    std::string m = method && method->is_string() ? method->str() : "common";
    double scale = std::pow(10.0, static_cast<double>(p)), x = as_double(*in.j) * scale;
    // "common" is Python's round(): halves go to the even neighbour.
    x = m == "ceil" ? std::ceil(x) : m == "floor" ? std::floor(x) : std::nearbyint(x);
    return Value::of(x / scale);
  }
  // Filters over sequences.
  std::vector<Value> items;
  if (name == "first" || name == "last") {
    NUCLEUS_RETURN_IF_ERROR(iterate(in, pos, items));
    if (items.empty()) return Value::undefined("no " + name + " item, the sequence was empty");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "items") {
    if (in.is_undefined()) return Value::of(json::array());
    if (!in.is_object()) return err(pos, std::string("filter 'items' needs a dict, got '") + type_name(in) + "'");
    return call_method(in, "items", Args{}, pos);
  }
  NUCLEUS_RETURN_IF_ERROR(iterate(in, pos, items));
  if (name == "list") return list_of(items, pos);
  if (name == "reverse") {
    if (in.is_string()) {
      auto chars = utf8_chars(in.str());
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
      return Value::of(std::move(out));
    }
    std::reverse(items.begin(), items.end());
    return list_of(items, pos);
  }
  if (name == "join") {
    const Value* sep = args.get(0, "d");
    const Value* attribute = args.get(1, "attribute");
    std::string out, s = sep ? to_str(*sep) : "";
    for (size_t k = 0; k < items.size(); ++k) {
      if (k) out += s;
      append_str(attribute ? get_item(items[k], *attribute) : items[k], out);
    }
    return Value::of(std::move(out));
  }
  if (name == "map") {
    const Value* attribute = args.kwarg("attribute");
    std::vector<Value> out;
    if (attribute) {
      const Value* def = args.kwarg("default");
      for (const Value& item : items) {
        Value v = get_item(item, *attribute);
        out.push_back(v.is_undefined() && def ? *def : v);
      }
    } else {
      if (args.pos.empty() || !args.pos[0].is_string()) return err(pos, "filter 'map' needs a filter name or attribute=");
      const std::string& filter = args.pos[0].str();
      if (!known_filters().count(filter)) return err(pos, "no filter named '" + filter + "'");
      Args rest{std::vector<Value>(args.pos.begin() + 1, args.pos.end()), args.kw};
      for (const Value& item : items) {
        NUCLEUS_ASSIGN_OR_RETURN(Value v, apply_filter(filter, item, rest, pos));
        out.push_back(std::move(v));
      }
    }
    return list_of(out, pos);
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    bool by_attr = name.size() > 6;
    bool want = name[0] == 's';
    size_t test_at = by_attr ? 1 : 0;
    if (by_attr && (args.pos.empty() || !args.pos[0].is_string()))
      return err(pos, "filter '" + name + "' needs an attribute name");
    std::string test;
    if (args.pos.size() > test_at) {
      if (!args.pos[test_at].is_string()) return err(pos, "filter '" + name + "' needs a test name");
      test = args.pos[test_at].str();
      if (!known_tests().count(test)) return err(pos, "no test named '" + test + "'");
    }
    Args test_args;
    if (args.pos.size() > test_at + 1) test_args.pos.assign(args.pos.begin() + test_at + 1, args.pos.end());
    std::vector<Value> out;
    for (const Value& item : items) {
      Value v = by_attr ? get_item(item, args.pos[0]) : item;
      bool r = truthy(v);
      if (!test.empty()) {
        NUCLEUS_ASSIGN_OR_RETURN(r, apply_test(test, v, test_args, pos));
      }
      if (r == want) out.push_back(item);
    }
    return list_of(out, pos);
  }
  if (name == "sort" || name == "unique" || name == "min" || name == "max") {
    const Value* reverse = name == "sort" ? args.get(0, "reverse") : nullptr;
    const Value* case_sensitive = args.get(name == "sort" ? 1 : 0, "case_sensitive");
    const Value* attribute = args.get(name == "sort" ? 2 : 1, "attribute");
    bool fold = !(case_sensitive && truthy(*case_sensitive));
    // Sort keys: the attribute if asked for, strings lowercased unless
    // case_sensitive (Jinja2's default).
    std::vector<json> keys;
    for (const Value& item : items) {
      Value k = attribute ? get_item(item, *attribute) : item;
      NUCLEUS_ASSIGN_OR_RETURN(json key, to_json(k, pos, false));
      if (fold && key.is_string()) key = ascii_lower(key.get<std::string>());
      keys.push_back(std::move(key));
    }
    if (name == "unique") {
      std::vector<Value> out;
      std::vector<json> seen;
      for (size_t k = 0; k < items.size(); ++k) {
        if (std::any_of(seen.begin(), seen.end(), [&](const json& s) { return json_eq(s, keys[k]); })) continue;
        seen.push_back(keys[k]);
        out.push_back(items[k]);
      }
      return list_of(out, pos);
    }
    std::vector<size_t> order(items.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    bool bad = false;
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      auto c = json_cmp(keys[x], keys[y]);
      if (!c) bad = true;
      return c.value_or(0) < 0;
    });
    if (bad) return err(pos, "filter '" + name + "': the items cannot be ordered");
    if (name == "min" || name == "max") {
      if (items.empty()) return Value::undefined("no " + name + " item, the sequence was empty");
      return name == "min" ? items[order.front()] : items[order.back()];
    }
    if (reverse && truthy(*reverse)) std::reverse(order.begin(), order.end());
    std::vector<Value> out;
    for (size_t k : order) out.push_back(items[k]);
    return list_of(out, pos);
  }
  if (name == "sum") {
    const Value* attribute = args.get(0, "attribute");
    const Value* start = args.get(1, "start");
    Value total = start ? *start : Value::of(0);
    for (const Value& item : items) {
      NUCLEUS_ASSIGN_OR_RETURN(total, arithmetic("+", total, attribute ? get_item(item, *attribute) : item, pos));
    }
    return total;
  }
  return err(pos, "no filter named '" + name + "'");
}

StatusOr<Value> Renderer::list_of(const std::vector<Value>& items, size_t pos) {
  json out = json::array();
  for (const Value& v : items) {
    NUCLEUS_ASSIGN_OR_RETURN(json j, to_json(v, pos, false));
    out.push_back(std::move(j));
  }
  return Value::of(std::move(out));
}

StatusOr<Value> Renderer::tojson(const Value& in, const Args& args, size_t pos) {
  JsonStyle st;
  const Value* indent = args.get(0, "indent");
  if (indent && indent->is_json() && !indent->j->is_null()) {
    st.pretty = true;
    st.item_sep = ",";
    st.indent = indent->is_string() ? indent->str() : std::string(std::max<int64_t>(0, as_int(*indent->j)), ' ');
  }
  for (const auto& [key, v] : args.kw) {
    if (key == "ensure_ascii") {
      st.ensure_ascii = truthy(v);
    } else if (key == "separators") {
      if (v.is_json() && v.j->is_null()) continue;
      if (!v.is_array() || v.j->size() != 2 || !(*v.j)[0].is_string() || !(*v.j)[1].is_string())
        return err(pos, "tojson separators must be a pair of strings");
      st.item_sep = (*v.j)[0].get<std::string>();
      st.key_sep = (*v.j)[1].get<std::string>();
    } else if (key != "indent" && key != "sort_keys") {  // keys are always sorted here
      return err(pos, "tojson() got an unexpected keyword argument '" + key + "'");
    }
  }
  if (!in.is_json()) return err(pos, std::string("Object of type ") + type_name(in) + " is not JSON serializable");
  std::string out;
  dump_json(*in.j, st, 0, out);
  return Value::of(std::move(out));
}

}  // namespace nucleus::jinja
