// The renderer's core: statements (output, if, for, set, macro), expression
// evaluation, variable lookup, calls of macros and globals, arithmetic and
// comparisons. Methods, filters and tests are in filters.cpp.
#include "io/jinja/renderer.h"

#include <algorithm>
#include <cmath>
#include <ctime>

#include "io/jinja/python.h"

namespace nucleus::jinja {

Status Renderer::exec(const Body& body, Scope& scope, std::string& out) {
  for (const auto& node : body) {
    NUCLEUS_RETURN_IF_ERROR(exec_node(*node, scope, out));
    if (flow_ != Flow::kNormal) break;
  }
  return ok_status();
}

Status Renderer::step(size_t pos) {
  if (++steps_ > kMaxRenderSteps)
    return err(pos, "the template ran more than " + std::to_string(kMaxRenderSteps) + " steps (a runaway loop?)");
  return ok_status();
}

Status Renderer::check_size(size_t bytes, size_t pos) const {
  if (bytes > kMaxStringBytes)
    return err(pos, "the template built a string of more than " + std::to_string(kMaxStringBytes) + " bytes");
  return ok_status();
}

Status Renderer::exec_node(const Node& node, Scope& scope, std::string& out) {
  NUCLEUS_RETURN_IF_ERROR(step(node.pos));
  NUCLEUS_RETURN_IF_ERROR(check_size(out.size(), node.pos));
  switch (node.kind) {
    case Node::Kind::kText: out += node.text; return ok_status();
    case Node::Kind::kOutput: {
      NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*node.expr, scope));
      append_str(v, out);
      return ok_status();
    }
    case Node::Kind::kIf:
      for (const auto& [cond, body] : node.branches) {
        NUCLEUS_ASSIGN_OR_RETURN(Value c, eval(*cond, scope));
        if (truthy(c)) return exec(body, scope, out);
      }
      return exec(node.else_body, scope, out);
    case Node::Kind::kFor: return exec_for(node, scope, out);
    case Node::Kind::kSet: {
      NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*node.expr, scope));
      return bind(node.targets, v, scope, node.pos);
    }
    case Node::Kind::kSetAttr: {
      NUCLEUS_ASSIGN_OR_RETURN(Value target, lookup(node.targets[0], scope));
      if (target.kind != Value::Kind::kNamespace || target.ns->is_loop)
        return err(node.pos, "cannot assign attribute '" + node.targets[1] + "' of '" + node.targets[0] +
                                 "': it is not a namespace()");
      NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*node.expr, scope));
      target.ns->attrs[node.targets[1]] = std::move(v);
      return ok_status();
    }
    case Node::Kind::kSetBlock: {
      std::string text;
      NUCLEUS_RETURN_IF_ERROR(exec(node.body, scope, text));
      scope.vars[node.targets[0]] = Value::of(std::move(text));
      return ok_status();
    }
    case Node::Kind::kMacro: {
      Value m;
      m.kind = Value::Kind::kMacro;
      m.macro = &node;
      scope.vars[node.text] = std::move(m);
      return ok_status();
    }
    case Node::Kind::kBreak: flow_ = Flow::kBreak; return ok_status();
    case Node::Kind::kContinue: flow_ = Flow::kContinue; return ok_status();
  }
  return ok_status();
}

Status Renderer::bind(const std::vector<std::string>& targets, const Value& v, Scope& scope, size_t pos) {
  if (targets.size() == 1) {
    scope.vars[targets[0]] = v;
    return ok_status();
  }
  if (!v.is_array() || v.j->size() != targets.size())
    return err(pos, std::string("cannot unpack a ") + type_name(v) + " into " + std::to_string(targets.size()) +
                        " variables");
  for (size_t k = 0; k < targets.size(); ++k) scope.vars[targets[k]] = child(v, (*v.j)[k]);
  return ok_status();
}

