// The request parsers on vLLM's sampling parameters: presence, frequency and
// repetition penalties, logit_bias, min_tokens and min_p are read into
// SamplingParams with vLLM's ranges, and a bad value is a 400 naming the
// parameter (and, for logit_bias, the id).
#include <gtest/gtest.h>

#include <map>
#include <variant>

#include "server/protocol.h"

namespace nucleus::server {
namespace {

ModelInfo model() {
  ModelInfo m;
  m.names = {"tiny"};
  m.max_model_len = 1024;
  m.vocab_size = 4096;
  return m;
}

// A completions body with token-id prompt [1, 2] and `extra` fields.
std::string body(const std::string& extra) {
  return R"({"prompt": [1, 2], "max_tokens": 8)" + (extra.empty() ? "" : ", " + extra) + "}";
}

SamplingParams parsed(const std::string& extra) {
  auto r = parse_completion_request(body(extra), model());
  if (auto* e = std::get_if<ApiError>(&r)) {
    ADD_FAILURE() << extra << ": " << e->message;
    return {};
  }
  return std::get<GenerationRequest>(r).params;
}

ApiError refused(const std::string& extra) {
  auto r = parse_completion_request(body(extra), model());
  if (auto* e = std::get_if<ApiError>(&r)) return *e;
  ADD_FAILURE() << extra << " was accepted";
  return {};
}

TEST(SamplingProtocolTest, DefaultsLeaveLogitsAlone) {
  const SamplingParams p = parsed("");
  EXPECT_EQ(p.presence_penalty, 0.0f);
  EXPECT_EQ(p.frequency_penalty, 0.0f);
  EXPECT_EQ(p.repetition_penalty, 1.0f);
  EXPECT_TRUE(p.logit_bias.empty());
  EXPECT_EQ(p.min_tokens, 0);
  EXPECT_EQ(p.min_p, 0.0f);
  EXPECT_FALSE(p.adjusts_logits(0));
}

TEST(SamplingProtocolTest, ValuesAreRead) {
  const SamplingParams p = parsed(
      R"("presence_penalty": 0.5, "frequency_penalty": -1.25, "repetition_penalty": 1.3,
         "logit_bias": {"17": 100, "4095": -7.5, "0": 250, "3": -1e9}, "min_tokens": 8, "min_p": 0.05)");
  EXPECT_EQ(p.presence_penalty, 0.5f);
  EXPECT_EQ(p.frequency_penalty, -1.25f);
  EXPECT_EQ(p.repetition_penalty, 1.3f);
  EXPECT_EQ(p.min_tokens, 8);
  EXPECT_EQ(p.min_p, 0.05f);
  std::map<int32_t, float> bias(p.logit_bias.begin(), p.logit_bias.end());
  EXPECT_EQ(bias, (std::map<int32_t, float>{{0, 100.0f}, {3, -100.0f}, {17, 100.0f}, {4095, -7.5f}}));  // clamped
  EXPECT_TRUE(p.validate().ok()) << p.validate().to_string();
  // Neutral values and null are accepted as "not given".
  const SamplingParams q =
      parsed(R"("presence_penalty": null, "repetition_penalty": 1, "logit_bias": {}, "min_p": 0, "min_tokens": 0)");
  EXPECT_FALSE(q.adjusts_logits(0));
}

TEST(SamplingProtocolTest, ChatReadsThemToo) {
  auto r = parse_chat_request(R"({"messages": [{"role": "user", "content": "hi"}], "min_p": 0.2})", model());
  // No tokenizer in this ModelInfo: chat is refused for that, after the sampling fields were read.
  ASSERT_TRUE(std::holds_alternative<ApiError>(r));
  EXPECT_EQ(std::get<ApiError>(r).param, "messages");
  r = parse_chat_request(R"({"messages": [{"role": "user", "content": "hi"}], "min_p": 2})", model());
  ASSERT_TRUE(std::holds_alternative<ApiError>(r));
  EXPECT_EQ(std::get<ApiError>(r).param, "min_p");
}

TEST(SamplingProtocolTest, BadValuesAre400NamingTheParameter) {
  struct Case {
    std::string extra, param, message;
  };
  const std::vector<Case> cases = {
      {R"("presence_penalty": 2.5)", "presence_penalty", "[-2, 2]"},
      {R"("presence_penalty": "high")", "presence_penalty", "number"},
      {R"("frequency_penalty": -3)", "frequency_penalty", "[-2, 2]"},
      {R"("repetition_penalty": 0)", "repetition_penalty", "[1e-4, 1e4]"},
      {R"("repetition_penalty": -1)", "repetition_penalty", "[1e-4, 1e4]"},
      {R"("repetition_penalty": 1e300)", "repetition_penalty", "[1e-4, 1e4]"},
      {R"("repetition_penalty": 1e-38)", "repetition_penalty", "[1e-4, 1e4]"},
      {R"("min_p": 1.5)", "min_p", "[0, 1]"},
      {R"("min_p": -0.1)", "min_p", "[0, 1]"},
      {R"("min_tokens": -1)", "min_tokens", "min_tokens"},
      {R"("min_tokens": 9)", "min_tokens", "max_tokens (8)"},
      {R"("min_tokens": 1.5)", "min_tokens", "integer"},
      {R"("logit_bias": [1, 2])", "logit_bias", "object"},
      {R"("logit_bias": {"abc": 1})", "logit_bias", "'abc'"},
      {R"("logit_bias": {"12x": 1})", "logit_bias", "'12x'"},
      {R"("logit_bias": {"4096": 1})", "logit_bias", "token id 4096 is outside the vocabulary [0, 4096)"},
      {R"("logit_bias": {"-1": 1})", "logit_bias", "token id -1"},
      {R"("logit_bias": {"5": "up"})", "logit_bias", "token id 5 must be a number"},
      {R"("logit_bias": {"5": 1, "005": 2})", "logit_bias", "twice"},
      // vLLM fields not served: refused by name, never ignored.
      {R"("allowed_token_ids": [5])", "allowed_token_ids", "not supported"},
      {R"("bad_words": ["x"])", "bad_words", "not supported"},
      {R"("truncate_prompt_tokens": 4)", "truncate_prompt_tokens", "not supported"},
      {R"("use_beam_search": true)", "use_beam_search", "not supported"},
      {R"("return_tokens_as_token_ids": true)", "return_tokens_as_token_ids", "not supported"},
      {R"("stream": true, "stream_options": {"continuous_usage_stats": true})", "stream_options",
       "continuous_usage_stats"},
  };
  for (const auto& c : cases) {
    const ApiError e = refused(c.extra);
    EXPECT_EQ(e.http_status, 400) << c.extra;
    EXPECT_EQ(e.param, c.param) << c.extra << ": " << e.message;
    EXPECT_NE(e.message.find(c.message), std::string::npos) << c.extra << ": " << e.message;
  }
}

}  // namespace
}  // namespace nucleus::server
