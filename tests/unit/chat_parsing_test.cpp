// Tool calls and reasoning in the server's chat responses: which requests
// get parsed (protocol: tools, tool_choice, the serve flags), the response
// shapes (ResponseBuilder: message.tool_calls, reasoning_content, the
// streamed chunks, finish_reason), and the detokenizer keeping the parsers'
// markers when skip_special_tokens would drop them.
#include <gtest/gtest.h>

#include "io/detokenizer.h"
#include "server/protocol.h"
#include "server/responses.h"
#include "test_util.h"

namespace nucleus::server {
namespace {

using nlohmann::json;

class ChatParsingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tok = Tokenizer::load(testing::model_path("tiny-dsv3"));
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    tokenizer_ = std::move(*tok);
    auto t = ChatTemplate::parse(tokenizer_->chat_template());
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    template_ = std::make_unique<ChatTemplate>(std::move(*t));
    model_.names = {"m"};
    model_.max_model_len = 256;
    model_.vocab_size = tokenizer_->vocab_size();
    model_.tokenizer = tokenizer_.get();
    model_.chat_template = template_.get();
  }
  std::variant<GenerationRequest, ApiError> chat(const json& extra) const {
    json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 8}};
    if (extra.is_object()) body.update(extra);
    return parse_chat_request(body.dump(), model_);
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> template_;
  ModelInfo model_;
};

const json kTools = json::array(
    {{{"type", "function"},
      {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}, {"properties", json::object()}}}}}}});

void expect_refused(const std::variant<GenerationRequest, ApiError>& r, const std::string& param,
                    const std::string& words) {
  ASSERT_TRUE(std::holds_alternative<ApiError>(r)) << "accepted, expected a 400 naming " << param;
  const ApiError& e = std::get<ApiError>(r);
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, param);
  EXPECT_NE(e.message.find(words), std::string::npos) << e.message;
}

const OutputParsing& parsing(const std::variant<GenerationRequest, ApiError>& r) {
  EXPECT_TRUE(std::holds_alternative<GenerationRequest>(r))
      << (std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r).message : "");
  static const OutputParsing none;
  return std::holds_alternative<GenerationRequest>(r) ? std::get<GenerationRequest>(r).parsing : none;
}

// A model without a usable template: chat is refused with a 400, and where
// the template exists but did not parse, the message gives its parse error
// (it used to say the model has no template).
TEST_F(ChatParsingTest, BrokenOrMissingTemplateIsRefusedSayingWhich) {
  model_.chat_template = nullptr;
  expect_refused(chat(json()), "messages", "This model has no chat template");
  model_.chat_template_error = "chat template line 1, column 4: unterminated tag";
  expect_refused(chat(json()), "messages",
                 "This model's chat template cannot be used (chat template line 1, column 4: unterminated tag)");
}

// With speculative decoding on, structured output is refused naming the field
// it came in (the engine's refusal had no param).
TEST_F(ChatParsingTest, StructuredOutputUnderSpeculativeDecodingNamesTheField) {
  model_.speculative = true;
  expect_refused(chat({{"response_format", {{"type", "json_object"}}}}), "response_format", "speculative decoding");
  expect_refused(chat({{"structured_outputs", {{"regex", "a+"}}}}), "structured_outputs",
                 "'structured_outputs.regex' (structured output) with speculative decoding");
}

