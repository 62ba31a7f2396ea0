// The chat output parsers (server/tool_parser, reasoning_parser,
// message_parser) on hand-written model outputs: the non-streaming result,
// and the same output streamed in pieces split at every position, whose
// deltas must concatenate to exactly the non-streaming result (no partial
// marker reaching content, arguments never taken back).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/message_parser.h"

namespace nucleus::server {
namespace {

struct Call {
  std::string id, name, arguments;
  bool operator==(const Call&) const = default;
};
struct Message {
  std::string reasoning, content;
  std::vector<Call> calls;
  bool operator==(const Message&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Message& m) {
  os << "{reasoning: \"" << m.reasoning << "\", content: \"" << m.content << "\", calls: [";
  for (const auto& c : m.calls) os << "{" << c.id << ", " << c.name << ", " << c.arguments << "} ";
  return os << "]}";
}

// Folds deltas into a message, checking the stream's shape: a call's first
// delta has its id and name and no arguments, later ones only arguments;
// indices are 0, 1, ... in order.
void fold(Message& m, const MessageDelta& d) {
  m.reasoning += d.reasoning;
  if (!d.reasoning.empty()) {
    EXPECT_TRUE(m.content.empty() && m.calls.empty()) << "reasoning after content";
  }
  m.content += d.content;
  if (!d.content.empty()) {
    EXPECT_TRUE(m.calls.empty()) << "content after a tool call";
  }
  for (const auto& t : d.tool_calls) {
    if (!t.name.empty()) {
      EXPECT_EQ(t.index, static_cast<int>(m.calls.size()));
      EXPECT_FALSE(t.id.empty());
      EXPECT_TRUE(t.arguments.empty());
      m.calls.push_back({t.id, t.name, ""});
    } else {
      ASSERT_EQ(t.index + 1, static_cast<int>(m.calls.size())) << "arguments for a call that is not the last";
      EXPECT_TRUE(t.id.empty());
      m.calls.back().arguments += t.arguments;
    }
  }
}

Message parse_pieces(const OutputParsing& parsing, const std::vector<std::string>& pieces) {
  MessageParser p(parsing, /*id_seed=*/7);
  Message m;
  for (size_t i = 0; i < pieces.size(); ++i) fold(m, p.add(pieces[i], i + 1 == pieces.size()));
  if (pieces.empty()) fold(m, p.add("", true));
  return m;
}

Message parse_whole(const OutputParsing& parsing, const std::string& text) { return parse_pieces(parsing, {text}); }

// Streamed in two pieces split at every byte, and one byte at a time: the
// same message as the whole text.
void expect_split_invariant(const OutputParsing& parsing, const std::string& text) {
  const Message whole = parse_whole(parsing, text);
  for (size_t i = 0; i <= text.size(); ++i) {
    const Message split = parse_pieces(parsing, {text.substr(0, i), text.substr(i)});
    ASSERT_EQ(split, whole) << "split at byte " << i << " of " << text;
  }
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  EXPECT_EQ(parse_pieces(parsing, bytes), whole) << "byte by byte: " << text;
  // Three pieces: every pair of split points, for shorter texts.
  if (text.size() > 160) return;
  for (size_t i = 0; i <= text.size(); ++i)
    for (size_t j = i; j <= text.size(); ++j)
      ASSERT_EQ(parse_pieces(parsing, {text.substr(0, i), text.substr(i, j - i), text.substr(j)}), whole)
          << "split at " << i << ", " << j;
}

// Every prefix streamed and cut there: what was released is a prefix of
// what the whole text gives, and content never holds a partial marker.
void expect_prefixes_consistent(const OutputParsing& parsing, const std::string& text,
                                const std::vector<std::string>& markers) {
  const Message whole = parse_whole(parsing, text);
  for (size_t i = 0; i <= text.size(); ++i) {
    MessageParser p(parsing, 7);
    Message m;
    fold(m, p.add(text.substr(0, i)));
    EXPECT_TRUE(whole.content.starts_with(m.content)) << i;
    EXPECT_TRUE(whole.reasoning.starts_with(m.reasoning)) << i;
    ASSERT_LE(m.calls.size(), whole.calls.size()) << i;
    for (size_t k = 0; k < m.calls.size(); ++k) {
      EXPECT_EQ(m.calls[k].name, whole.calls[k].name) << i;
      EXPECT_TRUE(whole.calls[k].arguments.starts_with(m.calls[k].arguments))
          << "prefix " << i << ": '" << m.calls[k].arguments << "' vs '" << whole.calls[k].arguments << "'";
    }
    for (const auto& mk : markers)
      for (size_t k = 2; k <= mk.size(); ++k) {
        const std::string part = mk.substr(0, k);
        if (whole.content.find(part) != std::string::npos) continue;  // the model wrote it as text
        EXPECT_EQ(m.content.find(part), std::string::npos) << "content holds '" << part << "' at prefix " << i;
      }
  }
}

OutputParsing tools(ToolCallFormat f) {
  OutputParsing p;
  p.tool_calls = f;
  return p;
}

const std::string kV3Call1 =
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Beijing\"}\n```<｜tool▁call▁end｜>";
const std::string kV3Call2 =
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"q\": \"a `b` ```c``` <d>\", \"n\": [1, 2]}\n```"
    "<｜tool▁call▁end｜>";
const std::string kV3Output =
    "Let me check.<｜tool▁calls▁begin｜>" + kV3Call1 + "\n" + kV3Call2 + "<｜tool▁calls▁end｜>";

TEST(ToolParserTest, DeepSeekV3Whole) {
  const Message m = parse_whole(tools(ToolCallFormat::kDeepSeekV3), kV3Output);
  EXPECT_EQ(m.content, "Let me check.");
  ASSERT_EQ(m.calls.size(), 2u);
  EXPECT_EQ(m.calls[0].name, "get_weather");
  EXPECT_EQ(m.calls[0].arguments, "{\"location\": \"Beijing\"}");
  EXPECT_TRUE(m.calls[0].id.starts_with("chatcmpl-tool-")) << m.calls[0].id;
  EXPECT_EQ(m.calls[0].id.size(), std::string("chatcmpl-tool-").size() + 32);
  EXPECT_NE(m.calls[0].id, m.calls[1].id);
  EXPECT_EQ(m.calls[1].name, "search");
  EXPECT_EQ(m.calls[1].arguments, "{\"q\": \"a `b` ```c``` <d>\", \"n\": [1, 2]}");
}

TEST(ToolParserTest, DeepSeekV3Streamed) {
  const OutputParsing p = tools(ToolCallFormat::kDeepSeekV3);
  expect_split_invariant(p, kV3Output);
  expect_prefixes_consistent(p, kV3Output, tool_call_markers(ToolCallFormat::kDeepSeekV3));
  // Multi-line arguments, no text before the calls, and the EOS-less end.
  expect_split_invariant(p,
                         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\n  \"a\": 1\n}\n```"
                         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
}

TEST(ToolParserTest, NoToolCallsIsAllContent) {
  for (auto f : {ToolCallFormat::kDeepSeekV3, ToolCallFormat::kDeepSeekV31, ToolCallFormat::kKimiK2}) {
    // Text that starts like markers but is none stays content, all of it.
    const std::string text = "Plain answer with <｜tool and <|tool_call and a trailing <";
    const Message m = parse_whole(tools(f), text);
    EXPECT_EQ(m.content, text);
    EXPECT_TRUE(m.calls.empty());
    expect_split_invariant(tools(f), text);
  }
  EXPECT_EQ(parse_whole(tools(ToolCallFormat::kDeepSeekV3), ""), Message{});
}

TEST(ToolParserTest, DeepSeekV31) {
  const std::string text =
      "normal text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>foo<｜tool▁sep｜>{\"x\":1}<｜tool▁call▁end｜>"
      "<｜tool▁call▁begin｜>bar<｜tool▁sep｜>{\"y\": \"<z>\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  const OutputParsing p = tools(ToolCallFormat::kDeepSeekV31);
  const Message m = parse_whole(p, text);
  EXPECT_EQ(m.content, "normal text");
  ASSERT_EQ(m.calls.size(), 2u);
  EXPECT_EQ(m.calls[0].name, "foo");
  EXPECT_EQ(m.calls[0].arguments, "{\"x\":1}");
  EXPECT_EQ(m.calls[1].name, "bar");
  EXPECT_EQ(m.calls[1].arguments, "{\"y\": \"<z>\"}");
  expect_split_invariant(p, text);
  expect_prefixes_consistent(p, text, tool_call_markers(ToolCallFormat::kDeepSeekV31));
}

TEST(ToolParserTest, KimiK2) {
  const std::string text =
      "I'll look.<|tool_calls_section_begin|> <|tool_call_begin|>functions.get_weather:0 "
      "<|tool_call_argument_begin|> {\"city\": \"Paris\"} <|tool_call_end|>\n"
      "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
      "<|tool_calls_section_end|>";
  const OutputParsing p = tools(ToolCallFormat::kKimiK2);
  const Message m = parse_whole(p, text);
  EXPECT_EQ(m.content, "I'll look.");
  ASSERT_EQ(m.calls.size(), 2u);
  EXPECT_EQ(m.calls[0].id, "functions.get_weather:0");
  EXPECT_EQ(m.calls[0].name, "get_weather");
  EXPECT_EQ(m.calls[0].arguments, "{\"city\": \"Paris\"}");
  EXPECT_EQ(m.calls[1].id, "functions.get_time:1");
  EXPECT_EQ(m.calls[1].name, "get_time");
  EXPECT_EQ(m.calls[1].arguments, "{}");
  expect_split_invariant(p, text);
  expect_prefixes_consistent(p, text, tool_call_markers(ToolCallFormat::kKimiK2));
}

// max_tokens cut the output: inside a call, inside a marker, inside the
// section marker. What was written of a call is its call; a partial marker
// is dropped inside a call and is text before the section.
TEST(ToolParserTest, CutOffOutputs) {
  const OutputParsing p = tools(ToolCallFormat::kDeepSeekV3);
  Message m = parse_whole(p, "Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": ");
  EXPECT_EQ(m.content, "Hi");
  ASSERT_EQ(m.calls.size(), 1u);
  EXPECT_EQ(m.calls[0].name, "f");
  EXPECT_EQ(m.calls[0].arguments, "{\"a\":");
  m = parse_whole(p, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call");
  ASSERT_EQ(m.calls.size(), 1u);
  EXPECT_EQ(m.calls[0].arguments, "{}");
  // A partial closing fence is not part of the arguments.
  m = parse_whole(p, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n``");
  ASSERT_EQ(m.calls.size(), 1u);
  EXPECT_EQ(m.calls[0].arguments, "{}");
  // The name's line not finished: no call (its name may be cut).
  m = parse_whole(p, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_wea");
  EXPECT_TRUE(m.calls.empty());
  // Before the name: no call.
  m = parse_whole(p, "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>func");
  EXPECT_EQ(m.content, "x");
  EXPECT_TRUE(m.calls.empty());
  m = parse_whole(p, "Hello <｜tool▁calls");
  EXPECT_EQ(m.content, "Hello <｜tool▁calls");
  EXPECT_TRUE(m.calls.empty());
  for (const std::string& cut : {kV3Output.substr(0, 60), kV3Output.substr(0, 120), kV3Output.substr(0, 200)})
    expect_split_invariant(p, cut);
}

// Text after the section's end is dropped (vLLM's non-streaming parsers
// drop it), and so are stray characters between calls.
TEST(ToolParserTest, TextAfterTheSectionIsDropped) {
  const OutputParsing p = tools(ToolCallFormat::kDeepSeekV3);
  const std::string text = "a<｜tool▁calls▁begin｜>junk" + kV3Call1 + "<｜tool▁calls▁end｜> trailing";
  const Message m = parse_whole(p, text);
  EXPECT_EQ(m.content, "a");
  ASSERT_EQ(m.calls.size(), 1u);
  EXPECT_EQ(m.calls[0].arguments, "{\"location\": \"Beijing\"}");
  expect_split_invariant(p, text);
}

TEST(ToolParserTest, ParallelToolCallsFalseKeepsTheFirst) {
  OutputParsing p = tools(ToolCallFormat::kDeepSeekV3);
  p.parallel_tool_calls = false;
  const Message m = parse_whole(p, kV3Output);
  ASSERT_EQ(m.calls.size(), 1u);
  EXPECT_EQ(m.calls[0].name, "get_weather");
  expect_split_invariant(p, kV3Output);
}

TEST(ToolParserTest, FormatNames) {
  EXPECT_EQ(tool_call_format_from_name("deepseek_v3"), ToolCallFormat::kDeepSeekV3);
  EXPECT_EQ(tool_call_format_from_name("deepseek_v31"), ToolCallFormat::kDeepSeekV31);
  EXPECT_EQ(tool_call_format_from_name("kimi_k2"), ToolCallFormat::kKimiK2);
  EXPECT_EQ(tool_call_format_from_name("hermes"), std::nullopt);
}

OutputParsing reasoning() {
  OutputParsing p;
  p.reasoning = true;
  return p;
}

// vLLM's deepseek_r1 rule: up to </think> is reasoning, the rest content;
// without </think> all is reasoning; a leading <think> is dropped.
TEST(ReasoningParserTest, DeepSeekR1) {
  const OutputParsing p = reasoning();
  struct Case {
    std::string text, reasoning, content;
  };
  const std::vector<Case> cases = {
      {"Let me think. 1+1=2.</think>The answer is 2.", "Let me think. 1+1=2.", "The answer is 2."},
      {"<think>Hmm.</think>\n\nYes.", "Hmm.", "\n\nYes."},
      {"Still thinking when cut off", "Still thinking when cut off", ""},
      {"<think>cut inside </thi", "cut inside </thi", ""},
      {"</think>only content", "", "only content"},
      {"no end <think> in the middle", "no end <think> in the middle", ""},
      {"<thin", "<thin", ""},
      {"a</think>b</think>c", "a", "b</think>c"},
      {"", "", ""},
  };
  for (const auto& c : cases) {
    const Message m = parse_whole(p, c.text);
    EXPECT_EQ(m.reasoning, c.reasoning) << c.text;
    EXPECT_EQ(m.content, c.content) << c.text;
    expect_split_invariant(p, c.text);
    expect_prefixes_consistent(p, c.text, {"</think>"});
  }
}

// Reasoning, then content with tool calls in it: the tool parser reads the
// content part only.
TEST(ReasoningParserTest, WithToolCalls) {
  OutputParsing p = tools(ToolCallFormat::kDeepSeekV3);
  p.reasoning = true;
  const std::string text = "I need the weather. <｜tool▁calls▁begin｜> is the marker.</think>" + kV3Output;
  const Message m = parse_whole(p, text);
  EXPECT_EQ(m.reasoning, "I need the weather. <｜tool▁calls▁begin｜> is the marker.");
  EXPECT_EQ(m.content, "Let me check.");
  ASSERT_EQ(m.calls.size(), 2u);
  expect_split_invariant(p, text);
}

}  // namespace
}  // namespace nucleus::server
