#include "server/protocol.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "io/utf8.h"
#include "server/structured_output_request.h"

namespace nucleus::server {

using nlohmann::json;

json ApiError::body() const {
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return json{{"error", e}};
}

namespace {

// Thrown inside this file only, caught at the parse_* boundary.
struct Refusal {
  ApiError error;
};

[[noreturn]] void refuse(const std::string& param, const std::string& message) {
  ApiError e;
  e.param = param;
  e.message = message;
  throw Refusal{e};
}

// The field, or null when it is absent or JSON null (OpenAI treats both as
// "not given").
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

bool get_bool(const json& body, const char* name, bool fallback) {
  const json* f = field(body, name);
  if (!f) return fallback;
  if (!f->is_boolean()) refuse(name, std::string("'") + name + "' must be a boolean, got " + f->dump());
  return f->get<bool>();
}

std::optional<double> get_number(const json& body, const char* name) {
  const json* f = field(body, name);
  if (!f) return std::nullopt;
  if (!f->is_number()) refuse(name, std::string("'") + name + "' must be a number, got " + f->dump());
  return f->get<double>();
}

std::optional<int64_t> get_int(const json& body, const char* name) {
  const json* f = field(body, name);
  if (!f) return std::nullopt;
  if (!f->is_number_integer() || (f->is_number_unsigned() && f->get<uint64_t>() > INT64_MAX))
    refuse(name, std::string("'") + name + "' must be an integer, got " + f->dump());
  return f->get<int64_t>();
}

// An integer in [lo, hi], or `fallback` when absent.
int64_t get_int_in(const json& body, const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  auto v = get_int(body, name);
  if (!v) return fallback;
  if (*v < lo || *v > hi)
    refuse(name, std::string("'") + name + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                     "], got " + std::to_string(*v));
  return *v;
}

// A number in [lo, hi] as a float, or `fallback` when absent.
float get_float_in(const json& body, const char* name, double lo, double hi, float fallback) {
  auto v = get_number(body, name);
  if (!v) return fallback;
  if (!(*v >= lo && *v <= hi)) refuse(name, fmt::format("'{}' must be in [{}, {}], got {}", name, lo, hi, *v));
  return static_cast<float>(*v);
}

std::vector<std::string> get_stop(const json& body, const RequestLimits& limits) {
  const json* f = field(body, "stop");
  std::vector<std::string> out;
  if (!f) return out;
  if (f->is_string()) {
    out.push_back(f->get<std::string>());
  } else if (f->is_array()) {
    for (const auto& s : *f) {
      if (!s.is_string()) refuse("stop", "'stop' must be a string or a list of strings, got " + f->dump());
      out.push_back(s.get<std::string>());
    }
  } else {
    refuse("stop", "'stop' must be a string or a list of strings, got " + f->dump());
  }
  if (static_cast<int64_t>(out.size()) > limits.max_stop_strings)
    refuse("stop", "'stop' holds " + std::to_string(out.size()) + " strings; at most " +
                       std::to_string(limits.max_stop_strings) + " are allowed (--max-stop-strings)");
  int64_t bytes = 0;
  for (const auto& s : out) {
    if (s.empty()) refuse("stop", "'stop' strings must not be empty");
    bytes += static_cast<int64_t>(s.size());
  }
  if (bytes > limits.max_stop_bytes)
    refuse("stop", "'stop' strings hold " + std::to_string(bytes) + " bytes together; at most " +
                       std::to_string(limits.max_stop_bytes) + " are allowed (--max-stop-bytes)");
  return out;
}

// 'logit_bias': {"<token id>": bias}. Biases are clamped to [-100, 100] as
// vLLM does (OpenAI's documented range); ids must be model rows, as vLLM
// checks them against the model's vocabulary size.
std::vector<std::pair<int32_t, float>> get_logit_bias(const json& body, int64_t vocab_size) {
  const json* f = field(body, "logit_bias");
  std::vector<std::pair<int32_t, float>> out;
  std::unordered_set<int64_t> seen;  // "7" and "007" are one id
  if (!f) return out;
  if (!f->is_object()) refuse("logit_bias", "'logit_bias' must be an object mapping token ids to biases");
  for (const auto& [key, value] : f->items()) {
    int64_t id = -1;
    const char* begin = key.data();
    const char* end = key.data() + key.size();
    const auto [ptr, ec] = std::from_chars(begin, end, id);
    if (key.empty() || ec != std::errc() || ptr != end)
      refuse("logit_bias", "'logit_bias' key '" + key + "' is not a token id (an integer)");
    if (id < 0 || id >= vocab_size)
      refuse("logit_bias", "'logit_bias' token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                               std::to_string(vocab_size) + ")");
    if (!value.is_number())
      refuse("logit_bias", "'logit_bias' for token id " + key + " must be a number, got " + value.dump());
    if (!seen.insert(id).second) refuse("logit_bias", "'logit_bias' names token id " + std::to_string(id) + " twice");
    const double bias = std::clamp(value.get<double>(), -100.0, 100.0);
    out.emplace_back(static_cast<int32_t>(id), static_cast<float>(bias));
  }
  return out;
}

// 'min_tokens' may not exceed max_tokens (vLLM's check, once max_tokens is known).
void check_min_tokens(const GenerationRequest& r) {
  if (r.params.min_tokens > r.params.max_tokens)
    refuse("min_tokens", "'min_tokens' (" + std::to_string(r.params.min_tokens) + ") must be <= max_tokens (" +
                             std::to_string(r.params.max_tokens) + ")");
  // vLLM looks for stop strings only once min_tokens tokens exist; this
  // server's detokenizer looks from the first token: refused rather than
  // stopping early.
  if (r.params.min_tokens > 0 && !r.params.stop.empty())
    refuse("min_tokens", "'min_tokens' together with 'stop' strings is not supported (stop strings would be matched "
                         "before min_tokens tokens)");
}

// 'model', when given, must be a served name (else 404 model_not_found).
void check_model(const json& body, const ModelInfo& model) {
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) refuse("model", "'model' must be a string, got " + m->dump());
    const std::string name = m->get<std::string>();
    bool known = false;
    for (const auto& n : model.names) known = known || n == name;
    if (!known) {
      ApiError e;
      e.http_status = 404;
      e.param = "model";
      e.code = "model_not_found";
      e.message = "The model '" + name + "' does not exist; this server serves '" + model.names[0] + "'";
      throw Refusal{e};
    }
  }
}

