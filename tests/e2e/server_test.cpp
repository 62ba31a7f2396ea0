// `nucleus serve` end to end: the binary runs as a child process on a free
// loopback port with the shipped tiny model; the tests talk HTTP to it.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "io/tokenizer.h"
#include "server_util.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using namespace nucleus::testing;

// A streamed request: the JSON payload of each "data:" event; `done` is
// whether "data: [DONE]" came last.
struct Stream {
  int status = 0;
  std::vector<json> chunks;
  bool done = false;
  std::string raw;
};

// Streams `body`; stops reading (and drops the connection) after
// `max_chunks` chunks when it is > 0.
Stream stream(const ServerProcess& s, const std::string& path, const json& body, int max_chunks = 0) {
  Stream out;
  httplib::Client c = s.client();
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  std::string buffer;
  req.response_handler = [&](const httplib::Response& r) {
    out.status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    out.raw.append(data, len);
    buffer.append(data, len);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
      const std::string payload = event.substr(6);
      EXPECT_FALSE(out.done) << "event after [DONE]: " << payload;
      if (payload == "[DONE]")
        out.done = true;
      else
        out.chunks.push_back(json::parse(payload));
    }
    return max_chunks <= 0 || static_cast<int>(out.chunks.size()) < max_chunks;
  };
  httplib::Response res;
  httplib::Error err;
  c.send(req, res, err);
  return out;
}

// Per choice index: the streamed text joined, and the finish reasons seen.
struct Joined {
  std::map<int, std::string> text;
  std::map<int, std::vector<std::string>> finish;
  json usage;
};

Joined join(const Stream& s, bool chat) {
  Joined j;
  for (const auto& c : s.chunks) {
    if (c.contains("usage") && c["usage"].is_object()) j.usage = c["usage"];
    for (const auto& ch : c["choices"]) {
      const int i = ch["index"].get<int>();
      EXPECT_TRUE(j.finish[i].empty()) << "chunk for index " << i << " after its finish_reason";
      if (chat) {
        if (ch["delta"].contains("content")) j.text[i] += ch["delta"]["content"].get<std::string>();
      } else {
        j.text[i] += ch["text"].get<std::string>();
      }
      if (!ch["finish_reason"].is_null()) j.finish[i].push_back(ch["finish_reason"].get<std::string>());
    }
  }
  return j;
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess();
    auto tok = Tokenizer::load(testing::model_path("tiny-dsv3"));
    ASSERT_TRUE(tok.ok());
    tokenizer_ = tok->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete tokenizer_;
  }
  void SetUp() override { ASSERT_TRUE(server_->ready()) << "server did not start:\n" << server_->log(); }
  const ServerProcess& s() const { return *server_; }
  std::map<std::string, double> metrics() const {
    auto res = s().client().Get("/metrics");
    EXPECT_TRUE(res && res->status == 200);
    return res ? parse_metrics(res->body) : std::map<std::string, double>{};
  }

  static ServerProcess* server_;
  static Tokenizer* tokenizer_;
};
ServerProcess* ServerTest::server_ = nullptr;
Tokenizer* ServerTest::tokenizer_ = nullptr;

json ref_cases() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  return json::parse(in)["tiny-dsv3"];
}