TEST_F(ChatParsingTest, WhichRequestsAreParsed) {
  // No parser: tools are rendered, the output is text (tool_choice auto or none).
  EXPECT_FALSE(parsing(chat({{"tools", kTools}})).any());
  EXPECT_FALSE(parsing(chat({{"tools", kTools}, {"tool_choice", "auto"}})).any());
  // "required" and named functions are refused whatever the flags.
  expect_refused(chat({{"tools", kTools}, {"tool_choice", "required"}}), "tool_choice", "guided decoding");
  expect_refused(chat({{"tools", kTools}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "f"}}}}}}),
                 "tool_choice", "guided decoding");
  expect_refused(chat({{"tools", "not a list"}}), "tools", "list");
  // Malformed tools and tool_choice values (vLLM: 400).
  expect_refused(chat({{"tools", json::array({1, 2})}}), "tools", "entry 0");
  expect_refused(chat({{"tools", json::array({{{"type", "function"}}})}}), "tools", "entry 0");
  expect_refused(chat({{"tools", json::array({{{"type", "function"}, {"function", json::object()}}})}}), "tools",
                 "non-empty name");
  expect_refused(chat({{"tools", json::array({{{"type", "retrieval"}}})}}), "tools", "entry 0");
  expect_refused(chat({{"tools", kTools}, {"tool_choice", "bogus"}}), "tool_choice", "must be");
  expect_refused(chat({{"tools", kTools}, {"tool_choice", 5}}), "tool_choice", "must be");
  // A parser without --enable-auto-tool-choice: "auto" (also the default
  // with tools) is refused as vLLM refuses it; "none" and no tools are fine.
  model_.tool_call_parser = ToolCallFormat::kDeepSeekV3;
  expect_refused(chat({{"tools", kTools}}), "tool_choice", "--enable-auto-tool-choice");
  expect_refused(chat({{"tools", kTools}, {"tool_choice", "auto"}}), "tool_choice", "--enable-auto-tool-choice");
  EXPECT_FALSE(parsing(chat({{"tools", kTools}, {"tool_choice", "none"}})).any());
  EXPECT_FALSE(parsing(chat({})).any());
  // With it: requests with tools and tool_choice auto are parsed.
  model_.enable_auto_tool_choice = true;
  EXPECT_EQ(parsing(chat({{"tools", kTools}})).tool_calls, ToolCallFormat::kDeepSeekV3);
  EXPECT_EQ(parsing(chat({{"tools", kTools}, {"tool_choice", "auto"}})).tool_calls, ToolCallFormat::kDeepSeekV3);
  EXPECT_FALSE(parsing(chat({{"tools", kTools}, {"tool_choice", "none"}})).tool_calls);
  EXPECT_FALSE(parsing(chat({{"tools", json::array()}})).tool_calls);
  EXPECT_FALSE(parsing(chat({})).tool_calls);
  EXPECT_FALSE(parsing(chat({{"tools", kTools}, {"parallel_tool_calls", false}})).parallel_tool_calls);
  expect_refused(chat({{"tools", kTools}, {"parallel_tool_calls", "no"}}), "parallel_tool_calls", "boolean");
  // The reasoning parser: every chat request.
  model_.reasoning_parser = true;
  EXPECT_TRUE(parsing(chat({})).reasoning);
  EXPECT_FALSE(parsing(chat({})).tool_calls);
  // Completions are never parsed.
  auto c = parse_completion_request(R"({"prompt": "hi"})", model_);
  ASSERT_TRUE(std::holds_alternative<GenerationRequest>(c));
  EXPECT_FALSE(std::get<GenerationRequest>(c).parsing.any());
}

GenerationRequest parsed_request(bool reasoning, bool tools, int n = 1) {
  GenerationRequest r;
  r.chat = true;
  r.n = n;
  r.prompts = {Prompt{{1}, "x"}};
  r.parsing.reasoning = reasoning;
  if (tools) r.parsing.tool_calls = ToolCallFormat::kDeepSeekV3;
  return r;
}

std::vector<ChoiceDelta> deltas(const std::vector<std::string>& pieces, const std::string& finish, int index = 0) {
  std::vector<ChoiceDelta> out;
  for (size_t i = 0; i < pieces.size(); ++i) {
    ChoiceDelta d;
    d.index = index;
    d.text = pieces[i];
    if (i + 1 == pieces.size()) d.finish_reason = finish;
    out.push_back(d);
  }
  return out;
}

const std::string kCall =
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

