// The parser: recursive descent over the lexer's tokens into the syntax tree
// (ast.h), with Jinja2's statements and operator precedence.
#include "io/jinja/parser.h"

#include <algorithm>

#include "io/jinja/common.h"

namespace nucleus::jinja {

namespace {

// Recursive descent over the token stream with Jinja2's grammar:
//   expression := or ["if" or ["else" expression]]
//   or := and ("or" and)*        and := not ("and" not)*
//   not := "not" not | compare   compare := math1 (cmp_op math1)*
//   math1 := concat (("+"|"-") concat)*   concat := math2 ("~" math2)*
//   math2 := pow (("*"|"/"|"//"|"%") pow)*   pow := unary ("**" unary)*
//   unary := ("-"|"+") unary | primary postfix* (filter | test | call)*
class Parser {
 public:
  Parser(const std::string& src, std::vector<Token> tokens) : src_(src), toks_(std::move(tokens)) {}

  Status parse(Body* out) {
    std::string end;
    return parse_body(*out, {}, nullptr, &end);
  }

 private:
  const Token& cur() const { return toks_[i_]; }
  const Token& peek(size_t k = 1) const { return toks_[std::min(i_ + k, toks_.size() - 1)]; }
  bool is_op(std::string_view op) const { return cur().kind == Tok::kOp && cur().text == op; }
  bool is_name(std::string_view w) const { return cur().kind == Tok::kName && cur().text == w; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    ++i_;
    return true;
  }
  bool skip_name(std::string_view w) {
    if (!is_name(w)) return false;
    ++i_;
    return true;
  }

  Status error(const Token& t, const std::string& what) const { return error_at(src_, t.pos, what); }

  static std::string describe(const Token& t) {
    switch (t.kind) {
      case Tok::kText: return "template text";
      case Tok::kVarBegin: return "'{{'";
      case Tok::kVarEnd: return "'}}'";
      case Tok::kBlockBegin: return "'{%'";
      case Tok::kBlockEnd: return "'%}'";
      case Tok::kName: return "'" + t.text + "'";
      case Tok::kString: return "a string";
      case Tok::kInt:
      case Tok::kFloat: return "a number";
      case Tok::kOp: return "'" + t.text + "'";
      case Tok::kEof: return "end of template";
    }
    return "?";
  }

  Status expect_op(std::string_view op) {
    if (skip_op(op)) return ok_status();
    return error(cur(), "expected '" + std::string(op) + "', got " + describe(cur()));
  }

  Status expect_block_end() {
    if (cur().kind == Tok::kBlockEnd) {
      ++i_;
      return ok_status();
    }
    return error(cur(), "expected '%}', got " + describe(cur()));
  }

  StatusOr<std::string> expect_name(const char* what) {
    if (cur().kind != Tok::kName) return error(cur(), std::string("expected ") + what + ", got " + describe(cur()));
    return toks_[i_++].text;
  }

  // Template text and tags until a block tag named in `ends`, whose name is
  // consumed and returned in *end. `opener` is the tag being closed.
  Status parse_body(Body& out, std::vector<std::string_view> ends, const Token* opener, std::string* end) {
    NUCLEUS_RETURN_IF_ERROR(enter());
    const Nested nested{*this};
    while (true) {
      const Token& t = cur();
      if (t.kind == Tok::kText) {
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kText;
        node->pos = t.pos;
        node->text = t.text;
        out.push_back(std::move(node));
        ++i_;
      } else if (t.kind == Tok::kVarBegin) {
        ++i_;
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kOutput;
        node->pos = t.pos;
        NUCLEUS_ASSIGN_OR_RETURN(node->expr, parse_expression(true));
        if (cur().kind != Tok::kVarEnd) return error(cur(), "expected '}}', got " + describe(cur()));
        ++i_;
        out.push_back(std::move(node));
      } else if (t.kind == Tok::kBlockBegin) {
        const Token& word = peek();
        if (word.kind != Tok::kName) return error(word, "expected a tag name, got " + describe(word));
        if (std::find(ends.begin(), ends.end(), word.text) != ends.end()) {
          *end = word.text;
          i_ += 2;
          return ok_status();
        }
        bool closer = word.text.rfind("end", 0) == 0 || word.text == "else" || word.text == "elif";
        if (closer && opener)
          return error(word, "unexpected tag '" + word.text + "': the {% " + opener->text + " %} at " +
                                 line_column(src_, opener->pos) + " needs {% " + std::string(ends.back()) + " %}");
        i_ += 2;
        NUCLEUS_RETURN_IF_ERROR(parse_statement(word, out));
      } else if (t.kind == Tok::kEof) {
        if (ends.empty()) return ok_status();
        return error(t, "unexpected end of template: the {% " + opener->text + " %} at " +
                            line_column(src_, opener->pos) + " needs {% " + std::string(ends.back()) +
                            " %}");
      } else {
        return error(t, "unexpected " + describe(t));
      }
    }
  }