// Fields common to both endpoints: sampling, n, streaming, extensions.
void parse_common(const json& body, const ModelInfo& model, GenerationRequest& r) {
  check_model(body, model);
  SamplingParams& p = r.params;
  if (auto t = get_number(body, "temperature")) {
    if (!(*t >= 0.0) || !(*t <= kMaxTemperature))
      refuse("temperature", fmt::format("'temperature' must be in [0, {}], got {}", kMaxTemperature, *t));
    p.temperature = static_cast<float>(*t);
  }
  if (auto t = get_number(body, "top_p")) {
    // Checked as the float the sampler uses: 1e-300 is > 0 but not as a float.
    if (!(static_cast<float>(*t) > 0.0f && *t <= 1.0))
      refuse("top_p", "'top_p' must be in (0, 1] (as a 32-bit float), got " + fmt::format("{}", *t));
    p.top_p = static_cast<float>(*t);
  }
  p.top_k = static_cast<int32_t>(get_int_in(body, "top_k", -1, std::numeric_limits<int32_t>::max(), 0));
  if (p.top_k < 0) p.top_k = 0;  // vLLM's -1: all tokens
  // An int64, as vLLM takes it; seeds past INT64_MAX were taken as uint64 and
  // aliased the negative ones (18446744073709551615 sampled as -1 does).
  if (const auto seed = get_int(body, "seed")) p.seed = static_cast<uint64_t>(*seed);
  p.stop = get_stop(body, model.limits);
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) refuse("stop_token_ids", "'stop_token_ids' must be a list of token ids");
    if (static_cast<int64_t>(ids->size()) > model.limits.max_stop_token_ids)
      refuse("stop_token_ids", "'stop_token_ids' holds " + std::to_string(ids->size()) + " ids; at most " +
                                   std::to_string(model.limits.max_stop_token_ids) +
                                   " are allowed (--max-stop-token-ids)");
    for (const auto& t : *ids) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= model.vocab_size)
        refuse("stop_token_ids", "'stop_token_ids' holds " + t.dump() + ", not a token id in [0, " +
                                     std::to_string(model.vocab_size) + ")");
      p.stop_token_ids.push_back(t.get<int32_t>());
    }
  }
  p.ignore_eos = get_bool(body, "ignore_eos", false);
  r.n = static_cast<int>(get_int_in(body, "n", 1, model.limits.max_choices, 1));
  r.stream = get_bool(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) refuse("stream_options", "'stream_options' must be an object");
    if (!r.stream) refuse("stream_options", "'stream_options' is only allowed when 'stream' is true");
    r.include_usage = get_bool(*so, "include_usage", false);
  }
  r.skip_special_tokens = get_bool(body, "skip_special_tokens", true);
  r.include_stop_str_in_output = get_bool(body, "include_stop_str_in_output", false);
  // vLLM's logit processors (runtime/sampling_params.h; ranges as vLLM's).
  p.presence_penalty = get_float_in(body, "presence_penalty", -2.0, 2.0, 0.0f);
  p.frequency_penalty = get_float_in(body, "frequency_penalty", -2.0, 2.0, 0.0f);
  if (auto v = get_number(body, "repetition_penalty")) {
    if (!(*v >= 1e-4 && *v <= 1e4))  // past that a penalised f32 logit overflows (SamplingParams::validate)
      refuse("repetition_penalty", fmt::format("'repetition_penalty' must be in [1e-4, 1e4], got {}", *v));
    p.repetition_penalty = static_cast<float>(*v);
  }
  p.min_p = get_float_in(body, "min_p", 0.0, 1.0, 0.0f);
  p.min_tokens = static_cast<int32_t>(get_int_in(body, "min_tokens", 0, INT32_MAX, 0));
  p.logit_bias = get_logit_bias(body, model.vocab_size);
  if (const json* u = field(body, "user"); u && !u->is_string()) refuse("user", "'user' must be a string");
  // vLLM's extra sampling fields this server does not serve: refused by name
  // (never silently ignored) unless they hold their no-op default.
  for (const char* name : {"allowed_token_ids", "bad_words", "truncate_prompt_tokens"})
    if (const json* f = field(body, name); f && !f->is_null() && !(f->is_array() && f->empty()))
      refuse(name, std::string("'") + name + "' is not supported");
  for (const char* name : {"use_beam_search", "return_tokens_as_token_ids"})
    if (get_bool(body, name, false)) refuse(name, std::string("'") + name + "' is not supported");
  if (const json* so = field(body, "stream_options"); so && so->is_object())
    if (const auto it = so->find("continuous_usage_stats"); it != so->end() && it->is_boolean() && it->get<bool>())
      refuse("stream_options", "'stream_options.continuous_usage_stats' is not supported (only 'include_usage')");
}