TEST(ChatResponseTest, ToolCallsWhole) {
  const GenerationRequest req = parsed_request(false, true);
  ResponseBuilder b(ResponseHeader{"chatcmpl-1", 0, "m"}, req, nullptr, 1);
  for (const auto& d : deltas({"Sure. ", kCall}, "stop")) b.add(d);
  const json choice = b.whole(1, 2)["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  const json& m = choice["message"];
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_EQ(m["content"], "Sure. ");
  EXPECT_FALSE(m.contains("reasoning_content"));
  ASSERT_EQ(m["tool_calls"].size(), 1u);
  const json& call = m["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_TRUE(call["id"].get<std::string>().starts_with("chatcmpl-tool-"));
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(call["function"]["arguments"], "{\"city\": \"Paris\"}");
  // Only calls: content is null; cut by max_tokens: finish_reason stays "length".
  ResponseBuilder cut(ResponseHeader{"chatcmpl-1", 0, "m"}, req, nullptr, 1);
  for (const auto& d : deltas({kCall.substr(0, 110)}, "length")) cut.add(d);
  const json c = cut.whole(1, 2)["choices"][0];
  EXPECT_EQ(c["finish_reason"], "length");
  EXPECT_TRUE(c["message"]["content"].is_null());
  EXPECT_EQ(c["message"]["tool_calls"][0]["function"]["name"], "get_weather");
}

TEST(ChatResponseTest, ToolCallsStreamed) {
  const GenerationRequest req = parsed_request(false, true);
  ResponseBuilder b(ResponseHeader{"chatcmpl-1", 0, "m"}, req, nullptr, 1);
  std::vector<json> chunks;
  // Byte by byte: the partial markers give no chunk.
  std::vector<std::string> pieces;
  const std::string text = "Sure. " + kCall;
  for (char c : text) pieces.emplace_back(1, c);
  for (const auto& d : deltas(pieces, "stop"))
    for (auto& c : b.chunks(d)) chunks.push_back(std::move(c));
  std::string content, arguments;
  int name_chunks = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const json& ch = chunks[i]["choices"][0];
    EXPECT_EQ(chunks[i]["object"], "chat.completion.chunk");
    EXPECT_EQ(ch["finish_reason"].is_null(), i + 1 < chunks.size()) << chunks[i];
    const json& d = ch["delta"];
    if (d.contains("content")) {
      EXPECT_EQ(name_chunks, 0) << "content after a tool call";
      content += d["content"].get<std::string>();
    }
    if (!d.contains("tool_calls")) continue;
    ASSERT_EQ(d["tool_calls"].size(), 1u);
    const json& t = d["tool_calls"][0];
    EXPECT_EQ(t["index"], 0);
    if (t.contains("id")) {
      ++name_chunks;
      EXPECT_EQ(t["type"], "function");
      EXPECT_EQ(t["function"]["name"], "get_weather");
      EXPECT_EQ(t["function"]["arguments"], "");
    } else {
      EXPECT_FALSE(t["function"].contains("name"));
      arguments += t["function"]["arguments"].get<std::string>();
    }
  }
  EXPECT_EQ(content, "Sure. ");
  EXPECT_EQ(name_chunks, 1);
  EXPECT_EQ(arguments, "{\"city\": \"Paris\"}");
  EXPECT_EQ(chunks.back()["choices"][0]["finish_reason"], "tool_calls");
}

TEST(ChatResponseTest, ReasoningWholeAndStreamed) {
  const GenerationRequest req = parsed_request(true, false, 2);
  ResponseBuilder whole(ResponseHeader{"chatcmpl-1", 0, "m"}, req, nullptr, 2);
  ResponseBuilder streamed(ResponseHeader{"chatcmpl-1", 0, "m"}, req, nullptr, 2);
  // Choice 0 ends its reasoning; choice 1 is cut off inside it.
  const std::vector<std::vector<std::string>> pieces = {{"Think", "ing.</th", "ink>", "Answer."}, {"Only </thi"}};
  std::vector<std::string> reasoning(2), content(2);
  for (int i = 0; i < 2; ++i)
    for (const auto& d : deltas(pieces[i], i == 0 ? "stop" : "length", i)) {
      whole.add(d);
      for (const auto& c : streamed.chunks(d)) {
        const json& delta = c["choices"][0]["delta"];
        EXPECT_EQ(delta.value("reasoning", ""), delta.value("reasoning_content", ""));
        reasoning[i] += delta.value("reasoning_content", "");
        content[i] += delta.value("content", "");
      }
    }
  const json w = whole.whole(1, 2);
  EXPECT_EQ(w["choices"][0]["message"]["reasoning_content"], "Thinking.");
  EXPECT_EQ(w["choices"][0]["message"]["reasoning"], "Thinking.");
  EXPECT_EQ(w["choices"][0]["message"]["content"], "Answer.");
  EXPECT_EQ(w["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(w["choices"][1]["message"]["reasoning_content"], "Only </thi");
  EXPECT_TRUE(w["choices"][1]["message"]["content"].is_null());
  EXPECT_EQ(w["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(reasoning[0], "Thinking.");
  EXPECT_EQ(content[0], "Answer.");
  EXPECT_EQ(reasoning[1], "Only </thi");
  EXPECT_EQ(content[1], "");
}

// A marker that is a special token stays in the text for the parser even
// with skip_special_tokens; other special tokens are still skipped.
TEST(ChatResponseTest, DetokenizerKeepsMarkerTokens) {
  auto tok = Tokenizer::load(testing::model_path("tiny-dsv3"));
  ASSERT_TRUE(tok.ok());
  const Tokenizer& t = **tok;
  const int32_t eot = *t.token_to_id("<|end_of_text|>"), pad = *t.token_to_id("<|pad|>");
  ASSERT_TRUE(t.is_special(eot) && t.is_special(pad));
  const std::vector<int32_t> a = t.encode("def", false);
  IncrementalDetokenizer d(t, {}, /*skip_special_tokens=*/true);
  d.keep_special({eot});
  std::string text;
  for (int32_t id : {a[0], eot, pad, a[0]}) text += d.add(id);
  text += d.finish();
  EXPECT_EQ(text, "def<|end_of_text|>def");
}

}  // namespace
}  // namespace nucleus::server