Status Renderer::iterate(const Value& v, size_t pos, std::vector<Value>& items) {
  if (v.is_undefined()) return ok_status();
  if (v.is_array()) {
    for (const json& item : *v.j) items.push_back(child(v, item));
  } else if (v.is_object()) {
    for (const auto& [key, item] : v.j->items()) items.push_back(Value::of(key));
  } else if (v.is_string()) {
    for (std::string_view c : utf8_chars(v.str())) items.push_back(Value::of(std::string(c)));
  } else {
    return err(pos, std::string("'") + type_name(v) + "' object is not iterable");
  }
  return ok_status();
}

Status Renderer::exec_for(const Node& node, Scope& scope, std::string& out) {
  NUCLEUS_ASSIGN_OR_RETURN(Value seq, eval(*node.expr, scope));
  std::vector<Value> items;
  NUCLEUS_RETURN_IF_ERROR(iterate(seq, node.expr->pos, items));
  if (node.filter) {
    std::vector<Value> kept;
    for (Value& item : items) {
      Scope s{&scope, {}};
      NUCLEUS_RETURN_IF_ERROR(bind(node.targets, item, s, node.pos));
      NUCLEUS_ASSIGN_OR_RETURN(Value keep, eval(*node.filter, s));
      if (truthy(keep)) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    Scope s{&scope, {}};
    return exec(node.else_body, s, out);
  }
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t k = 0; k < n; ++k) {
    // Each iteration starts from the enclosing scope: what the body sets
    // is gone at the next one (Jinja2 semantics). An iteration is a step,
    // even of an empty body.
    NUCLEUS_RETURN_IF_ERROR(step(node.pos));
    Scope s{&scope, {}};
    NUCLEUS_RETURN_IF_ERROR(bind(node.targets, items[k], s, node.pos));
    auto loop = std::make_shared<Namespace>();
    loop->is_loop = true;
    auto& a = loop->attrs;
    a["index"] = Value::of(k + 1);
    a["index0"] = Value::of(k);
    a["revindex"] = Value::of(n - k);
    a["revindex0"] = Value::of(n - k - 1);
    a["first"] = Value::of(k == 0);
    a["last"] = Value::of(k == n - 1);
    a["length"] = Value::of(n);
    a["depth"] = Value::of(1);
    a["depth0"] = Value::of(0);
    a["previtem"] = k > 0 ? items[k - 1] : Value::undefined("there is no previous item");
    a["nextitem"] = k + 1 < n ? items[k + 1] : Value::undefined("there is no next item");
    s.vars["loop"] = namespace_value(std::move(loop));
    NUCLEUS_RETURN_IF_ERROR(exec(node.body, s, out));
    Flow f = flow_;
    flow_ = Flow::kNormal;
    if (f == Flow::kBreak) break;
  }
  return ok_status();
}

StatusOr<Value> Renderer::lookup(const std::string& name, Scope& scope) {
  for (Scope* s = &scope; s; s = s->parent) {
    auto it = s->vars.find(name);
    if (it != s->vars.end()) return it->second;
  }
  if (ctx_.is_object()) {
    auto it = ctx_.find(name);
    if (it != ctx_.end()) return Value::ref(*it);
  }
  static const std::set<std::string, std::less<>> kGlobals = {"range", "namespace", "dict", "raise_exception",
                                                              "strftime_now"};
  if (kGlobals.count(name)) {
    Value f;
    f.kind = Value::Kind::kFunction;
    f.name = name;
    return f;
  }
  return Value::undefined("'" + name + "' is undefined");
}