// response_format / structured_outputs / guided_*: compiled last, once the
// cheaper checks passed (server/structured_output_request.h).
std::shared_ptr<const CompiledGrammar> structured_output(const json& body, const std::string& text,
                                                         const ModelInfo& model, const SamplingParams& p) {
  auto grammar = parse_structured_output(body, text, model);
  if (const ApiError* e = std::get_if<ApiError>(&grammar)) throw Refusal{*e};
  auto g = std::get<std::shared_ptr<const CompiledGrammar>>(std::move(grammar));
  // A grammar allows only EOS once the output is complete, and min_tokens
  // masks EOS: a short complete output would leave no token to sample.
  if (g && p.min_tokens > 0)
    refuse("min_tokens", "'min_tokens' cannot be combined with structured output (response_format, "
                         "structured_outputs, guided_*): the grammar may end the output before it");
  return g;
}

void check_token_ids(const std::vector<int32_t>& ids, int64_t vocab_size, const std::string& where) {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab_size)
      refuse("prompt", where + " token id " + std::to_string(ids[i]) + " at index " + std::to_string(i) +
                           " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
}

// Prompt ids must have a row in the embedding (vocab_size) and, with a
// tokenizer, a token: published configs pad vocab_size past the tokenizer
// (DeepSeek-V3: 129,280 rows, 128,815 tokens), and ids in that gap are
// refused as out of vocabulary, as vLLM does.
int64_t prompt_vocab_size(const ModelInfo& model) {
  return model.tokenizer ? std::min(model.vocab_size, model.tokenizer->vocab_size()) : model.vocab_size;
}

