// `nucleus serve` with --tool-call-parser / --enable-auto-tool-choice /
// --reasoning-parser on the tiny model. The tiny model writes no tool-call
// or </think> markers, so what is checked end to end is the server path:
// the flags, the refusals, normal text passing through the tool parser
// unchanged (whole, streamed, n > 1), and all of it becoming reasoning
// under the R1 parser (no </think>). The parsed shapes themselves are
// tests/unit/chat_parsing_test.cpp's and tool_parser_test.cpp's.
#include "server_util.h"

namespace nucleus {
namespace {

using namespace nucleus::testing;

const json kTools = json::array(
    {{{"type", "function"},
      {"function",
       {{"name", "get_weather"},
        {"description", "The weather in a city"},
        {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}});
const json kMessages = {{{"role", "user"}, {"content", "def add(a, b):"}}};

// The streamed chat deltas of one request, per choice index: each field's
// text joined, and the finish reasons.
struct ChatStream {
  int status = 0;
  bool done = false;
  std::map<int, std::map<std::string, std::string>> fields;  // index -> "content" / "reasoning_content" -> text
  std::map<int, std::vector<std::string>> finish;
};

ChatStream stream_chat(const ServerProcess& s, const json& body) {
  ChatStream out;
  auto res = s.client().Post("/v1/chat/completions", body.dump(), "application/json");
  if (!res) return out;
  out.status = res->status;
  std::string rest = res->body;
  size_t end;
  while ((end = rest.find("\n\n")) != std::string::npos) {
    const std::string payload = rest.substr(6, end - 6);  // after "data: "
    rest.erase(0, end + 2);
    if (payload == "[DONE]") {
      out.done = true;
      continue;
    }
    const json chunk = json::parse(payload);
    for (const auto& ch : chunk["choices"]) {
      const int i = ch["index"];
      for (const auto& [key, value] : ch["delta"].items())
        if (value.is_string()) out.fields[i][key] += value.get<std::string>();
      EXPECT_FALSE(ch["delta"].contains("tool_calls")) << chunk;
      if (!ch["finish_reason"].is_null()) out.finish[i].push_back(ch["finish_reason"]);
    }
  }
  return out;
}

// What the model writes for the chat prompt, through /v1/completions (never parsed).
std::vector<std::string> completions_text(const ServerProcess& s, const json& chat_body) {
  json tok = {{"messages", chat_body["messages"]}};
  if (chat_body.contains("tools")) tok["tools"] = chat_body["tools"];
  Reply ids = post(s, "/tokenize", tok);
  EXPECT_EQ(ids.status, 200) << ids.raw;
  json body = {{"prompt", ids.body["tokens"]}};
  for (const char* k : {"max_tokens", "temperature", "seed", "n", "stop"})
    if (chat_body.contains(k)) body[k] = chat_body[k];
  Reply r = post(s, "/v1/completions", body);
  EXPECT_EQ(r.status, 200) << r.raw;
  std::vector<std::string> out;
  for (const auto& c : r.body["choices"]) out.push_back(c["text"]);
  return out;
}

TEST(ServerParsersTest, ToolParserPassesTextThroughAndRefusesWhatItCannotEnforce) {
  ServerProcess s({"--tool-call-parser", "deepseek_v3", "--enable-auto-tool-choice"});
  ASSERT_TRUE(s.ready()) << s.log();
  for (const json& extra : {json{{"temperature", 0}}, json{{"temperature", 1.0}, {"seed", 7}, {"n", 3}},
                            json{{"temperature", 0}, {"stop", {"\n"}}}}) {
    json body = {{"messages", kMessages}, {"tools", kTools}, {"max_tokens", 12}};
    body.update(extra);
    const std::vector<std::string> expected = completions_text(s, body);
    Reply r = post(s, "/v1/chat/completions", body);
    ASSERT_EQ(r.status, 200) << r.raw;
    ASSERT_EQ(r.body["choices"].size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      const json& c = r.body["choices"][i];
      EXPECT_EQ(c["message"]["content"], expected[i].empty() ? json(nullptr) : json(expected[i])) << body;
      EXPECT_FALSE(c["message"].contains("tool_calls"));
      EXPECT_NE(c["finish_reason"], "tool_calls");
    }
    body["stream"] = true;
    ChatStream st = stream_chat(s, body);
    ASSERT_EQ(st.status, 200);
    EXPECT_TRUE(st.done);
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(st.fields[i]["content"], expected[i]);
      EXPECT_EQ(st.finish[i].size(), 1u);
    }
  }
  // tool_choice "none": rendered, not parsed; "required" and named: 400.
  Reply none = post(s, "/v1/chat/completions",
                    json{{"messages", kMessages}, {"tools", kTools}, {"tool_choice", "none"}, {"max_tokens", 4}});
  EXPECT_EQ(none.status, 200) << none.raw;
  for (const json& choice : {json("required"), json{{"type", "function"}, {"function", {{"name", "get_weather"}}}}}) {
    Reply r = post(s, "/v1/chat/completions",
                   json{{"messages", kMessages}, {"tools", kTools}, {"tool_choice", choice}, {"max_tokens", 4}});
    EXPECT_EQ(r.status, 400) << r.raw;
    EXPECT_EQ(r.body["error"]["param"], "tool_choice") << r.raw;
  }
}

TEST(ServerParsersTest, AutoToolChoiceNeedsTheFlag) {
  ServerProcess s({"--tool-call-parser", "kimi_k2"});
  ASSERT_TRUE(s.ready()) << s.log();
  Reply r = post(s, "/v1/chat/completions", json{{"messages", kMessages}, {"tools", kTools}, {"max_tokens", 4}});
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_EQ(r.body["error"]["param"], "tool_choice");
  EXPECT_NE(r.raw.find("--enable-auto-tool-choice"), std::string::npos) << r.raw;
  // Without tools nothing is parsed, and nothing is refused.
  EXPECT_EQ(post(s, "/v1/chat/completions", json{{"messages", kMessages}, {"max_tokens", 4}}).status, 200);
}

TEST(ServerParsersTest, ReasoningParserWithoutThinkEndIsAllReasoning) {
  ServerProcess s({"--reasoning-parser", "deepseek_r1", "--tool-call-parser", "deepseek_v31",
                   "--enable-auto-tool-choice"});
  ASSERT_TRUE(s.ready()) << s.log();
  json body = {{"messages", kMessages}, {"tools", kTools}, {"max_tokens", 10}, {"temperature", 0}};
  const std::vector<std::string> expected = completions_text(s, body);
  ASSERT_FALSE(expected[0].empty());
  Reply r = post(s, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  const json& m = r.body["choices"][0]["message"];
  EXPECT_EQ(m["reasoning_content"], expected[0]);
  EXPECT_EQ(m["reasoning"], expected[0]);
  EXPECT_TRUE(m["content"].is_null()) << m;
  body["stream"] = true;
  ChatStream st = stream_chat(s, body);
  ASSERT_EQ(st.status, 200);
  EXPECT_EQ(st.fields[0]["reasoning_content"], expected[0]);
  EXPECT_EQ(st.fields[0]["content"], "");  // the role chunk's "" only
}

TEST(ServerParsersTest, FlagErrors) {
  const std::string dir = make_temp_dir("nucleus_parsers");
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {binary(), "serve", "--device", "cpu", "--model", model_path("tiny-dsv3"),
                                     "--port", "0"};
    args.insert(args.end(), extra.begin(), extra.end());
    const int code = wait_exit(spawn(args, dir + "/log"), 30);
    return std::make_pair(code, read_file(dir + "/log"));
  };
  auto [code, log] = run({"--enable-auto-tool-choice"});
  EXPECT_EQ(code, 2) << "a usage error";
  EXPECT_NE(log.find("--enable-auto-tool-choice requires --tool-call-parser"), std::string::npos) << log;
  std::tie(code, log) = run({"--tool-call-parser", "hermes"});
  EXPECT_EQ(code, 2) << "a usage error";
  EXPECT_NE(log.find("--tool-call-parser"), std::string::npos) << log;
  std::tie(code, log) = run({"--reasoning-parser", "qwen3"});
  EXPECT_EQ(code, 2) << "a usage error";
  EXPECT_NE(log.find("--reasoning-parser"), std::string::npos) << log;
}

}  // namespace
}  // namespace nucleus
