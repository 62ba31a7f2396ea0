// The syntax tree the parser builds and the renderer walks: expressions,
// statements, and the parsed template. Internal to the chat-template
// interpreter.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "io/jinja/common.h"

namespace nucleus::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // args: items
    kTuple,     // args: items (a list at run time)
    kDict,      // args: key, value, key, value, ...
    kGetAttr,   // args[0].name
    kGetItem,   // args[0][args[1]]
    kSlice,     // args[0][args[1]:args[2]:args[3]], missing parts null
    kCall,      // args[0](args[1..], kwargs)
    kFilter,    // args[0] | name(args[1..], kwargs)
    kTest,      // args[0] is [not] name(args[1..])
    kNeg,       // -args[0]
    kPos,       // +args[0]
    kNot,       // not args[0]
    kBinary,    // args[0] <name> args[1], name one of + - * / // % **
    kAnd,       // args[0] and args[1]
    kOr,        // args[0] or args[1]
    kCompare,   // args[0] ops[0] args[1] ops[1] args[2] ... (chained as in Python)
    kConcat,    // args[0] ~ args[1] ~ ...
    kCond,      // args[0] if args[1] else args[2] (args[2] may be null)
  };
  Kind kind = Kind::kLiteral;
  size_t pos = 0;
  std::string name;
  json literal;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  bool negated = false;
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // branches, else_body
    kFor,       // for targets in expr [if filter]: body [else else_body]
    kSet,       // set targets = expr
    kSetAttr,   // set targets[0].targets[1] = expr
    kSetBlock,  // set targets[0] %} body {% endset
    kMacro,     // macro text(targets = defaults): body
    kBreak,
    kContinue,
  };
  Kind kind = Kind::kText;
  size_t pos = 0;
  std::string text;
  std::vector<std::string> targets;
  ExprPtr expr, filter;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body, else_body;
  std::vector<ExprPtr> defaults;
};

// The names of the filters and tests the renderer has (filters.cpp), which
// the parser checks so that a template with an unknown one fails to parse.
const std::set<std::string, std::less<>>& known_filters();
const std::set<std::string, std::less<>>& known_tests();

}  // namespace nucleus::jinja

namespace nucleus::detail {
// The parsed template (io/chat_template.h holds a pointer to it).
struct TemplateProgram {
  std::string source;  // normalized: "\n" line ends, one trailing newline dropped
  jinja::Body body;
};
}  // namespace nucleus::detail
