// Tool-call parsing of chat output (`serve --tool-call-parser NAME`), as
// vLLM's parsers of the same names read the model's text:
//
//   deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
//                 ```json
//                 ARGS
//                 ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>        (V3, R1)
//   deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
//                 ...<｜tool▁calls▁end｜>                                 (V3.1)
//   kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
//                 <|tool_call_argument_begin|>ARGS<|tool_call_end|>...<|tool_calls_section_end|>
//
// The text before the section is the message's content; each call becomes
// {id, name, arguments (the JSON text as the model wrote it)}; text after
// the section's end (normally nothing: EOS follows) is dropped, as vLLM's
// non-streaming parsers drop it. Without the section marker the whole text
// is content.
//
// The parser is incremental: text goes in piece by piece, split anywhere
// (inside a marker too), and it returns what is final so far. Text that
// could be the start of a marker is held back until it is known not to be
// one, so a partial marker never reaches the content, and argument text is
// released only once no later text can change it (the closing fence and
// whitespace of the V3 format wait). The non-streaming result is the whole
// output fed at once, then finish(); the streamed pieces concatenate to the
// same calls and content, for every split (tests/unit/tool_parser_test.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace nucleus::server {

enum class ToolCallFormat { kDeepSeekV3, kDeepSeekV31, kKimiK2 };

// "deepseek_v3" | "deepseek_v31" | "kimi_k2" -> the format; nullopt for
// another name.
std::optional<ToolCallFormat> tool_call_format_from_name(std::string_view name);
// The names tool_call_format_from_name accepts, for flag help and errors.
const std::vector<std::string>& tool_call_format_names();

// The marker strings of a format (each one added token in the real
// tokenizers): the detokenizer must keep them in the text even with
// skip_special_tokens, or the parser cannot see them.
std::vector<std::string> tool_call_markers(ToolCallFormat format);

// A piece of one tool call, as the stream sends it: the first piece of call
// `index` carries its id and name (and no arguments); later pieces carry
// arguments text to append.
struct ToolCallDelta {
  int index = 0;          // 0, 1, ... in the order the calls appear
  std::string id;         // first piece only: "chatcmpl-tool-<32 hex>" (Kimi-K2: "functions.NAME:IDX")
  std::string name;       // first piece only
  std::string arguments;  // later pieces: text to append to the call's arguments
};

// What the parser released for one piece of input.
struct ToolParseDelta {
  std::string content;                    // message text before the tool-call section
  std::vector<ToolCallDelta> tool_calls;  // in order; content always precedes them
  bool empty() const { return content.empty() && tool_calls.empty(); }
};

class ToolCallParser {
 public:
  // `id_seed` seeds the random call ids (two parsers with one seed give the
  // same ids; the server seeds from std::random_device).
  explicit ToolCallParser(ToolCallFormat format, uint64_t id_seed);

  // Feeds the next piece of the model's text; returns what became final.
  ToolParseDelta add(std::string_view text);
  // At the end of the output: releases what was held back. A call cut off
  // before its end marker (max_tokens) keeps what was final of it: it is a
  // call once its name is complete, and its arguments are what the model
  // wrote of them (V3: without a partial closing fence). Later add() calls
  // are ignored.
  ToolParseDelta finish();

  // Calls started so far (a call counts once its name is known).
  int num_calls() const { return num_calls_; }

 private:
  enum class State { kContent, kSection, kCall, kDone };
  // What a call's text (between its begin and end markers) says so far.
  struct CallView {
    bool name_known = false;
    std::string id, name;
    std::string arguments;  // the part that is final (grows monotonically)
  };
  CallView view_call(std::string_view body, bool complete) const;
  // Processes buf_ as far as it can; `final`: nothing more will come.
  void advance(bool final, ToolParseDelta& out);
  // Releases the new part of the current call (name, then arguments).
  void emit_call(bool complete, ToolParseDelta& out);
  std::string new_call_id();

  ToolCallFormat format_;
  std::string section_begin_, section_end_, call_begin_, call_end_;
  std::vector<std::string> call_markers_;  // markers that may appear inside a call's text
  State state_ = State::kContent;
  std::string buf_;   // text not processed yet (a possible partial marker at its end)
  std::string body_;  // kCall: the current call's text so far
  bool call_named_ = false;
  size_t args_sent_ = 0;  // bytes of the current call's arguments released
  int num_calls_ = 0;
  bool finished_ = false;
  std::mt19937_64 rng_;
};

// The length of the longest end of `text` that is a proper prefix of one of
// `markers` (text that must wait: it may become a marker).
size_t partial_marker_length(std::string_view text, const std::vector<std::string>& markers);

}  // namespace nucleus::server
