// The OpenAI request schema: parsing and validating the bodies of
// POST /v1/completions and POST /v1/chat/completions into what the engine
// needs. Every refusal is an ApiError that names the field at fault, as the
// OpenAI API does: {"error": {"message", "type", "param", "code"}}.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "io/chat_template.h"
#include "io/tokenizer.h"
#include "runtime/sampling_params.h"
#include "runtime/structured_output.h"
#include "server/message_parser.h"

namespace nucleus::server {

// What one request may ask for; each is a `nucleus serve` flag. They bound
// the memory and time a single request can cost (every choice holds its own
// copy of the stop lists), and a body's JSON is refused past max_json_depth
// before it is parsed (nesting is otherwise limited only by the stack).
struct RequestLimits {
  int max_json_depth = 64;           // nested arrays / objects in the body
  int64_t max_json_values = int64_t{1} << 21;  // values in the body (numbers, strings, arrays, ...)
  int max_choices = 256;             // n x prompts: engine requests per HTTP request
  int max_stop_strings = 64;         // entries of 'stop'
  int64_t max_stop_bytes = 16384;    // UTF-8 bytes of all of 'stop' together
  int max_stop_token_ids = 1024;     // entries of 'stop_token_ids'
  // Strings of a structured-output choice list (structured_outputs.choice,
  // guided_choice): compiling one costs time that grows faster than the list
  // (1,000 strings: 6 s of a core, 4,000: 210 s, while the request waits).
  int max_guided_choices = 256;
  // Elements of any one JSON array or object in the body, counted while it is
  // parsed. The server sets it to max(max_model_len, 4096): no prompt, list of
  // prompts, stop list or message list that could be served is longer.
  int64_t max_elements = 4096;
};
// Largest accepted temperature; logits / 1e4 is already uniform to float
// precision for any model, so larger values only hide a client's bug.
inline constexpr double kMaxTemperature = 1e4;

struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" is written as null
  std::string code;   // "" is written as null
  nlohmann::json body() const;
};

// What every request parser needs to know about the served model.
struct ModelInfo {
  std::vector<std::string> names;  // accepted "model" values; names[0] is reported
  int64_t max_model_len = 0;
  int64_t vocab_size = 0;
  // Null when the server runs with --skip-tokenizer-init: prompts must then be
  // token ids, responses carry token_ids and empty text, and what needs text
  // (stop strings, logprobs, chat) is refused.
  const Tokenizer* tokenizer = nullptr;
  const ChatTemplate* chat_template = nullptr;  // null: the model has none, or it did not parse
  std::string chat_template_error;              // the parse error when it did not
  bool speculative = false;                     // the engine drafts (--speculative-config)
  RequestLimits limits;                         // the server's per-request limits
  // Chat output parsing: `serve --tool-call-parser`, `--enable-auto-tool-choice`,
  // `--reasoning-parser deepseek_r1` (docs/server.md, "Tool calls and reasoning").
  std::optional<ToolCallFormat> tool_call_parser;
  bool enable_auto_tool_choice = false;
  bool reasoning_parser = false;
  // Compiles response_format / structured_outputs; null: such requests are
  // refused (no tokenizer, or a build without xgrammar).
  const GrammarCompiler* grammar_compiler = nullptr;
};

struct Prompt {
  std::vector<int32_t> token_ids;
  std::string text;  // for echo: the prompt as given, or its token ids decoded
};

// A validated completion or chat request.
struct GenerationRequest {
  bool chat = false;
  std::vector<Prompt> prompts;  // chat: exactly one (the rendered messages)
  SamplingParams params;        // seed: the request's; choice i of a prompt gets seed + i
  int n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool echo = false;           // completions: prepend the prompt to the text
  // Completions, echo with max_tokens 0: the prompt only (the engine samples
  // one token, which is dropped, as vLLM does).
  bool echo_only = false;
  bool logprobs = false;       // report per-token logprobs (params.logprobs: top-N); with echo, the prompt's too
  // vLLM's prompt_logprobs (completions, not streamed): the choice's
  // 'prompt_logprobs' with this top-N. params.prompt_logprobs is what the
  // engine computes for this and for echo with logprobs together.
  std::optional<int32_t> prompt_logprobs;
  bool skip_special_tokens = true;
  bool include_stop_str_in_output = false;
  OutputParsing parsing;  // chat: the parsers the output goes through (reasoning, tool calls)
};

// Returns the parsed request, or the error to send. `body` is the raw HTTP
// body (malformed JSON, and JSON nested deeper than model.limits, are 400s too).
std::variant<GenerationRequest, ApiError> parse_completion_request(const std::string& body, const ModelInfo& model);
std::variant<GenerationRequest, ApiError> parse_chat_request(const std::string& body, const ModelInfo& model);

// vLLM's POST /tokenize: {"prompt": TEXT, "add_special_tokens": true} or
// {"messages": [...], chat fields} -> {"count", "max_model_len", "tokens",
// "token_strs": null}; and POST /detokenize: {"tokens": [ids]} -> {"prompt":
// TEXT} (special tokens kept). Errors as the completion endpoints'.
std::variant<nlohmann::json, ApiError> tokenize_request(const std::string& body, const ModelInfo& model);
std::variant<nlohmann::json, ApiError> detokenize_request(const std::string& body, const ModelInfo& model);

// The deepest nesting of arrays and objects in `text` read as JSON, stopping
// early once it passes `limit` (then some value > limit). Strings are skipped
// (brackets inside them do not count); no recursion, O(size).
int json_depth(std::string_view text, int limit);

}  // namespace nucleus::server
