// The OpenAI request schema: parsing and validating the bodies of
// POST /v1/completions and POST /v1/chat/completions into what the engine
// needs. Every refusal is an ApiError that names the field at fault, as the
// OpenAI API does: {"error": {"message", "type", "param", "code"}}.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "io/chat_template.h"
#include "io/tokenizer.h"
#include "runtime/sampling_params.h"

namespace nucleus::server {

// Choices per prompt (n) at most, and engine requests per HTTP request.
inline constexpr int kMaxN = 16;
inline constexpr int kMaxChoices = 1024;
// Stop strings per request at most (as OpenAI's 4, but lenient).
inline constexpr int kMaxStopStrings = 16;

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
  const ChatTemplate* chat_template = nullptr;  // null: the model has none
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
  bool logprobs = false;       // report per-token logprobs (params.logprobs: top-N)
  bool skip_special_tokens = true;
  bool include_stop_str_in_output = false;
};

// Returns the parsed request, or the error to send. `body` is the raw HTTP
// body (malformed JSON is a 400 too).
std::variant<GenerationRequest, ApiError> parse_completion_request(const std::string& body, const ModelInfo& model);
std::variant<GenerationRequest, ApiError> parse_chat_request(const std::string& body, const ModelInfo& model);

}  // namespace nucleus::server
