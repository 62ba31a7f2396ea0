// The OpenAI response schema: JSON bodies of /v1/completions and
// /v1/chat/completions, whole ("text_completion", "chat.completion") or as
// server-sent-event chunks ("text_completion", "chat.completion.chunk").
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "server/generation.h"
#include "server/message_parser.h"
#include "server/protocol.h"

namespace nucleus::server {

// Fields shared by every object of one response.
struct ResponseHeader {
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // unix seconds
  std::string model;
};

// Builds the JSON of one request's response; keeps per-choice state that
// spans chunks (accumulated text, logprob text offsets).
class ResponseBuilder {
 public:
  // `tokenizer` null (--skip-tokenizer-init): choices carry "token_ids"
  // (and empty text); logprobs are never requested then.
  ResponseBuilder(ResponseHeader header, const GenerationRequest& request, const Tokenizer* tokenizer, int num_choices);

  // Streaming: the chunks to send before any token (chat: the assistant role
  // per choice; completions with echo: the prompt per choice). May be empty.
  std::vector<nlohmann::json> opening_chunks() const;
  // Streaming: the chunks for one delta. One, unless the request's output
  // is parsed (chat with --reasoning-parser or a tool-call parser): then
  // reasoning and content share a chunk, each tool-call piece has its own
  // (as vLLM streams them), and a delta whose text the parsers hold back
  // (a possible partial marker) gives none unless it finishes the choice or
  // carries logprobs.
  std::vector<nlohmann::json> chunks(const ChoiceDelta& delta);
  // Streaming, stream_options.include_usage: the last chunk, "choices": [].
  nlohmann::json usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) const;

  // Non-streaming: accumulate every delta, then build the whole response.
  void add(const ChoiceDelta& delta);
  nlohmann::json whole(int64_t prompt_tokens, int64_t completion_tokens) const;

 private:
  struct ChoiceState {
    std::string text;
    std::string finish_reason;
    std::vector<int32_t> token_ids;  // without a tokenizer only
    nlohmann::json logprobs;  // accumulated (non-streaming)
    // Completions logprobs: characters (code points, as Python's len counts
    // them) of the choice's text before the next token, as vLLM counts.
    int64_t text_offset = 0;
    bool echoed = false;             // echo with logprobs: the prompt (its text, its logprobs) went out
    nlohmann::json prompt_logprobs;  // request.prompt_logprobs: the choice's 'prompt_logprobs'
    // Chat with output parsing: the parsers, and what they made of the text
    // (non-streaming); `text` holds the content then.
    std::unique_ptr<MessageParser> parser;
    std::string reasoning;
    nlohmann::json tool_calls = nlohmann::json::array();
  };
  nlohmann::json chunk(const ChoiceDelta& delta);
  nlohmann::json parsed_message(const ChoiceState& c) const;
  // Runs the choice's parsers on the delta; sets `finish_reason` (a choice
  // that stopped after tool calls finishes with "tool_calls").
  MessageDelta parse(ChoiceState& c, const ChoiceDelta& d, std::string& finish_reason) const;
  nlohmann::json logprobs_json(const ChoiceDelta& delta, ChoiceState& c) const;
  // Completions with echo and logprobs: the prompt's tokens are reported
  // before the generated ones (the first with null logprobs).
  bool echo_logprobs() const { return !request_.chat && request_.echo && request_.logprobs; }
  // vLLM's choice-level prompt_logprobs: [null, {"<id>": {"logprob", "rank",
  // "decoded_token"}}, ...], the prompt token and the top-N of each position.
  nlohmann::json prompt_logprobs_json(const std::vector<TokenLogprobs>& entries) const;
  nlohmann::json base(const char* object) const;
  std::string echo_text(int index) const;

  ResponseHeader header_;
  const GenerationRequest& request_;
  const Tokenizer* tokenizer_;
  std::vector<ChoiceState> choices_;
};

nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens);
// Serialises for the wire; invalid UTF-8 (a token that is half a character)
// becomes U+FFFD.
std::string dump_json(const nlohmann::json& j);

}  // namespace nucleus::server
