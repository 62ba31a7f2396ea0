// ResponseBuilder: the OpenAI completions logprobs, text_offset in particular.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace nucleus::server