TEST_F(ServerTest, GreedyCompletionsMatchReference) {
  const json cases = ref_cases();
  json prompts = json::array();
  for (const auto& c : cases) prompts.push_back(c["prompt"]);
  // All prompts in one request (a list of strings) ...
  Reply r = post(s(), "/v1/completions",
                 json{{"prompt", prompts}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_EQ(r.body["choices"].size(), cases.size());
  int64_t prompt_tokens = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(r.body["choices"][i]["index"], i);
    EXPECT_EQ(r.body["choices"][i]["text"], cases[i]["greedy_text"]) << i;
    EXPECT_EQ(r.body["choices"][i]["finish_reason"], "length") << i;
    prompt_tokens += cases[i]["prompt_token_ids"].size();
  }
  EXPECT_EQ(r.body["object"], "text_completion");
  EXPECT_EQ(r.body["model"], "tiny-dsv3");
  EXPECT_EQ(r.body["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(r.body["usage"]["completion_tokens"], 32 * cases.size());
  EXPECT_EQ(r.body["usage"]["total_tokens"], prompt_tokens + 32 * cases.size());
  // ... a token-id prompt, and a list of token-id lists.
  r = post(
      s(), "/v1/completions",
      json{{"prompt", cases[1]["prompt_token_ids"]}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body["choices"][0]["text"], cases[1]["greedy_text"]);
  EXPECT_EQ(r.body["usage"]["prompt_tokens"], cases[1]["prompt_token_ids"].size());
  r = post(s(), "/v1/completions",
           json{{"prompt", {cases[6]["prompt_token_ids"], cases[0]["prompt_token_ids"]}},
                {"max_tokens", 32},
                {"temperature", 0},
                {"ignore_eos", true},
                {"model", testing::model_path("tiny-dsv3")}});  // the --model string is a name too
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body["choices"][0]["text"], cases[6]["greedy_text"]);
  EXPECT_EQ(r.body["choices"][1]["text"], cases[0]["greedy_text"]);
}

TEST_F(ServerTest, ModelsAndHealth) {
  auto res = s().client().Get("/v1/models");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  json j = json::parse(res->body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "tiny-dsv3");
  EXPECT_EQ(j["data"][0]["max_model_len"], 1024);
  res = s().client().Get("/health");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

// vLLM's /tokenize and /detokenize: the tokenizer's ids for a text or the
// rendered chat, and the text of ids.
TEST_F(ServerTest, TokenizeAndDetokenize) {
  Reply r = post(s(), "/tokenize", json{{"prompt", "def fibonacci(n):"}});
  ASSERT_EQ(r.status, 200) << r.raw;
  const std::vector<int32_t> ids = tokenizer_->encode("def fibonacci(n):", true);
  EXPECT_EQ(r.body["tokens"].get<std::vector<int32_t>>(), ids);
  EXPECT_EQ(r.body["count"], ids.size());
  EXPECT_EQ(r.body["max_model_len"], 1024);
  EXPECT_TRUE(r.body["token_strs"].is_null());
  r = post(s(), "/tokenize", json{{"prompt", "def"}, {"add_special_tokens", false}});
  EXPECT_EQ(r.body["tokens"].get<std::vector<int32_t>>(), tokenizer_->encode("def", false));
  r = post(s(), "/tokenize", json{{"prompt", "def fibonacci(n):"}, {"return_token_strs", true}});
  ASSERT_EQ(r.body["token_strs"].size(), ids.size()) << r.raw;
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(r.body["token_strs"][i], tokenizer_->id_to_token(ids[i])) << i;
  const json messages = {{{"role", "user"}, {"content", "hi"}}};
  r = post(s(), "/tokenize", json{{"messages", messages}});
  ASSERT_EQ(r.status, 200) << r.raw;
  Reply chat = post(s(), "/v1/chat/completions", json{{"messages", messages}, {"max_tokens", 1}});
  EXPECT_EQ(r.body["count"], chat.body["usage"]["prompt_tokens"]);
  r = post(s(), "/detokenize", json{{"tokens", ids}});
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["prompt"], tokenizer_->decode(ids));
  EXPECT_EQ(post(s(), "/detokenize", json{{"tokens", {1, 99999}}}).status, 400);
  EXPECT_EQ(post(s(), "/tokenize", json{{"prompt", 5}}).status, 400);
  EXPECT_EQ(post(s(), "/tokenize", json{{"prompt", "x"}, {"model", "gpt-4"}}).status, 404);
  EXPECT_EQ(s().client().Get("/tokenize")->status, 405);
}

TEST_F(ServerTest, ChatCompletionUsesTheTemplate) {
  const json messages = {{{"role", "system"}, {"content", "You write Python."}},
                         {{"role", "user"}, {"content", "def add(a, b):"}}};
  Reply r = post(s(), "/v1/chat/completions",
                 json{{"model", "tiny-dsv3"}, {"messages", messages}, {"max_tokens", 12}, {"temperature", 0}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body["object"], "chat.completion");
  const json& choice = r.body["choices"][0];
  EXPECT_EQ(choice["message"]["role"], "assistant");
  ASSERT_TRUE(choice["message"]["content"].is_string());
  const std::string finish = choice["finish_reason"];
  EXPECT_TRUE(finish == "stop" || finish == "length") << finish;
  // The tiny model's template, rendered by hand; chat prompts get no BOS.
  const auto ids = tokenizer_->encode("<|system|>You write Python.\n<|user|>def add(a, b):\n<|assistant|>", false);
  EXPECT_EQ(r.body["usage"]["prompt_tokens"], ids.size());
  const int64_t completion = r.body["usage"]["completion_tokens"];
  EXPECT_GE(completion, 1);
  EXPECT_LE(completion, 12);
  EXPECT_EQ(r.body["usage"]["total_tokens"], ids.size() + completion);
  // The same tokens through /v1/completions give the same text.
  Reply c = post(s(), "/v1/completions", json{{"prompt", ids}, {"max_tokens", 12}, {"temperature", 0}});
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(c.body["choices"][0]["text"], choice["message"]["content"]);
  EXPECT_FALSE(choice["message"]["content"].get<std::string>().empty());
  // Streamed: the role first, then content deltas, the same text.
  Stream st = stream(s(), "/v1/chat/completions",
                     json{{"messages", messages}, {"max_tokens", 12}, {"temperature", 0}, {"stream", true}});
  ASSERT_EQ(st.status, 200);
  ASSERT_TRUE(st.done);
  ASSERT_FALSE(st.chunks.empty());
  EXPECT_EQ(st.chunks[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(st.chunks[0]["choices"][0]["delta"]["role"], "assistant");
  Joined j = join(st, /*chat=*/true);
  EXPECT_EQ(j.text[0], choice["message"]["content"]);
  EXPECT_EQ(j.finish[0], std::vector<std::string>{finish});
}

TEST_F(ServerTest, StreamingEqualsNonStreaming) {
  const json cases = ref_cases();
  json body = {
      {"prompt", cases[2]["prompt"]}, {"max_tokens", 24}, {"temperature", 0.8}, {"seed", 1234}, {"ignore_eos", true}};
  Reply whole = post(s(), "/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  Stream st = stream(s(), "/v1/completions", body);
  ASSERT_EQ(st.status, 200);
  EXPECT_TRUE(st.done);
  Joined j = join(st, false);
  EXPECT_EQ(j.text[0], whole.body["choices"][0]["text"]);
  EXPECT_EQ(j.finish[0], std::vector<std::string>{"length"});
  EXPECT_EQ(j.usage, whole.body["usage"]);
  // include_usage: the usage comes alone in the last chunk, every other has null.
  EXPECT_TRUE(st.chunks.back()["choices"].empty());
  for (size_t i = 0; i + 1 < st.chunks.size(); ++i) EXPECT_TRUE(st.chunks[i]["usage"].is_null());
  // Without stream_options there is no usage chunk.
  body.erase("stream_options");
  Stream plain = stream(s(), "/v1/completions", body);
  EXPECT_EQ(join(plain, false).text[0], whole.body["choices"][0]["text"]);
  for (const auto& c : plain.chunks) EXPECT_FALSE(c.contains("usage"));
}

TEST_F(ServerTest, NChoicesStreamOneFinishPerIndex) {
  const json body = {{"prompt", "import numpy as np\n"},
                     {"max_tokens", 10},
                     {"temperature", 0.8},
                     {"seed", 5},
                     {"n", 3},
                     {"ignore_eos", true},
                     {"stream", true}};
  Stream st = stream(s(), "/v1/completions", body);
  ASSERT_EQ(st.status, 200);
  EXPECT_TRUE(st.done);
  Joined j = join(st, false);  // also checks nothing follows a finish_reason for its index
  ASSERT_EQ(j.finish.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(j.finish[i], std::vector<std::string>{"length"}) << i;
  // Non-streamed, the same texts; choice i is the request with seed 5 + i.
  json b = body;
  b["stream"] = false;
  Reply whole = post(s(), "/v1/completions", b);
  ASSERT_EQ(whole.status, 200);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(whole.body["choices"][i]["text"], j.text[i]) << i;
  b["n"] = 1;
  b["seed"] = 7;
  Reply third = post(s(), "/v1/completions", b);
  EXPECT_EQ(third.body["choices"][0]["text"], whole.body["choices"][2]["text"]);
  EXPECT_EQ(whole.body["usage"]["completion_tokens"], 30);
}

TEST_F(ServerTest, BadInputsAre400NamingTheField) {
  struct Case {
    std::string path, body;
    int status;
    std::string param;    // "" : null
    std::string message;  // a part of the message
  };
  const std::string c = "/v1/completions", chat = "/v1/chat/completions";
  std::string long_prompt = "[";
  for (int i = 0; i < 1100; ++i) long_prompt += (i ? ",5" : "5");
  long_prompt += "]";
  const std::vector<Case> cases = {
      {c, "{not json", 400, "", "JSON"},
      {c, R"([1, 2])", 400, "", "object"},
      {c, R"({"prompt": 5})", 400, "prompt", "prompt"},
      {c, R"({"prompt": "x", "max_tokens": "ten"})", 400, "max_tokens", "integer"},
      {c, R"({"prompt": "x", "temperature": "hot"})", 400, "temperature", "number"},
      // Past int64 (it aliased the negative seeds): refused as vLLM refuses it.
      {c, R"({"prompt": "x", "seed": 18446744073709551615})", 400, "seed", "integer"},
      // Two constraints in one object are named by their keys (the message said "'structured_outputs' and
      // 'structured_outputs'").
      {c, R"({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}})", 400, "structured_outputs",
       "'structured_outputs.choice' and 'structured_outputs.regex'"},
      {c, R"({"prompt": "x", "stream": "yes"})", 400, "stream", "boolean"},
      {c, R"({"prompt": "x", "stop": 3})", 400, "stop", "stop"},
      {c, R"({"prompt": "x", "max_tokens": 0})", 400, "max_tokens", ">= 1"},
      {c, R"({"prompt": "x", "max_tokens": 1023})", 400, "max_tokens", "maximum context length"},
      {c, R"({"prompt": ""})", 400, "prompt", "empty"},
      {c, R"({"prompt": []})", 400, "prompt", "empty"},
      {c, R"({"prompt": [[]]})", 400, "prompt", "empty"},
      {c, R"({"max_tokens": 4})", 400, "prompt", "required"},
      {c, R"({"prompt": [0, 5000]})", 400, "prompt", "vocabulary"},
      {c, R"({"prompt": [[1, 2], [-3]]})", 400, "prompt", "vocabulary"},
      {c, R"({"prompt": )" + long_prompt + "}", 400, "prompt", "maximum context length"},
      {c, R"({"prompt": "x", "model": "gpt-4"})", 404, "model", "gpt-4"},
      {c, R"({"prompt": "x", "temperature": -0.5})", 400, "temperature", "temperature"},
      {c, R"({"prompt": "x", "top_p": 0})", 400, "top_p", "top_p"},
      {c, R"({"prompt": "x", "top_p": 1.5})", 400, "top_p", "top_p"},
      {c, R"({"prompt": "x", "n": 257})", 400, "n", "n"},
      {c, R"({"prompt": "x", "n": 0})", 400, "n", "n"},
      {c, R"({"prompt": "x", "logprobs": 21})", 400, "logprobs", "logprobs"},
      {c, R"({"prompt": "x", "prompt_logprobs": 21})", 400, "prompt_logprobs", "prompt_logprobs"},
      {c, R"({"prompt": "x", "prompt_logprobs": 1, "stream": true})", 400, "prompt_logprobs", "stream"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1})", 400, "prompt_logprobs",
       "prompt_logprobs"},
      {c, R"({"prompt": "x", "stream_options": {"include_usage": true}})", 400, "stream_options", "stream"},
      {chat, R"({"messages": "hi"})", 400, "messages", "messages"},
      {chat, R"({"messages": [{"content": "hi"}]})", 400, "messages", "role"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0})", 400,
       "max_completion_tokens", ">= 1"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "top_p": 2})", 400, "top_p", "top_p"},
      // vLLM's sampling parameters: out of range is a 400 naming them.
      {c, R"({"prompt": "x", "min_p": 1.1})", 400, "min_p", "min_p"},
      {c, R"({"prompt": "x", "presence_penalty": -2.1})", 400, "presence_penalty", "presence_penalty"},
      {c, R"({"prompt": "x", "frequency_penalty": 3})", 400, "frequency_penalty", "frequency_penalty"},
      {c, R"({"prompt": "x", "repetition_penalty": 0})", 400, "repetition_penalty", "repetition_penalty"},
      {c, R"({"prompt": "x", "min_tokens": 17})", 400, "min_tokens", "max_tokens"},
      {c, R"({"prompt": "x", "min_tokens": 2, "stop": ["a"]})", 400, "min_tokens", "stop"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}})", 400,
       "chat_template_kwargs", "messages"},
      {c, R"({"prompt": "x", "logit_bias": {"5000": 5}})", 400, "logit_bias", "token id 5000"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 5}})", 400, "logit_bias",
       "'x'"},
      // Structured output: what cannot be compiled or served names its field.