std::vector<int32_t> token_list(const json& a, int64_t vocab_size, const std::string& where) {
  std::vector<int32_t> ids;
  ids.reserve(a.size());
  for (const auto& t : a) {
    if (!t.is_number_integer() || (t.is_number_unsigned() && t.get<uint64_t>() > INT32_MAX) ||
        t.get<int64_t>() < INT32_MIN || t.get<int64_t>() > INT32_MAX)
      refuse("prompt", where + " holds " + t.dump() + ", not a token id");
    ids.push_back(t.get<int32_t>());
  }
  if (ids.empty()) refuse("prompt", where + " is empty");
  check_token_ids(ids, vocab_size, where);
  return ids;
}

// A text so long that it cannot fit the context whatever it encodes to is
// refused before it is encoded (encoding megabytes costs seconds and
// gigabytes): every token stands for at most max_token_bytes() bytes, and 4x
// leaves room for a normalizer that shortens the text.
void refuse_text_past_context(const std::string& text, const ModelInfo& model, const char* param) {
  const int64_t most = 4 * model.max_model_len * model.tokenizer->max_token_bytes();
  if (static_cast<int64_t>(text.size()) > most)
    refuse(param, "This model's maximum context length is " + std::to_string(model.max_model_len) +
                      " tokens, and the prompt's " + std::to_string(text.size()) +
                      " bytes encode to more than that. Please shorten the prompt.");
}

std::vector<Prompt> parse_prompts(const json& body, const ModelInfo& model, bool skip_special) {
  const json* f = field(body, "prompt");
  const char* kShapes = "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists";
  if (!f) refuse("prompt", "'prompt' is required");
  std::vector<Prompt> out;
  auto from_text = [&](const std::string& text) {
    if (text.empty()) refuse("prompt", "'prompt' is empty");
    if (!model.tokenizer)
      refuse("prompt", "text prompts need a tokenizer and this server runs with --skip-tokenizer-init; send token ids");
    refuse_text_past_context(text, model, "prompt");
    out.push_back({model.tokenizer->encode(text, /*add_special_tokens=*/true), text});
  };
  auto from_ids = [&](std::vector<int32_t> ids) {
    std::string text = model.tokenizer ? model.tokenizer->decode(ids, skip_special) : std::string();
    out.push_back({std::move(ids), std::move(text)});
  };
  if (f->is_string()) {
    from_text(f->get<std::string>());
  } else if (f->is_array()) {
    if (f->empty()) refuse("prompt", "'prompt' is empty");
    const json& first = (*f)[0];
    if (first.is_number_integer()) {
      from_ids(token_list(*f, prompt_vocab_size(model), "'prompt'"));
    } else {
      for (size_t i = 0; i < f->size(); ++i) {
        const json& e = (*f)[i];
        const std::string where = "'prompt[" + std::to_string(i) + "]'";
        if (first.is_string() && e.is_string())
          from_text(e.get<std::string>());
        else if (first.is_array() && e.is_array())
          from_ids(token_list(e, prompt_vocab_size(model), where));
        else
          refuse("prompt", kShapes);
      }
    }
  } else {
    refuse("prompt", kShapes);
  }
  return out;
}

