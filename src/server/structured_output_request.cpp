#include "server/structured_output_request.h"

#include <optional>
#include <vector>

namespace nucleus::server {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {

struct Refusal {
  ApiError error;
};

[[noreturn]] void refuse(const std::string& param, const std::string& message) {
  ApiError e;
  e.param = param;
  e.message = message;
  throw Refusal{e};
}

// The field, or null when absent or JSON null.
const json* field(const json& object, const char* name) {
  auto it = object.find(name);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

// One constraint and the body field it came from (named in errors).
struct Constraint {
  StructuredOutputSpec spec;
  std::string param;  // the request field the error names
  std::string what;   // the constraint itself (structured_outputs.regex), for messages
};

class Parser {
 public:
  Parser(const json& body, const std::string& text, const RequestLimits& limits)
      : body_(body), text_(text), limits_(limits) {}

  std::vector<Constraint> parse() {
    response_format();
    structured_outputs();
    guided();
    return std::move(found_);
  }

 private:
  // The value at `path` as the client wrote it (keys in their order), as JSON text.
  std::string as_sent(std::initializer_list<const char*> path) {
    if (!ordered_) ordered_ = ordered_json::parse(text_, nullptr, /*allow_exceptions=*/false);
    const ordered_json* v = &*ordered_;
    for (const char* key : path) v = &v->at(key);
    return v->dump();
  }

  // A JSON schema given as an object (or, as vLLM allows, as a JSON string).
  std::string schema(const json& v, std::initializer_list<const char*> path, const std::string& param) {
    if (v.is_object()) return as_sent(path);
    if (v.is_string()) return v.get<std::string>();
    refuse(param, "'" + param + "' must be a JSON schema (an object), got " + v.dump());
  }

  std::string string_of(const json& v, const std::string& param) {
    if (!v.is_string()) refuse(param, "'" + param + "' must be a string, got " + v.dump());
    return v.get<std::string>();
  }

  std::vector<std::string> choices(const json& v, const std::string& param) {
    std::vector<std::string> out;
    if (!v.is_array() || v.empty()) refuse(param, "'" + param + "' must be a non-empty list of strings");
    if (static_cast<int64_t>(v.size()) > limits_.max_guided_choices)
      refuse(param, "'" + param + "' holds " + std::to_string(v.size()) + " strings; at most " +
                        std::to_string(limits_.max_guided_choices) + " are allowed (--max-guided-choices)");
    for (const auto& c : v) out.push_back(string_of(c, param));
    return out;
  }

  void add(StructuredOutputSpec::Kind kind, std::string text, const std::string& param, const std::string& what = "") {
    Constraint c;
    c.spec.kind = kind;
    c.spec.text = std::move(text);
    c.param = param;
    c.what = what.empty() ? param : what;
    found_.push_back(std::move(c));
  }

  void response_format() {
    const json* rf = field(body_, "response_format");
    if (!rf) return;
    const std::string p = "response_format";
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
      refuse(p, "'response_format' must be an object with a string 'type'");
    const std::string type = (*rf)["type"].get<std::string>();
    if (type == "text") return;
    if (type == "json_object") return add(StructuredOutputSpec::Kind::kJsonObject, "", p);
    if (type != "json_schema")
      refuse(p, "'response_format' type must be 'text', 'json_object' or 'json_schema', got '" + type + "'");
    const json* js = field(*rf, "json_schema");
    if (!js || !js->is_object())
      refuse(p, "'response_format' of type 'json_schema' needs a 'json_schema' object with the 'schema'");
    if (const json* n = field(*js, "name"); n && !n->is_string())
      refuse(p, "'response_format.json_schema.name' must be a string");
    if (const json* s = field(*js, "strict"); s && !s->is_boolean())
      refuse(p, "'response_format.json_schema.strict' must be a boolean");
    const json* s = field(*js, "schema");
    if (!s || !s->is_object()) refuse(p, "'response_format.json_schema.schema' (a JSON schema object) is required");
    add(StructuredOutputSpec::Kind::kJsonSchema, as_sent({"response_format", "json_schema", "schema"}), p);
  }

  void structured_outputs() {
    const json* so = field(body_, "structured_outputs");
    if (!so) return;
    const std::string p = "structured_outputs";
    if (!so->is_object()) refuse(p, "'structured_outputs' must be an object");
    const size_t before = found_.size();
    bool any_whitespace = true;
    for (const auto& [key, v] : so->items()) {
      if (v.is_null()) continue;
      const std::string where = "structured_outputs." + key;
      if (key == "json") {
        add(StructuredOutputSpec::Kind::kJsonSchema, schema(v, {"structured_outputs", "json"}, where), p, where);
      } else if (key == "regex") {
        add(StructuredOutputSpec::Kind::kRegex, string_of(v, where), p, where);
      } else if (key == "choice") {
        add(StructuredOutputSpec::Kind::kChoice, "", p, where);
        found_.back().spec.choices = choices(v, where);
      } else if (key == "grammar") {
        add(StructuredOutputSpec::Kind::kGrammar, string_of(v, where), p, where);
      } else if (key == "json_object" || key == "disable_any_whitespace" || key == "disable_fallback" ||
                 key == "disable_additional_properties") {
        if (!v.is_boolean()) refuse(p, "'" + where + "' must be a boolean");
        if (key == "json_object" && v.get<bool>()) add(StructuredOutputSpec::Kind::kJsonObject, "", p, where);
        if (key == "disable_any_whitespace") any_whitespace = !v.get<bool>();
        // disable_fallback: there is one backend. disable_additional_properties:
        // xgrammar's strict mode already forbids properties a schema does not name.
      } else {
        refuse(p, "'" + where + "' is not supported (supported: json, regex, choice, grammar, json_object, "
                  "disable_any_whitespace, disable_fallback, disable_additional_properties)");
      }
    }
    for (size_t i = before; i < found_.size(); ++i) found_[i].spec.any_whitespace = any_whitespace;
  }

  // vLLM's older per-field parameters.
  void guided() {
    if (const json* v = field(body_, "guided_json"))
      add(StructuredOutputSpec::Kind::kJsonSchema, schema(*v, {"guided_json"}, "guided_json"), "guided_json");
    if (const json* v = field(body_, "guided_regex"))
      add(StructuredOutputSpec::Kind::kRegex, string_of(*v, "guided_regex"), "guided_regex");
    if (const json* v = field(body_, "guided_choice")) {
      add(StructuredOutputSpec::Kind::kChoice, "", "guided_choice");
      found_.back().spec.choices = choices(*v, "guided_choice");
    }
    if (const json* v = field(body_, "guided_grammar"))
      add(StructuredOutputSpec::Kind::kGrammar, string_of(*v, "guided_grammar"), "guided_grammar");
    if (field(body_, "guided_whitespace_pattern"))
      refuse("guided_whitespace_pattern", "'guided_whitespace_pattern' is not supported");
    if (const json* v = field(body_, "guided_decoding_backend")) {
      const std::string b = string_of(*v, "guided_decoding_backend");
      if (b != "xgrammar" && b != "auto")
        refuse("guided_decoding_backend", "'guided_decoding_backend' may only be 'xgrammar' or 'auto', got '" + b + "'");
    }
  }

  const json& body_;
  const std::string& text_;
  const RequestLimits& limits_;
  std::optional<ordered_json> ordered_;
  std::vector<Constraint> found_;
};

}  // namespace

std::variant<std::shared_ptr<const CompiledGrammar>, ApiError> parse_structured_output(const json& body,
                                                                                       const std::string& text,
                                                                                       const ModelInfo& model) {
  try {
    std::vector<Constraint> found = Parser(body, text, model.limits).parse();
    if (found.empty()) return std::shared_ptr<const CompiledGrammar>();
    if (found.size() > 1)
      refuse(found[1].param, "Only one structured-output constraint may be given; this request has '" +
                                 found[0].what + "' and '" + found[1].what + "'");
    const Constraint& c = found[0];
    // The engine refuses the pair too; here the refusal names the field.
    if (model.speculative)
      refuse(c.param, "'" + c.what + "' (structured output) with speculative decoding (--speculative-config) is "
                      "not supported yet");
    if (!model.grammar_compiler)
      refuse(c.param, "'" + c.param + "' needs structured output, which this server does not have (it runs with "
                      "--skip-tokenizer-init, or was built with -DNUCLEUS_XGRAMMAR=OFF)");
    auto grammar = model.grammar_compiler->compile(c.spec);
    if (!grammar.ok()) refuse(c.param, "'" + c.param + "' cannot be compiled: " + grammar.status().message());
    return std::move(grammar).value();
  } catch (const Refusal& r) {
    return r.error;
  }
}

}  // namespace nucleus::server