#ifdef NUCLEUS_HAVE_XGRAMMAR
      {c, R"({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}})",
       400, "response_format", "nonsense"},
      {c, R"({"prompt": "x", "structured_outputs": {"regex": "([a-"}})", 400, "structured_outputs", "compiled"},
      {c, R"({"prompt": "x", "guided_choice": ["a"], "min_tokens": 2})", 400, "min_tokens", "structured output"},
#endif
      {c, R"({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}})", 400,
       "response_format", "schema"},
      {c, R"({"prompt": "x", "response_format": {"type": "structural_tag"}})", 400, "response_format", "type"},
      {c, R"({"prompt": "x", "response_format": "json"})", 400, "response_format", "object"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}, "guided_regex": "a+"})",
       400, "guided_regex", "Only one"},
      {c, R"({"prompt": "x", "structured_outputs": {"structural_tag": "{}"}})", 400, "structured_outputs",
       "structural_tag"},
      {c, R"({"prompt": "x", "guided_choice": []})", 400, "guided_choice", "non-empty"},
      {c, R"({"prompt": "x", "guided_json": {"type": "object"}, "guided_decoding_backend": "outlines"})", 400,
       "guided_decoding_backend", "outlines"},
      // Served by vLLM, not here: refused by name, never silently ignored.
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "echo": true})", 400, "echo", "echo"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true})", 400,
       "continue_final_message", "continue_final_message"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"})", 400,
       "reasoning_effort", "reasoning_effort"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"})", 400, "tool_choice",
       "tool_choice"},
  };
  for (const auto& k : cases) {
    Reply r = post(s(), k.path, k.body);
    EXPECT_EQ(r.status, k.status) << k.body << "\n" << r.body;
    ASSERT_TRUE(r.body.is_object() && r.body.contains("error")) << k.body << "\n" << r.body;
    const json& e = r.body["error"];
    EXPECT_EQ(e["type"], "invalid_request_error") << k.body;
    if (k.param.empty())
      EXPECT_TRUE(e["param"].is_null()) << k.body << "\n" << e;
    else
      EXPECT_EQ(e["param"], k.param) << k.body << "\n" << e;
    EXPECT_NE(e["message"].get<std::string>().find(k.message), std::string::npos) << k.body << "\n" << e;
    EXPECT_TRUE(e.contains("code"));
    auto health = s().client().Get("/health");
    ASSERT_TRUE(health) << "server gone after " << k.body;
    EXPECT_EQ(health->status, 200);
  }
  // Unknown routes: 404 with an error body.
  auto res = s().client().Post("/v1/nothing", "{}", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_TRUE(json::parse(res->body).contains("error"));
  // Known routes with the wrong method: 405 naming the allowed one.
  res = s().client().Get("/v1/completions");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 405);
  EXPECT_EQ(res->get_header_value("Allow"), "POST");
  EXPECT_NE(json::parse(res->body)["error"]["message"].get<std::string>().find("GET /v1/completions"),
            std::string::npos);
  res = s().client().Post("/health", "{}", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 405);
  EXPECT_EQ(res->get_header_value("Allow"), "GET");
  // A refused request does not disturb the next one.
  Reply ok = post(s(), c, json{{"prompt", "x = 1"}, {"max_tokens", 2}});
  EXPECT_EQ(ok.status, 200);
}

