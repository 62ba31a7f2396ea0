// Reasoning parsing of chat output (`serve --reasoning-parser deepseek_r1`),
// as vLLM's deepseek_r1 parser reads DeepSeek-R1's text: the reasoning runs
// up to "</think>", the answer follows it. R1's chat template opens
// "<think>" in the prompt, so the output normally starts inside the
// reasoning; a "<think>" the model writes at the very start is dropped. When
// no "</think>" comes (cut off by max_tokens, or a stop string inside the
// reasoning) everything is reasoning and there is no content, as in vLLM.
//
// Incremental like ToolCallParser: text that could be the start of
// "<think>" (at the start) or "</think>" waits, so neither leaks into either
// part; the streamed pieces concatenate to the whole output's split.
#pragma once

#include <string>
#include <string_view>

namespace nucleus::server {

// The names `--reasoning-parser` accepts: "deepseek_r1".
bool is_reasoning_parser_name(std::string_view name);

// The marker strings the detokenizer must keep visible: "<think>", "</think>".
inline constexpr std::string_view kThinkBegin = "<think>";
inline constexpr std::string_view kThinkEnd = "</think>";

struct ReasoningDelta {
  std::string reasoning;  // text of the reasoning part
  std::string content;    // text after "</think>"
  bool empty() const { return reasoning.empty() && content.empty(); }
};

class ReasoningParser {
 public:
  // Feeds the next piece of the model's text; returns what became final
  // (reasoning always before content).
  ReasoningDelta add(std::string_view text);
  // At the end of the output: releases what was held back (as reasoning:
  // it did not complete "</think>"). Later add() calls are ignored.
  ReasoningDelta finish();

 private:
  enum class State { kStart, kReasoning, kContent };
  void advance(bool final, ReasoningDelta& out);

  State state_ = State::kStart;
  std::string buf_;  // text not released: a possible partial marker
  bool finished_ = false;
};

}  // namespace nucleus::server
