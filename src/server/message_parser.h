// The chat output parsers chained: the model's text goes through the
// reasoning parser (when on), and its content part through the tool-call
// parser (when the request enables one), as vLLM chains them. One
// MessageParser per choice; ResponseBuilder turns its deltas into chunks
// (streaming) or the whole message.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/tokenizer.h"
#include "server/reasoning_parser.h"
#include "server/tool_parser.h"

namespace nucleus::server {

// Which parsers a chat request's output goes through.
struct OutputParsing {
  bool reasoning = false;                     // --reasoning-parser deepseek_r1
  std::optional<ToolCallFormat> tool_calls;   // --tool-call-parser, for requests with tools and tool_choice "auto"
  bool parallel_tool_calls = true;            // false: calls after the first are dropped (as vLLM)
  bool any() const { return reasoning || tool_calls.has_value(); }
};

// What the parsers released for one piece of text; the parts come in this
// order in the output (reasoning, then content, then tool calls).
struct MessageDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

class MessageParser {
 public:
  // `id_seed` seeds the tool-call ids (ToolCallParser).
  MessageParser(const OutputParsing& parsing, uint64_t id_seed);

  // Feeds the next piece of the choice's text (IncrementalDetokenizer
  // output); `last`: the choice ends with it, so what the parsers held back
  // (a possible partial marker) is released too. Calls after the last are
  // ignored.
  MessageDelta add(std::string_view text, bool last = false);
  // Tool calls started so far.
  int num_tool_calls() const { return tools_ ? tools_->num_calls() : 0; }

 private:
  void route_content(std::string_view content, bool final, MessageDelta& out);

  std::optional<ReasoningParser> reasoning_;
  std::optional<ToolCallParser> tools_;
  bool parallel_ = true;
};

// The ids of the parsers' markers that `tokenizer` has as single tokens.
// The detokenizer keeps these in the text even with skip_special_tokens
// (vLLM turns skip_special_tokens off for parsers whose markers are special
// tokens; keeping just the markers leaves other special tokens skipped).
std::vector<int32_t> marker_token_ids(const Tokenizer& tokenizer, const OutputParsing& parsing);

}  // namespace nucleus::server