// Text and token boundaries (byte offsets) of a greedy continuation.
struct Greedy {
  std::string text;
  std::vector<size_t> boundaries;
};

class StopStringTest : public ServerTest {
 protected:
  // Checks `stop` on `body`: the text ends right before its first occurrence
  // in `full`, finish_reason "stop", and the stream carries no part of it.
  void check_stop(json body, const std::string& full, const std::string& stop) {
    const size_t at = full.find(stop);
    ASSERT_NE(at, std::string::npos);
    const std::string expected = full.substr(0, at);
    body["stop"] = {stop};
    Reply r = post(s(), "/v1/completions", body);
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.body["choices"][0]["text"], expected) << "stop " << stop;
    EXPECT_EQ(r.body["choices"][0]["finish_reason"], "stop");
    EXPECT_LT(r.body["usage"]["completion_tokens"].get<int>(), body["max_tokens"].get<int>());
    body["stream"] = true;
    Stream st = stream(s(), "/v1/completions", body);
    ASSERT_TRUE(st.done);
    Joined j = join(st, false);
    EXPECT_EQ(j.text[0], expected);  // so no chunk held any of the stop string
    EXPECT_EQ(j.finish[0], std::vector<std::string>{"stop"});
    for (const auto& c : st.chunks)
      for (const auto& ch : c["choices"]) {
        const std::string t = ch["text"];
        EXPECT_EQ(t.find(stop), std::string::npos);
      }
  }
  Greedy greedy(const json& prompt, int max_tokens) {
    Reply r = post(
        s(), "/v1/completions",
        json{
            {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}, {"logprobs", 0}});
    EXPECT_EQ(r.status, 200) << r.body;
    Greedy g;
    g.text = r.body["choices"][0]["text"];
    for (const auto& off : r.body["choices"][0]["logprobs"]["text_offset"]) g.boundaries.push_back(off);
    return g;
  }
};

