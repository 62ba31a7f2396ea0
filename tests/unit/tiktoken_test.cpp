// The tiktoken-format tokenizer (Kimi-K2) and the regex translation's
// Unicode 16 classes. Expected ids were produced with PyPI tiktoken 0.14
// (tiktoken.Encoding with Kimi's pat_str) and HF tokenizers 0.23 on the same
// inputs; tokenizer_reference_test.py compares whole corpora.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "io/onig_regex.h"
#include "io/tiktoken_ranks.h"
#include "io/tokenizer.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;
using Pieces = std::vector<std::string>;

std::string base64(std::string_view bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t v = static_cast<unsigned char>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) v |= static_cast<unsigned char>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) v |= static_cast<unsigned char>(bytes[i + 2]);
    out += kAlphabet[v >> 18];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? kAlphabet[(v >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? kAlphabet[v & 63] : '=';
  }
  return out;
}

// The 256 bytes, then bc, ab, abc, xyz, " a", "中文", "。\n\n" (ranks 256..262).
std::string hand_ranks() {
  std::string out;
  for (int b = 0; b < 256; ++b) out += base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  int rank = 256;
  for (const char* t : {"bc", "ab", "abc", "xyz", " a", "中文", "。\n\n"})
    out += base64(t) + " " + std::to_string(rank++) + "\n";
  return out;
}

// Kimi-style config: special ids start at 263 (the number of ranks).
json hand_config() {
  return {{"added_tokens_decoder",
           {{"263", {{"content", "[BOS]"}, {"special", true}}},
            {"265", {{"content", "<|im_end|>"}, {"special", true}}}}},
          {"bos_token", "[BOS]"},
          {"eos_token", "<|im_end|>"}};
}

std::unique_ptr<Tokenizer> hand_tokenizer(const json& config = hand_config()) {
  auto r = Tokenizer::from_tiktoken(hand_ranks(), config);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(r).value() : nullptr;
}

TEST(TiktokenTest, MergesByRankOfTheConcatenation) {
  auto t = hand_tokenizer();
  ASSERT_TRUE(t);
  EXPECT_EQ(t->encode("abc", false), (Ids{258}));
  EXPECT_EQ(t->encode("abcabc", false), (Ids{258, 258}));
  // " abc": bc (256) before " a" (260) and ab (257), then a+bc = abc (258).
  EXPECT_EQ(t->encode(" abc", false), (Ids{32, 258}));
  // A pre-token that is a token is not split, though no merge reaches it.
  EXPECT_EQ(t->encode("xyz", false), (Ids{259}));
  EXPECT_EQ(t->encode("xyzx", false), (Ids{120, 121, 122, 120}));
  EXPECT_EQ(t->encode("中文。\n\n", false), (Ids{261, 262}));
  EXPECT_EQ(t->encode("Ab'S x", false), (Ids{65, 98, 39, 83, 32, 120}));
}

TEST(TiktokenTest, SpecialTokensAndAccessors) {
  auto t = hand_tokenizer();
  ASSERT_TRUE(t);
  EXPECT_EQ(t->vocab_size(), 263 + kKimiReservedSpecialTokens);
  EXPECT_EQ(t->encode("a<|im_end|>b[BOS]", false), (Ids{97, 265, 98, 263}));
  EXPECT_EQ(t->encode("<|reserved_token_300|>", false), (Ids{300}));
  EXPECT_EQ(t->token_to_id("<|reserved_token_264|>"), 264);
  EXPECT_EQ(t->token_to_id("<|reserved_token_263|>"), std::nullopt);  // named [BOS]
  EXPECT_EQ(t->bos_id(), 263);
  EXPECT_EQ(t->eos_id(), 265);
  EXPECT_TRUE(t->is_special(300));
  EXPECT_FALSE(t->is_special(258));
  // Kimi's tokenizer adds no BOS unless the config asks for it.
  EXPECT_FALSE(t->add_bos());
  EXPECT_EQ(t->encode("ab", true), (Ids{257}));
  json config = hand_config();
  config["add_bos_token"] = true;
  auto with_bos = hand_tokenizer(config);
  ASSERT_TRUE(with_bos);
  EXPECT_EQ(with_bos->encode("ab", true), (Ids{263, 257}));

  EXPECT_EQ(t->token_bytes(262), "。\n\n");
  EXPECT_EQ(t->id_to_token(260), "\u0120a");  // byte-level spelling, "Ġa"
  EXPECT_EQ(t->token_bytes(265), "<|im_end|>");
  std::string text = "mixed 中文 text。\n\n<|im_end|> \xF0\x9F\x98\x80 \u3000 123456";
  Ids ids = t->encode(text, false);
  EXPECT_EQ(t->decode(ids), text);
  EXPECT_EQ(t->decode(Ids{97, 265, 98}, /*skip_special_tokens=*/true), "ab");
}

// Han runs split from other letters (Script, not Script_Extensions: '。' is
// not Han), and new Han (CJK Ext. H, Unicode 15) is Han.
TEST(TiktokenTest, KimiPatternSplitsHan) {
  auto t = hand_tokenizer();
  ASSERT_TRUE(t);
  EXPECT_EQ(t->pre_tokenize("中文。\n\nabc"), (Pieces{"ä¸Ńæĸĩ", "ãĢĤĊĊ", "abc"}));
  EXPECT_EQ(t->pre_tokenize("ab中文cd"), (Pieces{"ab", "ä¸Ńæĸĩ", "cd"}));
  EXPECT_EQ(t->pre_tokenize(" \U00031350\U00031351").size(), 2u);  // " " and the two Ext. H characters
  EXPECT_EQ(t->pre_tokenize("\U0002EBF0\u4e2d").size(), 1u);         // Ext. I (15.1) joins a Han run
  EXPECT_EQ(t->encode("\U0002EBF0\u4e2d", false), (Ids{240, 174, 175, 176, 228, 184, 173}));
}