// max_tokens from `fields` (first present wins), checked against the context.
void set_max_tokens(const json& body, std::initializer_list<const char*> fields, std::optional<int64_t> fallback,
                    const ModelInfo& model, GenerationRequest& r) {
  std::optional<int64_t> max_tokens;
  const char* name = *fields.begin();
  for (const char* f : fields)
    if (auto v = get_int(body, f)) {
      max_tokens = v;
      name = f;
      break;
    }
  if (max_tokens && *max_tokens == 0 && r.echo) {  // the prompt only (vLLM, as OpenAI's API did)
    r.echo_only = true;
    max_tokens = 1;
  }
  if (max_tokens && *max_tokens < 1)
    refuse(name, std::string("'") + name + "' must be >= 1" + (r.chat ? "" : " (or 0 with 'echo')") + ", got " +
                     std::to_string(*max_tokens));
  int64_t longest = 0;
  for (const auto& p : r.prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.token_ids.size()));
  const int64_t limit = model.max_model_len;
  if (longest >= limit)
    refuse(r.chat ? "messages" : "prompt", "This model's maximum context length is " + std::to_string(limit) +
                         " tokens, but the prompt has " + std::to_string(longest) +
                         " tokens (at least one token must be left to generate). Please shorten the prompt.");
  const int64_t m = max_tokens ? *max_tokens : fallback ? *fallback : limit - longest;
  if (m > limit - longest)  // (not longest + m: that overflows for huge values)
    refuse(name, "This model's maximum context length is " + std::to_string(limit) +
                     " tokens. However, you requested " +
                     (m > limit ? std::string("more than ") + std::to_string(limit) : std::to_string(longest + m)) +
                     " tokens (" +
                     std::to_string(longest) + " in the prompt, " + std::to_string(m) +
                     " in the completion). Please reduce the length of the prompt or '" + name + "'.");
  r.params.max_tokens = static_cast<int32_t>(m);
}

json parse_body(const std::string& body, const RequestLimits& limits) {
  if (json_depth(body, limits.max_json_depth) > limits.max_json_depth)
    refuse("", "The request body nests arrays and objects more than " + std::to_string(limits.max_json_depth) +
                   " deep (--max-json-depth)");
  // Arrays and objects are counted as they are parsed, and one past
  // max_elements stops the parse: no prompt, stop list or message list can be
  // longer, and a body of millions of numbers would otherwise become a DOM of
  // ~16 bytes a number before anything looked at it.
  // The values of the whole body are counted too: many small arrays are
  // each under max_elements, but not together.
  std::vector<std::pair<bool, int64_t>> open;  // per open container: is an array, elements so far
  int64_t values = 0;
  auto count = [&](int, json::parse_event_t event, json&) {
    using E = json::parse_event_t;
    const bool element = event == E::value || event == E::key || event == E::array_start || event == E::object_start;
    if (element && event != E::key && ++values > limits.max_json_values)
      refuse("", "The request body holds more than " + std::to_string(limits.max_json_values) +
                     " JSON values (--max-json-values)");
    // An array counts its elements; an object, its keys.
    if (element && !open.empty() && (open.back().first ? event != E::key : event == E::key) &&
        ++open.back().second > limits.max_elements)
      refuse("", "The request body holds an array or object of more than " + std::to_string(limits.max_elements) +
                     " elements");
    if (event == E::array_start || event == E::object_start) open.emplace_back(event == E::array_start, 0);
    if (event == E::array_end || event == E::object_end) open.pop_back();
    return true;
  };
  json j = json::parse(body, count, /*allow_exceptions=*/false);
  if (j.is_discarded()) refuse("", "The request body is not valid JSON");
  if (!j.is_object()) refuse("", "The request body must be a JSON object");
  return j;
}