TEST_F(StopStringTest, StopStringSplitAcrossTokens) {
  const json cases = ref_cases();
  const std::string full = cases[0]["greedy_text"];
  Greedy g = greedy(cases[0]["prompt"], 32);
  ASSERT_EQ(g.text, full);
  ASSERT_GE(g.boundaries.size(), 4u);
  // Five bytes around the end of the third token: the detokenizer must hold
  // back the first part until the next token completes it.
  const size_t b = g.boundaries[3];
  ASSERT_GE(b, 3u);
  const std::string stop = full.substr(b - 3, 5);
  const size_t at = full.find(stop);
  bool straddles = false;
  for (size_t x : g.boundaries) straddles = straddles || (x > at && x < at + stop.size());
  ASSERT_TRUE(straddles) << "'" << stop << "' lies inside one token";
  check_stop(json{{"prompt", cases[0]["prompt"]}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}}, full,
             stop);
}

TEST_F(StopStringTest, MultiByteStopString) {
  const std::string prompt =
      "# \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e "
      "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e";  // 日本語 x4
  Greedy g = greedy(prompt, 32);
  // The first multi-byte UTF-8 character of the continuation.
  size_t i = 0;
  while (i < g.text.size() && static_cast<unsigned char>(g.text[i]) < 0x80) ++i;
  ASSERT_LT(i, g.text.size()) << "no multi-byte character in: " << g.text;
  size_t len = 1;
  while (i + len < g.text.size() && (static_cast<unsigned char>(g.text[i + len]) & 0xC0) == 0x80) ++len;
  ASSERT_GE(len, 2u);
  const std::string stop = g.text.substr(i, len);
  check_stop(json{{"prompt", prompt}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}}, g.text, stop);
  // With the ASCII text before it: a stop string that starts in one token and
  // ends inside a multi-byte one.
  if (i >= 2)
    check_stop(json{{"prompt", prompt}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}}, g.text,
               g.text.substr(i - 2, len + 2));
}

// Structured output on the random tiny model at temperature 1: every choice
// follows its grammar (JSON that matches the schema, a regex, a choice) and
// finishes with "stop"; streamed text equals the whole response's. Compact
// JSON (disable_any_whitespace) keeps the outputs short: a random model
// otherwise pads JSON with whitespace (openai_client_test.py covers that).
TEST_F(ServerTest, StructuredOutputFollowsTheGrammar) {
#ifndef NUCLEUS_HAVE_XGRAMMAR
  GTEST_SKIP() << "built without xgrammar (-DNUCLEUS_XGRAMMAR=OFF)";
#endif
  const json schema = json::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": -5, "maximum": 500},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
      "required": ["name", "n"], "additionalProperties": false})");
  const json body = {{"prompt", "JSON:"},
                     {"max_tokens", 120},
                     {"temperature", 1},
                     {"seed", 3},
                     {"n", 6},
                     {"structured_outputs", {{"json", schema}, {"disable_any_whitespace", true}}}};
  Reply r = post(s(), "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  ASSERT_EQ(r.body["choices"].size(), 6u);
  std::map<int, std::string> whole;
  for (const auto& ch : r.body["choices"]) {
    const std::string text = ch["text"];
    whole[ch["index"].get<int>()] = text;
    EXPECT_EQ(ch["finish_reason"], "stop") << text;
    const json j = json::parse(text, nullptr, false);
    ASSERT_TRUE(j.is_object()) << text;
    for (const auto& [k, v] : j.items()) EXPECT_TRUE(k == "name" || k == "n" || k == "tags") << text;
    ASSERT_TRUE(j.contains("name") && j["name"].is_string()) << text;
    ASSERT_TRUE(j.contains("n") && j["n"].is_number_integer()) << text;
    EXPECT_TRUE(j["n"].get<int64_t>() >= -5 && j["n"].get<int64_t>() <= 500) << text;
    if (j.contains("tags")) {
      EXPECT_LE(j["tags"].size(), 2u) << text;
      for (const auto& t : j["tags"]) EXPECT_TRUE(t == "a" || t == "b") << text;
    }
  }
  json sbody = body;
  sbody["stream"] = true;
  Stream st = stream(s(), "/v1/completions", sbody);
  ASSERT_EQ(st.status, 200);
  std::map<int, std::string> streamed;
  for (const auto& ch : st.chunks)
    for (const auto& c : ch["choices"]) streamed[c["index"].get<int>()] += c["text"].get<std::string>();
  EXPECT_EQ(streamed, whole);
  // A regex and a choice list (vLLM's older field names), on chat.
  const json messages = json::array({{{"role", "user"}, {"content", "pick"}}});
  for (int seed = 0; seed < 4; ++seed) {
    Reply re = post(s(), "/v1/chat/completions",
                    json{{"messages", messages}, {"temperature", 1}, {"seed", seed}, {"max_tokens", 30},
                         {"guided_regex", "[0-9]{2}-[a-z]{1,3}"}});
    ASSERT_EQ(re.status, 200) << re.raw;
    const std::string text = re.body["choices"][0]["message"]["content"];
    EXPECT_TRUE(std::regex_match(text, std::regex("[0-9]{2}-[a-z]{1,3}"))) << text;
    Reply rc = post(s(), "/v1/chat/completions",
                    json{{"messages", messages}, {"temperature", 1}, {"seed", seed}, {"max_tokens", 30},
                         {"guided_choice", {"red", "green", "blue"}}});
    ASSERT_EQ(rc.status, 200) << rc.raw;
    const std::string pick = rc.body["choices"][0]["message"]["content"];
    EXPECT_TRUE(pick == "red" || pick == "green" || pick == "blue") << pick;
    EXPECT_EQ(rc.body["choices"][0]["finish_reason"], "stop");
  }
  // Masked tokens have log-probability -inf, reported as -9999.0 (as vLLM): never null.
  Reply lp = post(s(), "/v1/completions",
                  json{{"prompt", "x"}, {"max_tokens", 5}, {"logprobs", 3}, {"guided_choice", {"yes", "no"}}});
  ASSERT_EQ(lp.status, 200) << lp.raw;
  const json& tops = lp.body["choices"][0]["logprobs"]["top_logprobs"];
  ASSERT_FALSE(tops.empty());
  bool clamped = false;
  for (const auto& top : tops)
    for (const auto& [token, value] : top.items()) {
      ASSERT_TRUE(value.is_number()) << lp.raw;
      clamped = clamped || value.get<double>() == -9999.0;
    }
  EXPECT_TRUE(clamped) << lp.raw;
}