  Status parse_statement(const Token& word, Body& out) {
    const std::string& w = word.text;
    auto node = std::make_unique<Node>();
    node->pos = word.pos;
    std::string end;
    if (w == "if") {
      node->kind = Node::Kind::kIf;
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr cond, parse_expression(true));
      while (true) {
        NUCLEUS_RETURN_IF_ERROR(expect_block_end());
        Body body;
        NUCLEUS_RETURN_IF_ERROR(parse_body(body, {"elif", "else", "endif"}, &word, &end));
        node->branches.emplace_back(std::move(cond), std::move(body));
        if (end != "elif") break;
        NUCLEUS_ASSIGN_OR_RETURN(cond, parse_expression(true));
      }
      if (end == "else") {
        NUCLEUS_RETURN_IF_ERROR(expect_block_end());
        NUCLEUS_RETURN_IF_ERROR(parse_body(node->else_body, {"endif"}, &word, &end));
      }
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "for") {
      node->kind = Node::Kind::kFor;
      bool paren = skip_op("(");
      do {
        NUCLEUS_ASSIGN_OR_RETURN(std::string target, expect_name("a loop variable"));
        node->targets.push_back(std::move(target));
      } while (skip_op(","));
      if (paren) NUCLEUS_RETURN_IF_ERROR(expect_op(")"));
      if (!skip_name("in")) return error(cur(), "expected 'in', got " + describe(cur()));
      NUCLEUS_ASSIGN_OR_RETURN(node->expr, parse_expression(false));
      if (skip_name("if")) {
        NUCLEUS_ASSIGN_OR_RETURN(node->filter, parse_expression(true));
      }
      if (is_name("recursive")) return error(cur(), "recursive for loops are not supported");
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
      ++loop_depth_;
      Status s = parse_body(node->body, {"else", "endfor"}, &word, &end);
      --loop_depth_;
      NUCLEUS_RETURN_IF_ERROR(s);
      if (end == "else") {
        NUCLEUS_RETURN_IF_ERROR(expect_block_end());
        NUCLEUS_RETURN_IF_ERROR(parse_body(node->else_body, {"endfor"}, &word, &end));
      }
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "set") {
      NUCLEUS_ASSIGN_OR_RETURN(std::string name, expect_name("a variable name"));
      node->targets.push_back(std::move(name));
      if (skip_op(".")) {
        node->kind = Node::Kind::kSetAttr;
        NUCLEUS_ASSIGN_OR_RETURN(std::string attr, expect_name("an attribute name"));
        node->targets.push_back(std::move(attr));
      } else {
        node->kind = Node::Kind::kSet;
        while (skip_op(",")) {
          NUCLEUS_ASSIGN_OR_RETURN(std::string more, expect_name("a variable name"));
          node->targets.push_back(std::move(more));
        }
      }
      if (node->kind == Node::Kind::kSet && node->targets.size() == 1 && cur().kind == Tok::kBlockEnd) {
        node->kind = Node::Kind::kSetBlock;
        ++i_;
        NUCLEUS_RETURN_IF_ERROR(parse_body(node->body, {"endset"}, &word, &end));
      } else {
        NUCLEUS_RETURN_IF_ERROR(expect_op("="));
        NUCLEUS_ASSIGN_OR_RETURN(node->expr, parse_tuple_expression());
      }
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "macro") {
      node->kind = Node::Kind::kMacro;
      NUCLEUS_ASSIGN_OR_RETURN(node->text, expect_name("a macro name"));
      NUCLEUS_RETURN_IF_ERROR(expect_op("("));
      while (!is_op(")")) {
        NUCLEUS_ASSIGN_OR_RETURN(std::string param, expect_name("a parameter name"));
        node->targets.push_back(std::move(param));
        ExprPtr def;
        if (skip_op("=")) {
          NUCLEUS_ASSIGN_OR_RETURN(def, parse_expression(true));
        }
        node->defaults.push_back(std::move(def));
        if (!skip_op(",")) break;
      }
      NUCLEUS_RETURN_IF_ERROR(expect_op(")"));
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
      int saved = loop_depth_;
      loop_depth_ = 0;
      Status s = parse_body(node->body, {"endmacro"}, &word, &end);
      loop_depth_ = saved;
      NUCLEUS_RETURN_IF_ERROR(s);
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "break" || w == "continue") {
      if (loop_depth_ == 0) return error(word, "'" + w + "' outside of a for loop");
      node->kind = w == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
    } else if (w == "generation") {
      // transformers' {% generation %} marks assistant text for masks; it
      // renders as its body.
      NUCLEUS_RETURN_IF_ERROR(expect_block_end());
      NUCLEUS_RETURN_IF_ERROR(parse_body(out, {"endgeneration"}, &word, &end));
      return expect_block_end();
    } else if (w == "include" || w == "import" || w == "from" || w == "extends" || w == "block" || w == "call" ||
               w == "filter" || w == "with" || w == "autoescape" || w == "do") {
      return error(word, "the {% " + w + " %} tag is not supported");
    } else {
      return error(word, "unexpected tag '" + w + "'");
    }
    out.push_back(std::move(node));
    return ok_status();
  }