// Flattens OpenAI content parts ([{"type": "text", "text": ...}]) to a string.
json normalize_messages(const json& body) {
  const json* f = field(body, "messages");
  if (!f) refuse("messages", "'messages' is required");
  if (!f->is_array() || f->empty()) refuse("messages", "'messages' must be a non-empty list of messages");
  json out = json::array();
  for (size_t i = 0; i < f->size(); ++i) {
    const json& m = (*f)[i];
    const std::string where = "'messages[" + std::to_string(i) + "]'";
    if (!m.is_object()) refuse("messages", where + " must be an object with 'role' and 'content'");
    const json* role = field(m, "role");
    if (!role || !role->is_string()) refuse("messages", where + " needs a string 'role'");
    json copy = m;
    auto c = m.find("content");
    if (c != m.end() && c->is_array()) {
      std::string text;
      for (const auto& part : *c) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string())
          refuse("messages", where + ": only content parts of type 'text' are supported");
        if (!text.empty()) text += "\n";
        text += part["text"].get<std::string>();
      }
      copy["content"] = text;
    } else if (c != m.end() && !c->is_string() && !c->is_null()) {
      refuse("messages", where + " 'content' must be a string, a list of content parts or null");
    }
    out.push_back(std::move(copy));
  }
  return out;
}

// The messages rendered with the chat template and encoded (chat requests
// and /tokenize with "messages"). `text` is the body as sent: 'tools' and
// 'chat_template_kwargs' are taken from it with their keys in the order the
// client wrote them (as Python dicts keep them), so `tools | tojson` renders
// as in Hugging Face and vLLM; `body` (parsed already, so `text` is known to
// be valid and within the limits) orders keys alphabetically.
Prompt render_chat(const json& body, const std::string& text, const ModelInfo& model) {
  json messages = normalize_messages(body);
  if (!model.tokenizer)
    refuse("messages", "chat needs a tokenizer and this server runs with --skip-tokenizer-init; use /v1/completions "
                       "with token ids");
  if (!model.chat_template && !model.chat_template_error.empty())
    refuse("messages", "This model's chat template cannot be used (" + model.chat_template_error +
                           "); use /v1/completions");
  if (!model.chat_template)
    refuse("messages",
           "This model has no chat template (tokenizer_config.json 'chat_template'); use "
           "/v1/completions");
  using ordered_json = nlohmann::ordered_json;
  const ordered_json ordered = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  ordered_json context = {{"messages", ordered_json(messages)},
                          {"add_generation_prompt", get_bool(body, "add_generation_prompt", true)},
                          {"bos_token", model.tokenizer->bos_token()},
                          {"eos_token", model.tokenizer->eos_token()}};
  if (field(body, "tools")) context["tools"] = ordered.at("tools");
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) refuse("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    for (const auto& [k, v] : ordered.at("chat_template_kwargs").items()) {
      if (k == "messages" || k == "tools")  // the request's own fields, not overridable
        refuse("chat_template_kwargs", "'chat_template_kwargs' may not set '" + k + "' (it is the request's '" + k +
                                           "' field)");
      context[k] = v;
    }
  }
  auto rendered = model.chat_template->render(context);
  if (!rendered.ok()) refuse("messages", "The chat template refused the messages: " + rendered.status().message());
  refuse_text_past_context(*rendered, model, "messages");
  const bool add_special = get_bool(body, "add_special_tokens", false);
  Prompt p{model.tokenizer->encode(*rendered, add_special), *rendered};
  if (p.token_ids.empty()) refuse("messages", "The rendered chat prompt is empty");
  return p;
}