// Characters assigned after PCRE2 10.42's Unicode 14 classify as in HF's
// Unicode 16 (expected values from HF tokenizers 0.23).
TEST(TiktokenTest, Unicode16ClassesMatchHuggingFace) {
  auto r = Tokenizer::load(testing::model_path("tiny-dsv3"));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const Tokenizer& t = **r;
  EXPECT_EQ(t.pre_tokenize(" \U00031350x"), (Pieces{"\u0120\u00f0\u00b1\u012f\u0132x"}));  // CJK Ext. H is a letter
  EXPECT_EQ(t.encode(" \U00031350x", false), (Ids{223, 175, 112, 238, 241, 90}));
  EXPECT_EQ(t.pre_tokenize(" \U0001FACEx").size(), 2u);  // emoji (Unicode 15) is a symbol
  EXPECT_EQ(t.encode(" \U0001FACEx", false), (Ids{223, 175, 256, 107, 239, 90}));
  EXPECT_EQ(t.encode(" \U00010D4Ax", false), (Ids{223, 175, 241, 116, 235, 90}));  // Garay letter (16.0)
}

TEST(TiktokenTest, RegexTranslation) {
  EXPECT_EQ(onig_to_pcre2(R"([a&&[^b]]+)"), R"((?:(?=[^b])[a])+)");
  EXPECT_EQ(onig_to_pcre2(R"([^a&&b])"), R"((?:(?!(?=[b])[a])(?s:.)))");
  EXPECT_EQ(onig_to_pcre2(R"(\p{Latin}[\p{Hiragana}])"), R"(\p{sc:Latin}[\p{sc:Hiragana}])");
  EXPECT_EQ(onig_to_pcre2(R"([\P{L}]\p{White_Space}\s)"), R"([\P{L}]\p{White_Space}\p{White_Space})");
  std::string han = onig_to_pcre2(R"(\p{Han})");
  EXPECT_TRUE(han.starts_with(R"([\p{sc:Han}\x{2B739})")) << han;
  EXPECT_NE(han.find(R"(\x{31350}-\x{323AF})"), std::string::npos) << han;
  EXPECT_NE(onig_to_pcre2(R"(\P{N})").find(R"([^\p{N}\x{10D40}-\x{10D49})"), std::string::npos);
  EXPECT_EQ(onig_to_pcre2(R"([]a])"), R"([]a])");
  EXPECT_EQ(onig_to_pcre2(R"([[:alpha:]x])"), R"([[:alpha:]x])");
}

void expect_error(const Status& s, const std::string& part) {
  ASSERT_FALSE(s.ok()) << "expected an error containing: " << part;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find(part), std::string::npos) << "message: " << s.message() << "\nexpected: " << part;
}

TEST(TiktokenTest, RanksFileErrors) {
  auto parse = [](const std::string& text) { return parse_tiktoken_ranks(text, "tiktoken.model").status(); };
  EXPECT_TRUE(parse_tiktoken_ranks("YQ== 0\r\nYg== 1\n\n", "f").ok());
  expect_error(parse("YQ== 0\nYg==1\n"), "tiktoken.model:2: expected '<base64 token> <rank>'");
  expect_error(parse("YQ= 0\n"), "tiktoken.model:1: token is not valid base64");
  expect_error(parse("Y!== 0\n"), "token is not valid base64");
  expect_error(parse("YQ== x\n"), "rank 'x' is not an integer");
  expect_error(parse("YQ== 0\nYg== 0\n"), "tiktoken.model:2: rank 0 repeats");
  expect_error(parse("YQ== 0\nYQ== 1\n"), "token 'YQ==' repeats (ranks 0 and 1)");
  expect_error(parse("YQ== 0\nYg== 2\n"), "ranks are not 0..1 (the largest is 2)");
  expect_error(parse(""), "no ranks");

  std::string ranks = hand_ranks();
  auto missing_byte = Tokenizer::from_tiktoken(ranks.substr(ranks.find('\n') + 1), json::object());
  expect_error(missing_byte.status(), "ranks are not 0..");
  // All 256 bytes are needed: byte 0 given a multi-byte token's place.
  std::string no_zero = "YWE= 0\n" + ranks.substr(ranks.find('\n') + 1);
  expect_error(Tokenizer::from_tiktoken(no_zero, json::object()).status(), "byte 0 has no rank");
  json bad = hand_config();
  bad["added_tokens_decoder"]["12"] = {{"content", "<x>"}};
  expect_error(Tokenizer::from_tiktoken(ranks, bad).status(),
               "added_tokens_decoder key '12' must be an id in [263, ");
}

TEST(TiktokenTest, LoadPicksTiktokenModel) {
  std::string dir = testing::make_temp_dir("nucleus_tiktoken");
  std::ofstream(dir + "/tiktoken.model", std::ios::binary) << hand_ranks();
  std::ofstream(dir + "/tokenizer_config.json") << hand_config().dump();
  std::ofstream(dir + "/chat_template.jinja") << "{{ messages }}";
  auto t = Tokenizer::load(dir);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ((*t)->encode(" abc", false), (Ids{32, 258}));
  EXPECT_EQ((*t)->chat_template(), "{{ messages }}");

  std::ofstream(dir + "/tiktoken.model", std::ios::binary) << "@@@@ 0\n";
  auto bad = Tokenizer::load(dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tiktoken.model:1: token is not valid base64"), std::string::npos)
      << bad.status().to_string();
}

}  // namespace
}  // namespace nucleus