TEST_F(ServerTest, LogprobsAreReported) {
  Reply r = post(
      s(), "/v1/completions",
      json{{"prompt", "def main():\n"}, {"max_tokens", 4}, {"temperature", 0}, {"logprobs", 3}, {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  const json& lp = r.body["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 4u);
  ASSERT_EQ(lp["token_logprobs"].size(), 4u);
  ASSERT_EQ(lp["top_logprobs"].size(), 4u);
  ASSERT_EQ(lp["text_offset"].size(), 4u);
  std::string joined;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(lp["text_offset"][i], joined.size());
    joined += lp["tokens"][i].get<std::string>();
    const double chosen = lp["token_logprobs"][i];
    EXPECT_LE(chosen, 0.0);
    EXPECT_GE(lp["top_logprobs"][i].size(), 1u);
    for (const auto& [tok, v] : lp["top_logprobs"][i].items()) EXPECT_LE(v.get<double>(), chosen + 1e-6);  // greedy
  }
  EXPECT_EQ(joined, r.body["choices"][0]["text"]);
}

// echo with logprobs (lm-eval's loglikelihood requests): the prompt's tokens
// first, the first unscored; streamed the same as whole; max_tokens 0 gives
// the prompt alone; prompt_logprobs agrees.
TEST_F(ServerTest, EchoLogprobsReportThePrompt) {
  const std::vector<int32_t> ids = tokenizer_->encode("def main():\n    return 1\n", true);
  const json body = {{"prompt", ids}, {"max_tokens", 3}, {"temperature", 0}, {"logprobs", 2}, {"echo", true},
                     {"ignore_eos", true}, {"n", 2}};
  Reply whole = post(s(), "/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json& choice = whole.body["choices"][1];
  const json& lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size() + 3);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  std::string joined;
  for (size_t i = 0; i < ids.size() + 3; ++i) {
    if (i < ids.size()) {
      EXPECT_EQ(lp["tokens"][i], tokenizer_->token_bytes(ids[i])) << i;
    }
    EXPECT_EQ(lp["text_offset"][i], joined.size()) << i;  // ASCII: characters are bytes
    const bool skipped = i < ids.size() && tokenizer_->is_special(ids[i]);  // the BOS
    if (!skipped) joined += lp["tokens"][i].get<std::string>();
    if (i == 0) continue;
    EXPECT_LE(lp["top_logprobs"][i].size(), 3u);
    EXPECT_GE(lp["top_logprobs"][i].size(), 2u);
  }
  EXPECT_EQ(joined, choice["text"]);
  EXPECT_EQ(choice["text"].get<std::string>().substr(0, 25), "def main():\n    return 1\n");
  EXPECT_EQ(whole.body["usage"]["completion_tokens"], 6);

  json b = body;
  b["stream"] = true;
  Stream st = stream(s(), "/v1/completions", b);
  ASSERT_EQ(st.status, 200);
  std::map<int, json> streamed;
  for (const auto& c : st.chunks)
    for (const auto& ch : c["choices"]) {
      json& acc = streamed[ch["index"].get<int>()];
      if (acc.is_null()) acc = {{"text", ""}, {"logprobs", json::object()}};
      acc["text"] = acc["text"].get<std::string>() + ch["text"].get<std::string>();
      if (ch["logprobs"].is_object())
        for (const auto& [k, v] : ch["logprobs"].items())
          for (const auto& x : v) acc["logprobs"][k].push_back(x);
    }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(streamed[i]["text"], whole.body["choices"][i]["text"]) << i;
    EXPECT_EQ(streamed[i]["logprobs"], whole.body["choices"][i]["logprobs"]) << i;
  }

  b = body;
  b["max_tokens"] = 0;
  b["n"] = 1;
  b["prompt_logprobs"] = 1;
  Reply only = post(s(), "/v1/completions", b);
  ASSERT_EQ(only.status, 200) << only.body;
  const json& o = only.body["choices"][0];
  EXPECT_EQ(o["logprobs"]["tokens"].size(), ids.size());
  EXPECT_EQ(o["finish_reason"], "length");
  EXPECT_EQ(only.body["usage"]["completion_tokens"], 0);
  EXPECT_EQ(o["text"], tokenizer_->decode(ids, true));
  // The same numbers as the echoed prompt of the generating request.
  for (size_t i = 1; i < ids.size(); ++i) {
    EXPECT_EQ(o["logprobs"]["token_logprobs"][i], lp["token_logprobs"][i]) << i;
    const json& entry = o["prompt_logprobs"][i][std::to_string(ids[i])];
    EXPECT_EQ(entry["logprob"], lp["token_logprobs"][i]) << i;
    EXPECT_EQ(entry["decoded_token"], tokenizer_->token_bytes(ids[i])) << i;
    EXPECT_GE(entry["rank"].get<int64_t>(), 1);
  }
  EXPECT_TRUE(o["prompt_logprobs"][0].is_null());
  EXPECT_EQ(o["prompt_logprobs"].size(), ids.size());
}

TEST_F(ServerTest, MetricsCountWhatWasSent) {
  // The HTTP counters are bumped after a response's last byte: an earlier
  // test's last request may still be counted. Start from counters that have
  // stopped moving (two reads 50 ms apart agree).
  const std::string completions_200 = "nucleus_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"}";
  auto before = metrics();
  for (int i = 0; i < 40; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto again = metrics();
    const bool settled = again[completions_200] == before[completions_200];
    before = std::move(again);
    if (settled) break;
  }
  ASSERT_TRUE(before.count("nucleus_kv_blocks_total"));
  EXPECT_GT(before["nucleus_kv_blocks_total"], 0);
  int64_t prompt = 0, completion = 0;
  for (const char* p : {"a = 1\n", "import sys\n"}) {
    Reply r = post(s(), "/v1/completions", json{{"prompt", p}, {"max_tokens", 5}, {"ignore_eos", true}});
    ASSERT_EQ(r.status, 200);
    prompt += r.body["usage"]["prompt_tokens"].get<int64_t>();
    completion += r.body["usage"]["completion_tokens"].get<int64_t>();
  }
  Stream st = stream(s(), "/v1/completions",
                     json{{"prompt", "x"},
                          {"max_tokens", 3},
                          {"n", 2},
                          {"ignore_eos", true},
                          {"stream", true},
                          {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(st.done);
  Joined j = join(st, false);
  prompt += j.usage["prompt_tokens"].get<int64_t>();
  completion += j.usage["completion_tokens"].get<int64_t>();
  EXPECT_EQ(post(s(), "/v1/completions", json{{"prompt", ""}}).status, 400);

  const std::string ok = "nucleus_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"}";
  const std::string bad = "nucleus_http_requests_total{endpoint=\"/v1/completions\",status=\"400\"}";
  // The HTTP counters are bumped by the connection's thread after the last
  // byte, so the client can see a response before its count: wait for both.
  std::map<std::string, double> after;
  for (int i = 0; i < 100; ++i) {
    after = metrics();
    if (after[ok] - before[ok] >= 3 && after[bad] - before[bad] >= 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto delta = [&](const std::string& k) { return after[k] - before[k]; };
  EXPECT_EQ(delta("nucleus_requests_finished_total{finish_reason=\"length\"}"), 4);
  EXPECT_EQ(delta("nucleus_requests_finished_total{finish_reason=\"stop\"}"), 0);
  EXPECT_EQ(delta("nucleus_prompt_tokens_total"), prompt);
  EXPECT_EQ(delta("nucleus_generation_tokens_total"), completion);
  EXPECT_EQ(completion, 16);
  EXPECT_EQ(delta("nucleus_time_to_first_token_seconds_count"), 4);
  EXPECT_EQ(delta("nucleus_e2e_request_latency_seconds_count"), 4);
  EXPECT_EQ(delta("nucleus_time_per_output_token_seconds_count"), 4 + 4 + 2 + 2);  // tokens after the first
  EXPECT_EQ(delta("nucleus_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), 4);
  EXPECT_EQ(delta(ok), 3);
  EXPECT_EQ(delta(bad), 1);
  EXPECT_EQ(after["nucleus_kv_blocks_used"], 0);
  EXPECT_EQ(after["nucleus_num_requests_running"], 0);
  EXPECT_EQ(after["nucleus_num_requests_waiting"], 0);
}

TEST_F(ServerTest, DisconnectedStreamIsAbortedAndFreesItsBlocks) {
  auto before = metrics();
  Stream st = stream(s(), "/v1/completions",
                     json{{"prompt", "def f(x):\n"}, {"max_tokens", 900}, {"ignore_eos", true}, {"stream", true}},
                     /*max_chunks=*/3);
  ASSERT_EQ(st.chunks.size(), 3u);
  EXPECT_FALSE(st.done);
  std::map<std::string, double> after;
  const std::string abort = "nucleus_requests_finished_total{finish_reason=\"abort\"}";
  for (int i = 0; i < 250; ++i) {  // 5 s at most; 900 tokens would take far longer
    after = metrics();
    if (after[abort] - before[abort] >= 1 && after["nucleus_kv_blocks_used"] == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(after[abort] - before[abort], 1);
  EXPECT_EQ(after["nucleus_kv_blocks_used"], 0);
  EXPECT_EQ(after["nucleus_num_requests_running"], 0);
  EXPECT_LT(after["nucleus_generation_tokens_total"] - before["nucleus_generation_tokens_total"], 900);
  auto health = s().client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST_F(ServerTest, BenchServeReportsEveryRequest) {
  const std::string dir = testing::make_temp_dir("nucleus_bench");
  const std::string result = dir + "/result.json";
  const pid_t pid = spawn(
      {binary(), "bench", "serve", "--base-url", s().url(), "--num-prompts", "8", "--max-concurrency", "4",
       "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos", "--seed", "3", "--result-json", result},
      dir + "/bench.log");
  ASSERT_GT(pid, 0);
  ASSERT_EQ(wait_exit(pid, 60), 0) << read_file(dir + "/bench.log");
  const std::string log = read_file(dir + "/bench.log");
  EXPECT_NE(log.find("Serving Benchmark Result"), std::string::npos) << log;
  EXPECT_NE(log.find("Mean TTFT (ms):"), std::string::npos) << log;
  json j = json::parse(read_file(result));
  EXPECT_EQ(j["completed"], 8);
  EXPECT_EQ(j["total_input_tokens"], 8 * 32);
  EXPECT_EQ(j["total_output_tokens"], 64);
  EXPECT_GT(j["mean_ttft_ms"].get<double>(), 0.0);
  EXPECT_GT(j["mean_tpot_ms"].get<double>(), 0.0);
  EXPECT_GT(j["mean_itl_ms"].get<double>(), 0.0);
  EXPECT_GE(j["mean_e2el_ms"].get<double>(), j["mean_ttft_ms"].get<double>());
  EXPECT_GT(j["output_throughput"].get<double>(), 0.0);
  EXPECT_EQ(j["itls"].size(), 8u);
  // One gap per streamed event after the first: one a token, unless the
  // server's stream writer fell behind the engine and sent two steps' tokens
  // in one event (as vLLM's output collector merges them for a slow
  // consumer); a loaded machine does that now and then. Every token is still
  // counted (total_output_tokens above).
  for (const json& gaps : j["itls"]) {
    EXPECT_GE(gaps.size(), 1u);
    EXPECT_LE(gaps.size(), 7u);
  }
}

// Streams a long request, sends SIGTERM once it runs; the exit status and
// what the stream got.
std::pair<int, Stream> terminate_during_stream(ServerProcess& server, int max_tokens) {
  Stream st;
  std::thread client([&] {
    st = stream(server, "/v1/completions",
                json{{"prompt", "class A:\n"}, {"max_tokens", max_tokens}, {"ignore_eos", true}, {"stream", true}});
  });
  for (int i = 0; i < 250; ++i) {
    auto res = server.client().Get("/metrics");
    if (res && parse_metrics(res->body)["nucleus_num_requests_running"] > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int status = server.terminate();
  client.join();
  return {status, st};
}

// --skip-tokenizer-init: token-id prompts in, token ids out (what a server
// for dummy weights without tokenizer files runs with); everything that needs
// text is refused naming the field.
TEST(ServerSkipTokenizerTest, TokenIdsInAndOut) {
  ServerProcess server({"--skip-tokenizer-init"});
  ASSERT_TRUE(server.ready()) << server.log();
  const json cases = ref_cases();
  const json& c = cases[2];
  const json body = {{"prompt", c["prompt_token_ids"]}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}};
  Reply r = post(server, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body["choices"][0]["token_ids"], c["greedy_token_ids"]);
  EXPECT_EQ(r.body["choices"][0]["text"], "");
  EXPECT_EQ(r.body["usage"]["completion_tokens"], 32);
  // Streamed: the chunks' token_ids joined are the same tokens.
  json sbody = body;
  sbody["stream"] = true;
  Stream st = stream(server, "/v1/completions", sbody);
  ASSERT_EQ(st.status, 200);
  EXPECT_TRUE(st.done);
  json joined = json::array();
  for (const auto& ch : st.chunks)
    for (const auto& choice : ch["choices"])
      for (const auto& t : choice["token_ids"]) joined.push_back(t);
  EXPECT_EQ(joined, c["greedy_token_ids"]);
  // What needs a tokenizer is a 400 naming the field; the server keeps serving.
  const std::vector<std::pair<json, std::string>> bad = {
      {{{"prompt", "hello"}, {"max_tokens", 4}}, "prompt"},
      {{{"prompt", c["prompt_token_ids"]}, {"max_tokens", 4}, {"stop", "x"}}, "stop"},
      {{{"prompt", c["prompt_token_ids"]}, {"max_tokens", 4}, {"logprobs", 2}}, "logprobs"},
      {{{"prompt", c["prompt_token_ids"]}, {"max_tokens", 4}, {"response_format", {{"type", "json_object"}}}},
       "response_format"},
  };
  for (const auto& [b, param] : bad) {
    Reply e = post(server, "/v1/completions", b);
    EXPECT_EQ(e.status, 400) << b.dump();
    EXPECT_EQ(e.body["error"]["param"], param) << e.body;
  }
  Reply chat = post(server, "/v1/chat/completions",
                    json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 4}});
  EXPECT_EQ(chat.status, 400);
  EXPECT_EQ(chat.body["error"]["param"], "messages");
  EXPECT_EQ(post(server, "/v1/completions", body).status, 200);
}

TEST(ServerShutdownTest, SigtermFinishesInFlightAndExitsZero) {
  ServerProcess server;
  ASSERT_TRUE(server.ready()) << server.log();
  auto [status, st] = terminate_during_stream(server, 200);
  EXPECT_EQ(status, 0) << server.log();
  EXPECT_TRUE(st.done);
  EXPECT_EQ(join(st, false).finish[0], std::vector<std::string>{"length"}) << "the in-flight request was not finished";
}

TEST(ServerShutdownTest, PastTheGracePeriodInFlightRequestsAreAborted) {
  ServerProcess server({"--shutdown-timeout", "0.3"});
  ASSERT_TRUE(server.ready()) << server.log();
  auto [status, st] = terminate_during_stream(server, 1000);  // far more than 0.3 s of decoding
  EXPECT_EQ(status, 0) << server.log();
  EXPECT_TRUE(st.done);
  EXPECT_EQ(join(st, false).finish[0], std::vector<std::string>{"abort"});
}

}  // namespace
}  // namespace nucleus
