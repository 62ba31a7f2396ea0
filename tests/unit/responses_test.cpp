// ResponseBuilder: the OpenAI completions logprobs, text_offset in particular.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "io/utf8.h"
#include "server/responses.h"
#include "test_util.h"

namespace nucleus::server {
namespace {

using nlohmann::json;

// text_offset[i] is where token i's text starts in the choice's text; a
// special token that skip_special_tokens leaves out of the text takes no room.
TEST(ResponsesTest, TextOffsetSkipsSpecialTokensLeftOutOfTheText) {
  auto tok = Tokenizer::load(testing::model_path("tiny-dsv3"));
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const Tokenizer& t = **tok;
  const std::vector<int32_t> a = t.encode("def", false), b = t.encode(" f", false);
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  const int32_t special = *t.token_to_id("<|end_of_text|>");
  ASSERT_TRUE(t.is_special(special));
  for (bool skip : {true, false}) {
    GenerationRequest req;
    req.prompts = {Prompt{{1}, "x"}};
    req.logprobs = true;
    req.skip_special_tokens = skip;
    ResponseBuilder builder(ResponseHeader{"cmpl-1", 0, "m"}, req, &t, 1);
    ChoiceDelta d;
    d.text = t.decode(std::vector<int32_t>{a[0], special, b[0]}, skip);
    d.logprobs = {{a[0], -0.1f, {}}, {special, -0.2f, {}}, {b[0], -0.3f, {}}};
    d.finish_reason = "length";
    builder.add(d);
    const json lp = builder.whole(1, 3)["choices"][0]["logprobs"];
    const int64_t after_special = skip ? 3 : 3 + static_cast<int64_t>(t.token_bytes(special).size());
    EXPECT_EQ(lp["text_offset"], json::array({0, 3, after_special})) << lp;
    EXPECT_EQ(d.text.substr(after_special), " f");
  }
}

// Python's len(bytes.decode("utf-8", "replace")), by hand: what vLLM's
// text_offset counts per token.
TEST(ResponsesTest, Utf8LengthCountsAsPython) {
  const std::vector<std::pair<std::string, int64_t>> cases = {
      {"", 0},
      {"abc", 3},
      {"\xe6\x97\xa5\xe6\x9c\xac", 2},  // 日本
      {"\xe6\x97", 1},                    // a truncated character: one U+FFFD
      {"\xe6\x97" "a", 2},
      {"\xff", 1},
      {"\xed\xa0\x80", 3},                // a surrogate: each byte is a U+FFFD
      {"\xf0\x9f\x98\x80", 1},            // 😀
      {"\xf0\x9f\x98", 1},
      {"\xc0\xaf", 2},                    // overlong
      {"\xf4\x90\x80\x80", 4},            // past U+10FFFF
      {"\xe0\x80\x80", 3},
      {"a\xf0\x9f", 2},
  };
  for (const auto& [bytes, chars] : cases) EXPECT_EQ(utf8_length(bytes), chars) << ::testing::PrintToString(bytes);
}

// Python's bytes.decode("utf-8", "replace"), by hand: the text a
// completions top_logprobs key holds for a token's bytes.
TEST(ResponsesTest, Utf8ReplaceInvalidDecodesAsPython) {
  const std::string r = "\xEF\xBF\xBD";  // U+FFFD
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", ""},
      {"abc", "abc"},
      {"\xe6\x97\xa5", "\xe6\x97\xa5"},  // 日
      {"\xe6\x97", r},                      // truncated: one U+FFFD
      {"\xe6\x97" "a", r + "a"},
      {"\xff\xfe", r + r},
      {"\xed\xa0\x80", r + r + r},         // a surrogate
      {"a\xf0\x9f\x98\x80" "b", "a\xf0\x9f\x98\x80" "b"},  // 😀 (the literal split: b is a hex digit)
      {"\xc0\xaf", r + r},                  // overlong
  };
  for (const auto& [bytes, text] : cases) {
    EXPECT_EQ(utf8_replace_invalid(bytes), text) << ::testing::PrintToString(bytes);
    EXPECT_EQ(utf8_length(utf8_replace_invalid(bytes)), utf8_length(bytes)) << ::testing::PrintToString(bytes);
  }
}

// utf8_next, the one decoder the tokenizer, the detokenizer and the above
// share, by hand: the step's kind, its bytes and the code point.
TEST(ResponsesTest, Utf8NextStepsAndDecodes) {
  struct Case {
    std::string bytes;
    Utf8Seq seq;
    size_t len;
    uint32_t cp;  // kValid only
  };
  const std::vector<Case> cases = {
      {"a", Utf8Seq::kValid, 1, 'a'},
      {"\xc3\xa9x", Utf8Seq::kValid, 2, 0xE9},              // é
      {"\xe6\x97\xa5", Utf8Seq::kValid, 3, 0x65E5},         // 日
      {"\xf0\x9f\x98\x80", Utf8Seq::kValid, 4, 0x1F600},   // 😀
      {"\xf4\x8f\xbf\xbf", Utf8Seq::kValid, 4, 0x10FFFF},
      {"\xe6\x97", Utf8Seq::kTruncated, 2, 0},              // waits for its last byte
      {"\xf0\x9f\x98", Utf8Seq::kTruncated, 3, 0},
      {"\xe6\x97" "a", Utf8Seq::kInvalid, 2, 0},           // cut short inside the text
      {"\x80", Utf8Seq::kInvalid, 1, 0},                    // a stray continuation byte
      {"\xc0\xaf", Utf8Seq::kInvalid, 1, 0},                // overlong: C0 starts nothing
      {"\xed\xa0\x80", Utf8Seq::kInvalid, 1, 0},            // a surrogate
      {"\xf4\x90", Utf8Seq::kInvalid, 1, 0},                // past U+10FFFF, even at the end
  };
  for (const auto& c : cases) {
    size_t i = 0;
    uint32_t cp = 0;
    EXPECT_EQ(utf8_next(c.bytes, i, &cp), c.seq) << ::testing::PrintToString(c.bytes);
    EXPECT_EQ(i, c.len) << ::testing::PrintToString(c.bytes);
    EXPECT_EQ(cp, c.cp) << ::testing::PrintToString(c.bytes);
  }
}

// echo with logprobs: the prompt's tokens first (the first unscored), top
// entries cut to the request's top-N, -inf reported as -9999, offsets in
// characters; prompt_logprobs as vLLM's choice field.
TEST(ResponsesTest, EchoedPromptLogprobs) {
  auto tok = Tokenizer::load(testing::model_path("tiny-dsv3"));
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const Tokenizer& t = **tok;
  const int32_t bos = *t.token_to_id("<|begin_of_text|>");
  const int32_t a = t.encode("def", false)[0], b = t.encode(" f", false)[0];
  GenerationRequest req;
  req.prompts = {Prompt{{bos, a, b}, "def f"}};
  req.echo = true;
  req.logprobs = true;
  req.params.logprobs = 1;
  req.prompt_logprobs = 0;
  const float inf = std::numeric_limits<float>::infinity();
  ChoiceDelta d;
  d.prompt_logprobs = {TokenLogprobs{a, -1.5f, 3, {{b, -0.5f}, {bos, -1.0f}}}, TokenLogprobs{b, -inf, 9, {{a, -0.25f}}}};
  d.logprobs = {{a, -0.125f, {{a, -0.125f}}}};
  d.text = "def";
  d.finish_reason = "length";
  for (bool stream : {false, true}) {
    ResponseBuilder builder(ResponseHeader{"cmpl-1", 0, "m"}, req, &t, 1);
    json choice;
    if (stream) {
      EXPECT_TRUE(builder.opening_chunks().empty());  // the prompt waits for its logprobs
      choice = builder.chunks(d).at(0)["choices"][0];
    } else {
      builder.add(d);
      choice = builder.whole(3, 1)["choices"][0];
      EXPECT_EQ(choice["prompt_logprobs"],
                json::parse(R"([null, {")" + std::to_string(a) + R"(": {"logprob": -1.5, "rank": 3, "decoded_token": "def"}},
                                      {")" + std::to_string(b) + R"(": {"logprob": -9999.0, "rank": 9, "decoded_token": " f"}}])"));
    }
    EXPECT_EQ(choice["text"], "def fdef");
    const json& lp = choice["logprobs"];
    EXPECT_EQ(lp["tokens"], json::array({t.token_bytes(bos), "def", " f", "def"})) << lp;
    EXPECT_EQ(lp["token_logprobs"], json::array({nullptr, -1.5, -9999.0, -0.125})) << lp;
    EXPECT_EQ(lp["top_logprobs"], json::parse(R"([null, {" f": -0.5, "def": -1.5}, {"def": -0.25, " f": -9999.0},
                                                  {"def": -0.125}])")) << lp;
    EXPECT_EQ(lp["text_offset"], json::array({0, 0, 3, 5})) << lp;  // the BOS takes no room
  }
}

}  // namespace
}  // namespace nucleus::server