StatusOr<Value> Renderer::eval(const Expr& e, Scope& scope) {
  NUCLEUS_RETURN_IF_ERROR(step(e.pos));
  switch (e.kind) {
    case Expr::Kind::kLiteral: return Value::ref(e.literal);
    case Expr::Kind::kName: return lookup(e.name, scope);
    case Expr::Kind::kList:
    case Expr::Kind::kTuple: {
      json list = json::array();
      for (const auto& item : e.args) {
        NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*item, scope));
        NUCLEUS_ASSIGN_OR_RETURN(json j, to_json(v, item->pos, false));
        list.push_back(std::move(j));
      }
      return Value::of(std::move(list));
    }
    case Expr::Kind::kDict: {
      json dict = json::object();
      for (size_t k = 0; k < e.args.size(); k += 2) {
        NUCLEUS_ASSIGN_OR_RETURN(Value key, eval(*e.args[k], scope));
        if (!key.is_string()) return err(e.args[k]->pos, "dict keys must be strings");
        NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[k + 1], scope));
        NUCLEUS_ASSIGN_OR_RETURN(dict[key.str()], to_json(v, e.args[k + 1]->pos, false));
      }
      return Value::of(std::move(dict));
    }
    case Expr::Kind::kGetAttr: {
      NUCLEUS_ASSIGN_OR_RETURN(Value target, eval(*e.args[0], scope));
      return get_attr(target, e.name);
    }
    case Expr::Kind::kGetItem: {
      NUCLEUS_ASSIGN_OR_RETURN(Value target, eval(*e.args[0], scope));
      NUCLEUS_ASSIGN_OR_RETURN(Value key, eval(*e.args[1], scope));
      return get_item(target, key);
    }
    case Expr::Kind::kSlice: return eval_slice(e, scope);
    case Expr::Kind::kCall: return eval_call(e, scope);
    case Expr::Kind::kFilter: {
      NUCLEUS_ASSIGN_OR_RETURN(Value input, eval(*e.args[0], scope));
      NUCLEUS_ASSIGN_OR_RETURN(Args args, eval_args(e, 1, scope));
      return apply_filter(e.name, input, args, e.pos);
    }
    case Expr::Kind::kTest: {
      NUCLEUS_ASSIGN_OR_RETURN(Value input, eval(*e.args[0], scope));
      NUCLEUS_ASSIGN_OR_RETURN(Args args, eval_args(e, 1, scope));
      NUCLEUS_ASSIGN_OR_RETURN(bool r, apply_test(e.name, input, args, e.pos));
      return Value::of(r != e.negated);
    }
    case Expr::Kind::kNeg:
    case Expr::Kind::kPos: {
      NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[0], scope));
      if (v.is_undefined()) return err(e.pos, v.name);
      if (!is_num_value(v))
        return err(e.pos, std::string("bad operand type for unary ") + (e.kind == Expr::Kind::kNeg ? "-" : "+") +
                              ": '" + type_name(v) + "'");
      if (e.kind == Expr::Kind::kPos) return v;
      if (is_integral(*v.j)) return Value::of(-as_int(*v.j));
      return Value::of(-as_double(*v.j));
    }
    case Expr::Kind::kNot: {
      NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[0], scope));
      return Value::of(!truthy(v));
    }
    case Expr::Kind::kBinary: {
      NUCLEUS_ASSIGN_OR_RETURN(Value a, eval(*e.args[0], scope));
      NUCLEUS_ASSIGN_OR_RETURN(Value b, eval(*e.args[1], scope));
      return arithmetic(e.name, a, b, e.pos);
    }
    case Expr::Kind::kAnd:
    case Expr::Kind::kOr: {
      // Python semantics: the deciding operand itself, not a bool.
      NUCLEUS_ASSIGN_OR_RETURN(Value a, eval(*e.args[0], scope));
      if (truthy(a) == (e.kind == Expr::Kind::kOr)) return a;
      return eval(*e.args[1], scope);
    }
    case Expr::Kind::kCompare: {
      NUCLEUS_ASSIGN_OR_RETURN(Value left, eval(*e.args[0], scope));
      for (size_t k = 0; k < e.ops.size(); ++k) {
        NUCLEUS_ASSIGN_OR_RETURN(Value right, eval(*e.args[k + 1], scope));
        NUCLEUS_ASSIGN_OR_RETURN(bool r, compare(e.ops[k], left, right, e.args[k + 1]->pos));
        if (!r) return Value::of(false);
        left = std::move(right);
      }
      return Value::of(true);
    }
    case Expr::Kind::kConcat: {
      std::string s;
      for (const auto& part : e.args) {
        NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*part, scope));
        append_str(v, s);
        NUCLEUS_RETURN_IF_ERROR(check_size(s.size(), e.pos));
      }
      return Value::of(std::move(s));
    }
    case Expr::Kind::kCond: {
      NUCLEUS_ASSIGN_OR_RETURN(Value c, eval(*e.args[1], scope));
      if (truthy(c)) return eval(*e.args[0], scope);
      if (e.args[2]) return eval(*e.args[2], scope);
      return Value::undefined("the inline if expression has no else branch");
    }
  }
  return err(e.pos, "internal error: unknown expression");
}