// The parsers a chat request's output goes through (vLLM's rules): the
// reasoning parser when the server has one; the tool-call parser for a
// request with tools whose tool_choice is "auto" (the default with tools),
// which needs --enable-auto-tool-choice besides --tool-call-parser. Without
// a parser, tools are only rendered into the prompt and the output is text.
// "required" and named functions need guided decoding: refused.
OutputParsing output_parsing(const json& body, const ModelInfo& model) {
  OutputParsing p;
  p.reasoning = model.reasoning_parser;
  const json* tc = field(body, "tool_choice");
  const bool required_or_named = tc && ((tc->is_string() && *tc == "required") || tc->is_object());
  if (required_or_named)
    refuse("tool_choice", "'tool_choice' may only be \"auto\" or \"none\": a required or named tool call needs "
                          "guided decoding, which this server does not have");
  if (tc && !(tc->is_string() && (*tc == "auto" || *tc == "none")))
    refuse("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, got " +
                              tc->dump());
  const json* tools = field(body, "tools");
  if (tools && !tools->is_array()) refuse("tools", "'tools' must be a list of tools");
  if (tools)
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const json* fn = t.is_object() ? field(t, "function") : nullptr;
      const json* name = fn && fn->is_object() ? field(*fn, "name") : nullptr;
      if (!t.is_object() || !t.contains("type") || t["type"] != "function" || !name || !name->is_string() ||
          name->get<std::string>().empty())
        refuse("tools", "'tools' entry " + std::to_string(i) +
                            " must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}} with a non-empty name");
    }
  p.parallel_tool_calls = get_bool(body, "parallel_tool_calls", true);
  if (tools && !tools->empty() && (!tc || *tc == "auto") && model.tool_call_parser) {
    if (!model.enable_auto_tool_choice)
      refuse("tool_choice", "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set");
    p.tool_calls = model.tool_call_parser;
  }
  return p;
}

}  // namespace

std::variant<GenerationRequest, ApiError> parse_completion_request(const std::string& text, const ModelInfo& model) {
  try {
    const json body = parse_body(text, model.limits);
    GenerationRequest r;
    parse_common(body, model, r);
    if (auto best_of = get_int(body, "best_of"); best_of && *best_of != r.n)
      refuse("best_of", "'best_of' is not supported (only equal to n)");
    if (const json* s = field(body, "suffix"); s && !(s->is_string() && s->get<std::string>().empty()))
      refuse("suffix", "'suffix' is not supported");
    r.echo = get_bool(body, "echo", false);
    if (field(body, "logprobs")) {
      r.logprobs = true;
      r.params.logprobs = static_cast<int32_t>(get_int_in(body, "logprobs", 0, 20, 0));
    }
    if (field(body, "prompt_logprobs")) {
      r.prompt_logprobs = static_cast<int32_t>(get_int_in(body, "prompt_logprobs", 0, 20, 0));
      if (r.stream) refuse("prompt_logprobs", "'prompt_logprobs' is not available when 'stream' is true");
    }
    if (!model.tokenizer && r.echo)
      refuse("echo", "'echo' needs a tokenizer and this server runs with --skip-tokenizer-init");
    if (!model.tokenizer && (r.logprobs || r.prompt_logprobs))
      refuse(r.logprobs ? "logprobs" : "prompt_logprobs",
             std::string("'") + (r.logprobs ? "logprobs" : "prompt_logprobs") +
                 "' needs a tokenizer and this server runs with --skip-tokenizer-init");
    // What the engine computes for the prompt: echo with logprobs reports the
    // prompt's tokens with the same top-N as the generated ones (as vLLM).
    if (r.echo && r.logprobs) r.params.prompt_logprobs = r.params.logprobs;
    if (r.prompt_logprobs) r.params.prompt_logprobs = std::max(r.params.prompt_logprobs.value_or(0), *r.prompt_logprobs);
    if (!model.tokenizer && !r.params.stop.empty())
      refuse("stop", "stop strings need a tokenizer and this server runs with --skip-tokenizer-init");
    // prompts x n is known before any prompt is tokenized (a 64 MB list of
    // 400 prompts was encoded, 7 s, before this refused it).
    if (const json* f = field(body, "prompt"); f && f->is_array() && !f->empty() && !(*f)[0].is_number_integer() &&
                                                static_cast<int64_t>(f->size()) * r.n > model.limits.max_choices)
      refuse("prompt", "prompts x n = " + std::to_string(static_cast<int64_t>(f->size()) * r.n) +
                           " exceeds the limit of " + std::to_string(model.limits.max_choices) +
                           " completions per request (--max-choices)");
    r.prompts = parse_prompts(body, model, r.skip_special_tokens);
    if (static_cast<int64_t>(r.prompts.size()) * r.n > model.limits.max_choices)
      refuse("prompt", "prompts x n = " + std::to_string(r.prompts.size() * r.n) + " exceeds the limit of " +
                           std::to_string(model.limits.max_choices) + " completions per request (--max-choices)");
    set_max_tokens(body, {"max_tokens"}, 16, model, r);
    check_min_tokens(r);
    r.params.grammar = structured_output(body, text, model, r.params);
    return r;
  } catch (const Refusal& e) {
    return e.error;
  }
}