  static ExprPtr make(Expr::Kind kind, size_t pos) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    return e;
  }

  // An expression, or an implicit tuple "a, b" (right side of set).
  StatusOr<ExprPtr> parse_tuple_expression() {
    size_t pos = cur().pos;
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr first, parse_expression(true));
    if (!is_op(",")) return first;
    ExprPtr t = make(Expr::Kind::kTuple, pos);
    t->args.push_back(std::move(first));
    while (skip_op(",")) {
      if (cur().kind == Tok::kBlockEnd) break;
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr item, parse_expression(true));
      t->args.push_back(std::move(item));
    }
    return t;
  }

  StatusOr<ExprPtr> parse_expression(bool with_condition) {
    NUCLEUS_RETURN_IF_ERROR(enter());
    const Nested nested{*this};
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr e, parse_or());
    while (with_condition && is_name("if")) {
      size_t pos = cur().pos;
      ++i_;
      ExprPtr cond = make(Expr::Kind::kCond, pos);
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr test, parse_or());
      ExprPtr otherwise;
      if (skip_name("else")) {
        NUCLEUS_ASSIGN_OR_RETURN(otherwise, parse_expression(true));
      }
      cond->args.push_back(std::move(e));
      cond->args.push_back(std::move(test));
      cond->args.push_back(std::move(otherwise));
      e = std::move(cond);
    }
    return e;
  }

  // A left-associative keyword operator (`or`, `and`) at one precedence
  // level: next (word next)*, as `kind` nodes.
  template <typename Next>
  StatusOr<ExprPtr> parse_keyword_binary(std::string_view word, Expr::Kind kind, Next next) {
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr e, (this->*next)());
    while (is_name(word)) {
      ExprPtr b = make(kind, toks_[i_++].pos);
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr r, (this->*next)());
      b->args.push_back(std::move(e));
      b->args.push_back(std::move(r));
      e = std::move(b);
    }
    return e;
  }

  StatusOr<ExprPtr> parse_or() { return parse_keyword_binary("or", Expr::Kind::kOr, &Parser::parse_and); }
  StatusOr<ExprPtr> parse_and() { return parse_keyword_binary("and", Expr::Kind::kAnd, &Parser::parse_not); }

  StatusOr<ExprPtr> parse_not() {
    if (is_name("not")) {
      ExprPtr e = make(Expr::Kind::kNot, toks_[i_++].pos);
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr inner, parse_not());
      e->args.push_back(std::move(inner));
      return e;
    }
    return parse_compare();
  }

  StatusOr<ExprPtr> parse_compare() {
    size_t pos = cur().pos;
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr first, parse_math1());
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().kind == Tok::kOp &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op("<=") || is_op(">") || is_op(">="))) {
        op = toks_[i_++].text;
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && peek().kind == Tok::kName && peek().text == "in") {
        i_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Kind::kCompare, pos);
        cmp->args.push_back(std::move(first));
      }
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr r, parse_math1());
      cmp->ops.push_back(std::move(op));
      cmp->args.push_back(std::move(r));
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  // Left-associative binary operators at one precedence level.
  template <typename Next>
  StatusOr<ExprPtr> parse_binary(std::initializer_list<std::string_view> ops, Next next) {
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr e, (this->*next)());
    while (true) {
      std::string op;
      for (std::string_view o : ops)
        if (is_op(o)) op = o;
      if (op.empty()) return e;
      ExprPtr b = make(Expr::Kind::kBinary, toks_[i_++].pos);
      b->name = op;
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr r, (this->*next)());
      b->args.push_back(std::move(e));
      b->args.push_back(std::move(r));
      e = std::move(b);
    }
  }

  StatusOr<ExprPtr> parse_math1() { return parse_binary({"+", "-"}, &Parser::parse_concat); }

  StatusOr<ExprPtr> parse_concat() {
    size_t pos = cur().pos;
    NUCLEUS_ASSIGN_OR_RETURN(ExprPtr first, parse_math2());
    if (!is_op("~")) return first;
    ExprPtr c = make(Expr::Kind::kConcat, pos);
    c->args.push_back(std::move(first));
    while (skip_op("~")) {
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr r, parse_math2());
      c->args.push_back(std::move(r));
    }
    return c;
  }

  StatusOr<ExprPtr> parse_math2() { return parse_binary({"*", "/", "//", "%"}, &Parser::parse_pow); }
  StatusOr<ExprPtr> parse_pow() { return parse_binary({"**"}, &Parser::parse_unary_filtered); }
  StatusOr<ExprPtr> parse_unary_filtered() { return parse_unary(true); }

  StatusOr<ExprPtr> parse_unary(bool with_filter) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      e = make(is_op("-") ? Expr::Kind::kNeg : Expr::Kind::kPos, cur().pos);
      ++i_;
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr inner, parse_unary(false));
      e->args.push_back(std::move(inner));
    } else {
      NUCLEUS_ASSIGN_OR_RETURN(e, parse_primary());
    }
    NUCLEUS_ASSIGN_OR_RETURN(e, parse_postfix(std::move(e)));
    if (with_filter) {
      NUCLEUS_ASSIGN_OR_RETURN(e, parse_filters(std::move(e)));
    }
    return e;
  }

  StatusOr<ExprPtr> parse_primary() {
    const Token& t = cur();
    if (t.kind == Tok::kName) {
      ++i_;
      ExprPtr e = make(Expr::Kind::kLiteral, t.pos);
      if (t.text == "true" || t.text == "True") {
        e->literal = true;
      } else if (t.text == "false" || t.text == "False") {
        e->literal = false;
      } else if (t.text == "none" || t.text == "None") {
        e->literal = nullptr;
      } else {
        e->kind = Expr::Kind::kName;
        e->name = t.text;
      }
      return e;
    }
    if (t.kind == Tok::kString) {
      ExprPtr e = make(Expr::Kind::kLiteral, t.pos);
      std::string s;
      while (cur().kind == Tok::kString) s += toks_[i_++].text;  // adjacent literals join
      e->literal = std::move(s);
      return e;
    }
    if (t.kind == Tok::kInt || t.kind == Tok::kFloat) {
      ++i_;
      ExprPtr e = make(Expr::Kind::kLiteral, t.pos);
      if (t.kind == Tok::kInt) {
        e->literal = t.int_value;
      } else {
        e->literal = t.float_value;
      }
      return e;
    }
    if (skip_op("(")) {
      if (skip_op(")")) return make(Expr::Kind::kTuple, t.pos);
      NUCLEUS_ASSIGN_OR_RETURN(ExprPtr e, parse_expression(true));
      if (is_op(",")) {
        ExprPtr tuple = make(Expr::Kind::kTuple, t.pos);
        tuple->args.push_back(std::move(e));
        while (skip_op(",") && !is_op(")")) {
          NUCLEUS_ASSIGN_OR_RETURN(ExprPtr item, parse_expression(true));
          tuple->args.push_back(std::move(item));
        }
        e = std::move(tuple);
      }
      NUCLEUS_RETURN_IF_ERROR(expect_op(")"));
      return e;
    }
    if (skip_op("[")) {
      ExprPtr e = make(Expr::Kind::kList, t.pos);
      while (!is_op("]")) {
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr item, parse_expression(true));
        e->args.push_back(std::move(item));
        if (!skip_op(",")) break;
      }
      NUCLEUS_RETURN_IF_ERROR(expect_op("]"));
      return e;
    }
    if (skip_op("{")) {
      ExprPtr e = make(Expr::Kind::kDict, t.pos);
      while (!is_op("}")) {
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr key, parse_expression(true));
        NUCLEUS_RETURN_IF_ERROR(expect_op(":"));
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr value, parse_expression(true));
        e->args.push_back(std::move(key));
        e->args.push_back(std::move(value));
        if (!skip_op(",")) break;
      }
      NUCLEUS_RETURN_IF_ERROR(expect_op("}"));
      return e;
    }
    return error(t, "expected an expression, got " + describe(t));
  }

  // .name, .0, [index], [a:b:c], (args)
  StatusOr<ExprPtr> parse_postfix(ExprPtr e) {
    while (true) {
      size_t pos = cur().pos;
      if (skip_op(".")) {
        if (cur().kind == Tok::kInt) {
          ExprPtr item = make(Expr::Kind::kGetItem, pos);
          ExprPtr index = make(Expr::Kind::kLiteral, cur().pos);
          index->literal = toks_[i_++].int_value;
          item->args.push_back(std::move(e));
          item->args.push_back(std::move(index));
          e = std::move(item);
          continue;
        }
        ExprPtr attr = make(Expr::Kind::kGetAttr, pos);
        NUCLEUS_ASSIGN_OR_RETURN(attr->name, expect_name("an attribute name"));
        attr->args.push_back(std::move(e));
        e = std::move(attr);
      } else if (is_op("[")) {
        NUCLEUS_ASSIGN_OR_RETURN(e, parse_subscript(std::move(e)));
      } else if (is_op("(")) {
        NUCLEUS_ASSIGN_OR_RETURN(e, parse_call(std::move(e)));
      } else {
        return e;
      }
    }
  }

  StatusOr<ExprPtr> parse_subscript(ExprPtr target) {
    size_t pos = cur().pos;
    NUCLEUS_RETURN_IF_ERROR(expect_op("["));
    ExprPtr parts[3];
    bool slice = false;
    if (!is_op(":")) {
      NUCLEUS_ASSIGN_OR_RETURN(parts[0], parse_expression(true));
    }
    if (skip_op(":")) {
      slice = true;
      if (!is_op("]") && !is_op(":")) {
        NUCLEUS_ASSIGN_OR_RETURN(parts[1], parse_expression(true));
      }
      if (skip_op(":") && !is_op("]")) {
        NUCLEUS_ASSIGN_OR_RETURN(parts[2], parse_expression(true));
      }
    }
    NUCLEUS_RETURN_IF_ERROR(expect_op("]"));
    ExprPtr e = make(slice ? Expr::Kind::kSlice : Expr::Kind::kGetItem, pos);
    e->args.push_back(std::move(target));
    e->args.push_back(std::move(parts[0]));
    if (slice) {
      e->args.push_back(std::move(parts[1]));
      e->args.push_back(std::move(parts[2]));
    }
    return e;
  }

  // "(" [arg ("," arg)*] ")" into e->args (after what is already there) and
  // e->kwargs; arg := name "=" expression | expression.
  Status parse_args(Expr& e) {
    NUCLEUS_RETURN_IF_ERROR(expect_op("("));
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) return error(cur(), "*args and **kwargs in calls are not supported");
      if (cur().kind == Tok::kName && peek().kind == Tok::kOp && peek().text == "=") {
        std::string key = toks_[i_].text;
        i_ += 2;
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr value, parse_expression(true));
        e.kwargs.emplace_back(std::move(key), std::move(value));
      } else {
        if (!e.kwargs.empty()) return error(cur(), "positional argument follows keyword argument");
        NUCLEUS_ASSIGN_OR_RETURN(ExprPtr value, parse_expression(true));
        e.args.push_back(std::move(value));
      }
      if (!skip_op(",")) break;
    }
    return expect_op(")");
  }

  StatusOr<ExprPtr> parse_call(ExprPtr callee) {
    ExprPtr e = make(Expr::Kind::kCall, cur().pos);
    e->args.push_back(std::move(callee));
    NUCLEUS_RETURN_IF_ERROR(parse_args(*e));
    return e;
  }

  // Filters, tests and calls after a unary expression: x | f(a) is not none.
  StatusOr<ExprPtr> parse_filters(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        ++i_;
        ExprPtr f = make(Expr::Kind::kFilter, cur().pos);
        NUCLEUS_ASSIGN_OR_RETURN(f->name, expect_name("a filter name"));
        if (!known_filters().count(f->name)) return error_at(src_, f->pos, "no filter named '" + f->name + "'");
        f->args.push_back(std::move(e));
        if (is_op("(")) NUCLEUS_RETURN_IF_ERROR(parse_args(*f));
        e = std::move(f);
      } else if (is_name("is")) {
        ++i_;
        ExprPtr t = make(Expr::Kind::kTest, cur().pos);
        t->negated = skip_name("not");
        if (cur().kind == Tok::kName) {
          t->name = toks_[i_++].text;
        } else {
          return error(cur(), "expected a test name, got " + describe(cur()));
        }
        if (!known_tests().count(t->name)) return error_at(src_, t->pos, "no test named '" + t->name + "'");
        t->args.push_back(std::move(e));
        const Token& c = cur();
        bool arg_start = c.kind == Tok::kName || c.kind == Tok::kString || c.kind == Tok::kInt ||
                         c.kind == Tok::kFloat || (c.kind == Tok::kOp && (c.text == "[" || c.text == "{"));
        if (is_op("(")) {
          NUCLEUS_RETURN_IF_ERROR(parse_args(*t));
        } else if (arg_start && !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") &&
                   !is_name("is")) {
          // One argument without parentheses: "x is divisibleby 3".
          NUCLEUS_ASSIGN_OR_RETURN(ExprPtr arg, parse_primary());
          NUCLEUS_ASSIGN_OR_RETURN(arg, parse_postfix(std::move(arg)));
          t->args.push_back(std::move(arg));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        NUCLEUS_ASSIGN_OR_RETURN(e, parse_call(std::move(e)));
      } else {
        return e;
      }
    }
  }

  const std::string& src_;
  std::vector<Token> toks_;
  size_t i_ = 0;
  int loop_depth_ = 0;  // enclosing for loops, for break / continue
  // Blocks and expressions open around the parse position. Bounded, so that a
  // pathological template is a parse error instead of a stack overflow here or
  // in the renderer, which recurses over the same tree.
  static constexpr int kMaxNesting = 256;
  int nesting_ = 0;
  Status enter() {
    if (nesting_ >= kMaxNesting)
      return error(cur(), "blocks and expressions nest deeper than " + std::to_string(kMaxNesting));
    ++nesting_;
    return ok_status();
  }
  struct Nested {  // leaves what enter() entered
    Parser& p;
    ~Nested() { --p.nesting_; }
  };
};

}  // namespace

Status parse(const std::string& src, std::vector<Token> tokens, Body* out) {
  return Parser(src, std::move(tokens)).parse(out);
}

}  // namespace nucleus::jinja