StatusOr<Args> Renderer::eval_args(const Expr& e, size_t first, Scope& scope) {
  Args a;
  for (size_t k = first; k < e.args.size(); ++k) {
    NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[k], scope));
    a.pos.push_back(std::move(v));
  }
  for (const auto& [key, expr] : e.kwargs) {
    NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*expr, scope));
    a.kw.emplace_back(key, std::move(v));
  }
  return a;
}

StatusOr<json> Renderer::to_json(const Value& v, size_t pos, bool strict) {
  switch (v.kind) {
    case Value::Kind::kJson: return *v.j;
    case Value::Kind::kUndefined:
      if (strict) return err(pos, "Object of type Undefined is not JSON serializable");
      return json(nullptr);
    default: return err(pos, std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

Value Renderer::get_attr(const Value& target, const std::string& name) {
  if (target.is_object()) {
    auto it = target.j->find(name);
    if (it != target.j->end()) return child(target, *it);
    return Value::undefined("'dict object' has no attribute '" + name + "'");
  }
  if (target.kind == Value::Kind::kNamespace) {
    auto it = target.ns->attrs.find(name);
    if (it != target.ns->attrs.end()) return it->second;
    return Value::undefined("'namespace' has no attribute '" + name + "'");
  }
  if (target.is_undefined()) return target;
  return Value::undefined(std::string("'") + type_name(target) + " object' has no attribute '" + name + "'");
}

Value Renderer::get_item(const Value& target, const Value& key) {
  if (target.is_undefined()) return target;
  if (key.is_string() && (target.is_object() || target.kind == Value::Kind::kNamespace))
    return get_attr(target, key.str());
  if (is_int_value(key) && (target.is_array() || target.is_string())) {
    int64_t i = as_int(*key.j);
    if (target.is_array()) {
      auto n = static_cast<int64_t>(target.j->size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return child(target, (*target.j)[static_cast<size_t>(i)]);
    } else {
      auto chars = utf8_chars(target.str());
      auto n = static_cast<int64_t>(chars.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return Value::of(std::string(chars[static_cast<size_t>(i)]));
    }
    return Value::undefined(std::string("index ") + std::to_string(as_int(*key.j)) + " out of range");
  }
  std::string k;
  if (key.is_json()) py_repr(*key.j, k);
  return Value::undefined(std::string("'") + type_name(target) + " object' has no item " + k);
}

StatusOr<Value> Renderer::eval_slice(const Expr& e, Scope& scope) {
  NUCLEUS_ASSIGN_OR_RETURN(Value target, eval(*e.args[0], scope));
  std::optional<int64_t> parts[3];
  for (int k = 0; k < 3; ++k) {
    if (!e.args[k + 1]) continue;
    NUCLEUS_ASSIGN_OR_RETURN(Value v, eval(*e.args[k + 1], scope));
    if (v.is_undefined() || (v.is_json() && v.j->is_null())) continue;
    if (!is_int_value(v)) return err(e.args[k + 1]->pos, "slice indices must be integers or none");
    parts[k] = as_int(*v.j);
  }
  int64_t step = parts[2].value_or(1);
  if (step == 0) return err(e.pos, "slice step cannot be zero");
  if (target.is_array()) {
    json out = json::array();
    for (size_t i : slice_indexes(static_cast<int64_t>(target.j->size()), parts[0], parts[1], step))
      out.push_back((*target.j)[i]);
    return Value::of(std::move(out));
  }
  if (target.is_string()) {
    auto chars = utf8_chars(target.str());
    std::string out;
    for (size_t i : slice_indexes(static_cast<int64_t>(chars.size()), parts[0], parts[1], step)) out += chars[i];
    return Value::of(std::move(out));
  }
  if (target.is_undefined()) return target;
  return err(e.pos, std::string("'") + type_name(target) + "' object is not subscriptable");
}

StatusOr<Value> Renderer::eval_call(const Expr& e, Scope& scope) {
  const Expr& callee = *e.args[0];
  Value fn;
  if (callee.kind == Expr::Kind::kGetAttr) {
    // obj.method(...) on strings, dicts and loop: no bound-method values.
    NUCLEUS_ASSIGN_OR_RETURN(Value target, eval(*callee.args[0], scope));
    if (has_method(target, callee.name)) {
      NUCLEUS_ASSIGN_OR_RETURN(Args args, eval_args(e, 1, scope));
      return call_method(target, callee.name, args, e.pos);
    }
    fn = get_attr(target, callee.name);
  } else {
    NUCLEUS_ASSIGN_OR_RETURN(fn, eval(callee, scope));
  }
  NUCLEUS_ASSIGN_OR_RETURN(Args args, eval_args(e, 1, scope));
  switch (fn.kind) {
    case Value::Kind::kMacro: return call_macro(*fn.macro, args, e.pos);
    case Value::Kind::kFunction: return call_global(fn.name, args, e.pos);
    case Value::Kind::kUndefined: return err(e.pos, fn.name);
    default: return err(e.pos, std::string("'") + type_name(fn) + "' object is not callable");
  }
}

StatusOr<Value> Renderer::call_macro(const Node& m, const Args& args, size_t pos) {
  if (args.pos.size() > m.targets.size())
    return err(pos, "macro '" + m.text + "' takes at most " + std::to_string(m.targets.size()) + " arguments (" +
                        std::to_string(args.pos.size()) + " given)");
  for (const auto& [key, v] : args.kw)
    if (std::find(m.targets.begin(), m.targets.end(), key) == m.targets.end())
      return err(pos, "macro '" + m.text + "' has no parameter named '" + key + "'");
  if (depth_ >= kMaxCallDepth) return err(pos, "macro calls nested too deeply (recursion?)");
  // A macro sees the template's top-level variables and its parameters,
  // not the caller's locals.
  Scope s{&top_, {}};
  for (size_t k = 0; k < m.targets.size(); ++k) {
    if (const Value* v = args.get(k, m.targets[k])) {
      s.vars[m.targets[k]] = *v;
    } else if (m.defaults[k]) {
      NUCLEUS_ASSIGN_OR_RETURN(s.vars[m.targets[k]], eval(*m.defaults[k], s));
    } else {
      s.vars[m.targets[k]] = Value::undefined("'" + m.targets[k] + "' is undefined");
    }
  }
  ++depth_;
  std::string out;
  Status st = exec(m.body, s, out);
  --depth_;
  flow_ = Flow::kNormal;
  NUCLEUS_RETURN_IF_ERROR(st);
  return Value::of(std::move(out));
}

StatusOr<Value> Renderer::call_global(const std::string& name, const Args& args, size_t pos) {
  if (name == "raise_exception") {
    // The template's own message, for the client: no location prefix.
    const Value* msg = args.get(0, "message");
    return invalid_argument(msg ? to_str(*msg) : "raise_exception() called");
  }
  if (name == "range") {
    int64_t v[3] = {0, 0, 1};
    if (args.pos.empty() || args.pos.size() > 3) return err(pos, "range() takes 1 to 3 integer arguments");
    for (size_t k = 0; k < args.pos.size(); ++k) {
      if (!is_int_value(args.pos[k])) return err(pos, "range() arguments must be integers");
      v[args.pos.size() == 1 ? 1 : k] = as_int(*args.pos[k].j);
    }
    if (v[2] == 0) return err(pos, "range() step must not be zero");
    __int128 span = v[2] > 0 ? __int128{v[1]} - v[0] : __int128{v[0]} - v[1];
    __int128 step = v[2] > 0 ? v[2] : -__int128{v[2]};
    __int128 count = span > 0 ? (span + step - 1) / step : 0;
    if (count > kMaxRange) return err(pos, "range() is too large (over " + std::to_string(kMaxRange) + " items)");
    json out = json::array();
    for (int64_t k = 0; k < static_cast<int64_t>(count); ++k) out.push_back(v[0] + k * v[2]);
    return Value::of(std::move(out));
  }
  if (name == "namespace" || name == "dict") {
    auto ns = std::make_shared<Namespace>();
    json d = json::object();
    if (!args.pos.empty()) {
      if (args.pos.size() > 1 || !args.pos[0].is_object())
        return err(pos, name + "() takes one optional dict and keyword arguments");
      for (const auto& [key, item] : args.pos[0].j->items()) {
        ns->attrs[key] = child(args.pos[0], item);
        d[key] = item;
      }
    }
    for (const auto& [key, v] : args.kw) {
      ns->attrs[key] = v;
      if (name == "dict") {
        NUCLEUS_ASSIGN_OR_RETURN(d[key], to_json(v, pos, false));
      }
    }
    if (name == "dict") return Value::of(std::move(d));
    return namespace_value(std::move(ns));
  }
  if (name == "strftime_now") {
    const Value* fmt = args.get(0, "format");
    if (!fmt || !fmt->is_string()) return err(pos, "strftime_now() needs a format string");
    std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    std::string buf(256 + fmt->str().size() * 8, '\0');
    size_t n = std::strftime(buf.data(), buf.size(), fmt->str().c_str(), &tm);
    buf.resize(n);
    return Value::of(std::move(buf));
  }
  return err(pos, "unknown function '" + name + "'");
}

StatusOr<Value> Renderer::arithmetic(const std::string& op, const Value& a, const Value& b, size_t pos) {
  if (a.is_undefined()) return err(pos, a.name);
  if (b.is_undefined()) return err(pos, b.name);
  auto unsupported_op = [&] {
    return err(pos, "unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  };
  if (is_num_value(a) && is_num_value(b)) {
    const json &x = *a.j, &y = *b.j;
    if (is_integral(x) && is_integral(y) && op != "/") {
      int64_t p = as_int(x), q = as_int(y), r = 0;
      bool overflow = false;
      if (op == "+") {
        overflow = __builtin_add_overflow(p, q, &r);
      } else if (op == "-") {
        overflow = __builtin_sub_overflow(p, q, &r);
      } else if (op == "*") {
        overflow = __builtin_mul_overflow(p, q, &r);
      } else if (op == "//" || op == "%") {
        if (q == 0) return err(pos, "integer division or modulo by zero");
        if (p == INT64_MIN && q == -1) {
          overflow = op == "//";
        } else {
          int64_t quot = p / q, rem = p % q;
          if (rem != 0 && ((rem < 0) != (q < 0))) --quot, rem += q;  // floor, as Python
          r = op == "//" ? quot : rem;
        }
      } else if (q >= 0) {  // **
        r = 1;
        for (int64_t k = 0; k < q && !overflow; ++k) overflow = __builtin_mul_overflow(r, p, &r);
      } else {
        return Value::of(std::pow(static_cast<double>(p), static_cast<double>(q)));
      }
      if (overflow) return err(pos, "integer overflow in '" + op + "'");
      return Value::of(r);
    }
    double p = as_double(x), q = as_double(y);
    if (op == "+") return Value::of(p + q);
    if (op == "-") return Value::of(p - q);
    if (op == "*") return Value::of(p * q);
    if (op == "**") return Value::of(std::pow(p, q));
    if (q == 0) return err(pos, "division by zero");
    if (op == "/") return Value::of(p / q);
    if (op == "//") return Value::of(std::floor(p / q));
    double r = std::fmod(p, q);
    if (r != 0 && ((r < 0) != (q < 0))) r += q;
    return Value::of(r);
  }
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      NUCLEUS_RETURN_IF_ERROR(check_size(a.str().size() + b.str().size(), pos));
      return Value::of(a.str() + b.str());
    }
    if (a.is_array() && b.is_array()) {
      NUCLEUS_RETURN_IF_ERROR(check_size(a.j->size() + b.j->size(), pos));
      json out = *a.j;
      for (const json& item : *b.j) out.push_back(item);
      return Value::of(std::move(out));
    }
  }
  if (op == "*") {
    const Value* seq = is_int_value(a) ? &b : &a;
    const Value* times = is_int_value(a) ? &a : &b;
    if (is_int_value(*times) && (seq->is_string() || seq->is_array())) {
      int64_t n = std::max<int64_t>(0, as_int(*times->j));
      size_t unit = seq->is_string() ? seq->str().size() : seq->j->dump().size();
      if (unit && static_cast<uint64_t>(n) > kMaxRepeatBytes / unit) return err(pos, "repetition result too large");
      if (seq->is_string()) {
        std::string out;
        for (int64_t k = 0; k < n; ++k) out += seq->str();
        return Value::of(std::move(out));
      }
      json out = json::array();
      for (int64_t k = 0; k < n; ++k)
        for (const json& item : *seq->j) out.push_back(item);
      return Value::of(std::move(out));
    }
  }
  if (op == "%" && a.is_string()) return err(pos, "printf-style string formatting ('%') is not supported");
  return unsupported_op();
}

StatusOr<bool> Renderer::compare(const std::string& op, const Value& a, const Value& b, size_t pos) {
  if (op == "==") return values_eq(a, b);
  if (op == "!=") return !values_eq(a, b);
  if (op == "in" || op == "not in") {
    NUCLEUS_ASSIGN_OR_RETURN(bool in, contains(b, a, pos));
    return in == (op == "in");
  }
  std::optional<int> c;
  if (a.is_json() && b.is_json()) c = json_cmp(*a.j, *b.j);
  if (!c)
    return err(pos, "'" + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) +
                        "'");
  if (op == "<") return *c < 0;
  if (op == "<=") return *c <= 0;
  if (op == ">") return *c > 0;
  return *c >= 0;
}

StatusOr<bool> Renderer::contains(const Value& seq, const Value& item, size_t pos) {
  if (seq.is_undefined()) return false;
  if (seq.is_string()) {
    if (!item.is_string())
      return err(pos, std::string("'in <string>' requires string as left operand, not ") + type_name(item));
    return seq.str().find(item.str()) != std::string::npos;
  }
  if (seq.is_array()) {
    if (!item.is_json()) return false;
    for (const json& x : *seq.j)
      if (json_eq(x, *item.j)) return true;
    return false;
  }
  if (seq.is_object()) return item.is_string() && seq.j->contains(item.str());
  if (seq.kind == Value::Kind::kNamespace) return item.is_string() && seq.ns->attrs.count(item.str()) > 0;
  return err(pos, std::string("argument of type '") + type_name(seq) + "' is not iterable");
}

StatusOr<int64_t> Renderer::length(const Value& v, size_t pos) {
  if (v.is_undefined()) return 0;
  if (v.is_string()) return static_cast<int64_t>(utf8_count(v.str()));
  if (v.is_array() || v.is_object()) return static_cast<int64_t>(v.j->size());
  if (v.kind == Value::Kind::kNamespace) return static_cast<int64_t>(v.ns->attrs.size());
  return err(pos, std::string("object of type '") + type_name(v) + "' has no len()");
}

}  // namespace nucleus::jinja