std::variant<GenerationRequest, ApiError> parse_chat_request(const std::string& text, const ModelInfo& model) {
  try {
    const json body = parse_body(text, model.limits);
    GenerationRequest r;
    r.chat = true;
    parse_common(body, model, r);
    r.logprobs = get_bool(body, "logprobs", false);
    if (get_bool(body, "echo", false)) refuse("echo", "'echo' is not supported for chat completions");
    if (field(body, "prompt_logprobs"))
      refuse("prompt_logprobs", "'prompt_logprobs' is not supported for chat completions; use /v1/completions");
    if (get_bool(body, "continue_final_message", false))
      refuse("continue_final_message", "'continue_final_message' is not supported");
    if (field(body, "reasoning_effort")) refuse("reasoning_effort", "'reasoning_effort' is not supported");
    r.parsing = output_parsing(body, model);
    r.params.logprobs = static_cast<int32_t>(get_int_in(body, "top_logprobs", 0, 20, 0));
    if (r.params.logprobs > 0 && !r.logprobs) refuse("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
    Prompt p = render_chat(body, text, model);
    r.prompts.push_back(std::move(p));
    set_max_tokens(body, {"max_completion_tokens", "max_tokens"}, std::nullopt, model, r);
    check_min_tokens(r);
    r.params.grammar = structured_output(body, text, model, r.params);
    return r;
  } catch (const Refusal& e) {
    return e.error;
  }
}

std::variant<nlohmann::json, ApiError> tokenize_request(const std::string& text, const ModelInfo& model) {
  try {
    const json body = parse_body(text, model.limits);
    check_model(body, model);
    if (!model.tokenizer) refuse("", "/tokenize needs a tokenizer and this server runs with --skip-tokenizer-init");
    std::vector<int32_t> ids;
    if (field(body, "messages")) {
      ids = render_chat(body, text, model).token_ids;
    } else {
      const json* p = field(body, "prompt");
      if (!p || !p->is_string()) refuse("prompt", "'prompt' (a string) or 'messages' is required");
      refuse_text_past_context(p->get<std::string>(), model, "prompt");
      ids = model.tokenizer->encode(p->get<std::string>(), get_bool(body, "add_special_tokens", true));
    }
    json strs = nullptr;  // vLLM's return_token_strs: the vocabulary's strings of the ids
    if (get_bool(body, "return_token_strs", false)) {
      strs = json::array();
      for (int32_t id : ids) strs.push_back(utf8_replace_invalid(model.tokenizer->id_to_token(id)));
    }
    return json{{"count", ids.size()}, {"max_model_len", model.max_model_len}, {"tokens", ids}, {"token_strs", strs}};
  } catch (const Refusal& e) {
    return e.error;
  }
}

std::variant<nlohmann::json, ApiError> detokenize_request(const std::string& text, const ModelInfo& model) {
  try {
    const json body = parse_body(text, model.limits);
    check_model(body, model);
    if (!model.tokenizer) refuse("", "/detokenize needs a tokenizer and this server runs with --skip-tokenizer-init");
    const json* t = field(body, "tokens");
    if (!t || !t->is_array()) refuse("tokens", "'tokens' (a list of token ids) is required");
    std::vector<int32_t> ids;
    for (const auto& id : *t) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= prompt_vocab_size(model))
        refuse("tokens", "'tokens' holds " + id.dump() + ", not a token id in [0, " +
                             std::to_string(prompt_vocab_size(model)) + ")");
      ids.push_back(id.get<int32_t>());
    }
    return json{{"prompt", model.tokenizer->decode(ids, /*skip_special_tokens=*/false)}};
  } catch (const Refusal& e) {
    return e.error;
  }
}

int json_depth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;  // the escaped character, whatever it is
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace nucleus::server
