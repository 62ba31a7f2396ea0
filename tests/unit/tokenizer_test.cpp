// Byte-level BPE tokenizer: ids against the Hugging Face references, round
// trips, added tokens, pre-tokenizer steps and load errors. Expected values
// not taken from models/ref/cases.json were produced with HF `tokenizers`
// 0.23 on the same tokenizer.json contents.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "io/tokenizer.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;
using Pieces = std::vector<std::string>;

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

const Tokenizer& tiny() {
  static std::unique_ptr<Tokenizer> t = [] {
    auto r = Tokenizer::load(testing::model_path("tiny-dsv3"));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    return r.ok() ? std::move(r).value() : nullptr;
  }();
  return *t;
}

// The tiny model's tokenizer.json with `edit` applied, built in memory.
template <typename Edit>
std::unique_ptr<Tokenizer> tiny_with(Edit edit) {
  json t = read_json(testing::model_path("tiny-dsv3/tokenizer.json"));
  json c = read_json(testing::model_path("tiny-dsv3/tokenizer_config.json"));
  edit(t, c);
  auto r = Tokenizer::from_json(t, c);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(r).value() : nullptr;
}

json added_token(int id, const std::string& content, bool special) {
  return {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", special}};
}

// A hand-built tokenizer: digits, "a", "b", "Ġ" and five merges, whose ids
// show how the text was grouped. Merge ranks: 3+4, 1+2, 12+3, 4+5, a+b.
json mini_tokenizer(const json& pre_tokenizer) {
  json vocab = json::object();
  for (int i = 0; i < 10; ++i) vocab[std::to_string(i)] = i;
  vocab["a"] = 10;
  vocab["b"] = 11;
  vocab["\xC4\xA0"] = 12;  // "Ġ", the byte-level space
  vocab["34"] = 13;
  vocab["12"] = 14;
  vocab["123"] = 15;
  vocab["45"] = 16;
  vocab["ab"] = 17;
  return {
      {"version", "1.0"},
      {"added_tokens", {added_token(18, "<s>", true), added_token(19, "</s>", true)}},
      {"normalizer", nullptr},
      {"pre_tokenizer", pre_tokenizer},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        // json::array: a braced list of string pairs would become an object.
        {"merges", json::array({json::array({"3", "4"}), json::array({"1", "2"}), json::array({"12", "3"}),
                                json::array({"4", "5"}), json::array({"a", "b"})})}}},
  };
}

json mini_config() {
  return {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"add_bos_token", false}, {"add_eos_token", false}};
}

json byte_level(bool add_prefix_space, bool use_regex) {
  return {
      {"type", "ByteLevel"}, {"add_prefix_space", add_prefix_space}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

json split(const std::string& pattern, const std::string& behavior, bool invert = false, bool literal = false) {
  return {{"type", "Split"},
          {"pattern", {{literal ? "String" : "Regex", pattern}}},
          {"behavior", behavior},
          {"invert", invert}};
}

json sequence(std::vector<json> steps) { return {{"type", "Sequence"}, {"pretokenizers", steps}}; }

// Sequence[Split(\p{N}{1,3}, Isolated), ByteLevel(use_regex false)].
json digits_in_threes() { return sequence({split(R"(\p{N}{1,3})", "Isolated"), byte_level(false, false)}); }

std::unique_ptr<Tokenizer> mini(const json& pre_tokenizer) {
  auto r = Tokenizer::from_json(mini_tokenizer(pre_tokenizer), mini_config());
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(r).value() : nullptr;
}

// ---- Reference ids of models/ref/cases.json ------------------------------------

TEST(TokenizerTest, ReferenceCasesEncodeAndDecode) {
  json cases = read_json(testing::model_path("ref/cases.json"));
  int checked = 0;
  for (const char* model : {"tiny-dsv3", "tiny-dsv3-fp8"}) {
    auto t = Tokenizer::load(testing::model_path(model));
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE(cases.contains(model));
    for (const json& c : cases[model]) {
      std::string prompt = c["prompt"].get<std::string>();
      Ids want = c["prompt_token_ids"].get<Ids>();
      ASSERT_FALSE(want.empty());
      EXPECT_EQ(want[0], 0);  // BOS
      EXPECT_EQ((*t)->encode(prompt), want) << model << ": " << prompt;
      EXPECT_EQ((*t)->decode(c["greedy_token_ids"].get<Ids>()), c["greedy_text"].get<std::string>()) << model;
      EXPECT_EQ((*t)->decode((*t)->encode(prompt, false)), prompt) << model;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 12);
}

TEST(TokenizerTest, Accessors) {
  const Tokenizer& t = tiny();
  EXPECT_EQ(t.vocab_size(), 4096);
  EXPECT_EQ(t.bos_id(), 0);
  EXPECT_EQ(t.eos_id(), 1);
  EXPECT_EQ(t.bos_token(), "<|begin_of_text|>");
  EXPECT_EQ(t.eos_token(), "<|end_of_text|>");
  EXPECT_TRUE(t.add_bos());
  EXPECT_FALSE(t.add_eos());
  EXPECT_EQ(t.chat_template().rfind("{% for m in messages %}", 0), 0u);
  EXPECT_EQ(t.token_to_id("<|pad|>"), 2);
  EXPECT_EQ(t.token_to_id("!"), 3);
  EXPECT_EQ(t.token_to_id("\xC4\xA0\xC4\xA0"), 259);  // "ĠĠ", two spaces
  EXPECT_EQ(t.token_to_id("no such token"), std::nullopt);
  EXPECT_TRUE(t.is_special(0));
  EXPECT_TRUE(t.is_special(2));
  EXPECT_FALSE(t.is_special(3));
  EXPECT_FALSE(t.is_special(-1));
  EXPECT_FALSE(t.is_special(4096));
  EXPECT_EQ(t.id_to_token(259), "\xC4\xA0\xC4\xA0");
  EXPECT_EQ(t.token_bytes(259), "  ");
  EXPECT_EQ(t.token_bytes(201), "\n");  // "Ċ"
  EXPECT_EQ(t.token_bytes(1), "<|end_of_text|>");
}

// ---- Round trips ---------------------------------------------------------------

TEST(TokenizerTest, RoundTripUnicode) {
  const Tokenizer& t = tiny();
  const std::vector<std::string> texts = {
      "", " ", "hello world",
      "你好，世界！这是一个测试。",                         // CJK
      "日本語のテキストとカタカナ、한국어",                 // kana, hangul
      "\xF0\x9F\x98\x80 \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD",  // 😀 👍🏽 (skin tone modifier)
      // 👨‍👩‍👧‍👦 family: a ZWJ sequence; 🏳️‍🌈 with a variation selector
      "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7\xE2\x80\x8D\xF0\x9F\x91\xA6 "
      "\xF0\x9F\x8F\xB3\xEF\xB8\x8F\xE2\x80\x8D\xF0\x9F\x8C\x88",
      "e\xCC\x81 n\xCC\x83 a\xCC\x8A\xCC\x81",  // combining marks: é ñ ǻ
      "caf\xC3\xA9 na\xC3\xAFve \xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 \xD8\xB3\xD9\x84\xD8\xA7\xD9\x85",
      "\t\ttabs\tand  spaces \n\n\nnewlines\r\n  \t \n", "   leading and trailing   ",
      "\xC2\xA0\xE2\x80\x83\xE3\x80\x80 no-break, em and ideographic spaces",
      "x = [1, 22, 333, 4444, 55555];  // 3.14159e-10",
      "\xF4\x8F\xBF\xBF \xEF\xBF\xBD \xEF\xBB\xBF",  // U+10FFFF, U+FFFD, BOM
  };
  for (const std::string& text : texts) {
    Ids ids = t.encode(text, false);
    EXPECT_EQ(t.decode(ids), text);
    // token_bytes concatenated is decode (what incremental detokenization relies on).
    std::string joined;
    for (int32_t id : ids) joined += t.token_bytes(id);
    EXPECT_EQ(joined, text);
  }
  EXPECT_TRUE(t.encode("", false).empty());
  EXPECT_EQ(t.encode(""), Ids{0});
}

TEST(TokenizerTest, InvalidUtf8IsEncodedByteByByte) {
  const Tokenizer& t = tiny();
  // A lone continuation byte, a truncated 3-byte sequence, 0xFF, an overlong "/".
  const std::string text = "a\x80 b\xE4\xB8 c\xFF d\xC0\xAF!";
  Ids ids = t.encode(text, false);
  EXPECT_EQ(t.decode(ids), text);
  // Half a character gives half its bytes: callers see raw bytes, not U+FFFD.
  Ids cjk = t.encode("\xE4\xB8\x96", false);  // 世 is three byte tokens here
  ASSERT_EQ(cjk.size(), 3u);
  EXPECT_EQ(t.token_bytes(cjk[0]), "\xE4");
  EXPECT_EQ(t.decode(Ids{cjk[0], cjk[1]}), "\xE4\xB8");
}

// ---- Added and special tokens --------------------------------------------------

TEST(TokenizerTest, SpecialTokensInText) {
  const Tokenizer& t = tiny();
  EXPECT_EQ(t.encode("hello<|end_of_text|>world", false), (Ids{281, 78, 334, 1, 89, 275, 632}));
  EXPECT_EQ(t.encode("<|begin_of_text|>x = 1<|end_of_text|>", false), (Ids{0, 90, 283, 452, 1}));
  EXPECT_EQ(t.encode("a<|pad|><|pad|>b", false), (Ids{67, 2, 2, 68}));
  // Not closed: ordinary text.
  EXPECT_EQ(t.encode("<|end_of_text|", false), (Ids{30, 94, 1083, 65, 1509, 65, 539, 94}));
  // With add_special_tokens, BOS comes first even when the text starts with it.
  EXPECT_EQ(t.encode("<|begin_of_text|>x"), (Ids{0, 0, 90}));
  Ids ids = t.encode("<|end_of_text|>");
  EXPECT_EQ(ids, (Ids{0, 1}));
}

TEST(TokenizerTest, DecodeSkipsSpecialTokens) {
  const Tokenizer& t = tiny();
  Ids ids = t.encode("hi<|pad|> there<|end_of_text|>");
  EXPECT_EQ(t.decode(ids), "<|begin_of_text|>hi<|pad|> there<|end_of_text|>");
  EXPECT_EQ(t.decode(ids, /*skip_special_tokens=*/true), "hi there");
}

TEST(TokenizerTest, AddedTokenStripAndSingleWord) {
  auto t = tiny_with([](json& tok, json&) {
    json l = added_token(4096, "<L>", true);
    l["lstrip"] = true;
    l["rstrip"] = true;
    json sw = added_token(4097, "SW", false);
    sw["single_word"] = true;
    tok["added_tokens"].push_back(l);
    tok["added_tokens"].push_back(sw);
  });
  ASSERT_TRUE(t);
  EXPECT_EQ(t->vocab_size(), 4098);
  // lstrip / rstrip take the neighbouring whitespace (Unicode, so U+3000 too).
  EXPECT_EQ(t->encode("a  <L>  b", false), (Ids{67, 4096, 68}));
  EXPECT_EQ(t->encode("\xC3\xA9\xE3\x80\x80<L>\tb", false), (Ids{130, 105, 4096, 68}));
  // single_word: only " SW " stands alone; xSW, ySW and SW_ touch word characters.
  EXPECT_EQ(t->encode("xSW SW ySW SW_", false), (Ids{90, 53, 57, 223, 4097, 726, 53, 57, 337, 57, 65}));
  EXPECT_FALSE(t->is_special(4097));
  EXPECT_TRUE(t->is_special(4096));
}

TEST(TokenizerTest, LongestAddedTokenWins) {
  auto t = tiny_with([](json& tok, json&) {
    tok["added_tokens"].push_back(added_token(4096, "<|end", false));
    tok["added_tokens"].push_back(added_token(4097, "<|end_of_text|>!", false));
  });
  ASSERT_TRUE(t);
  EXPECT_EQ(t->encode("<|end_of_text|>!<|end_of_text|><|end", false), (Ids{4097, 1, 4096}));
}

// HF cuts out tokens with normalized false first, then those with
// normalized true from the rest, so a normalized token never spans one of
// the others even where it would be the leftmost match.
TEST(TokenizerTest, AddedTokensMatchInTwoPasses) {
  auto t = tiny_with([](json& tok, json&) {
    json xab = added_token(4096, "xab", false);
    xab["normalized"] = true;
    xab["lstrip"] = true;
    json bc = added_token(2625, "bc", true);  // also a vocab token: keeps its id
    bc["rstrip"] = true;
    json cx = added_token(4097, "cX", false);
    cx["normalized"] = true;
    cx["single_word"] = true;
    json eotx = added_token(4098, "<|end_of_text|>x", false);
    eotx["normalized"] = true;
    for (const json& a : {xab, bc, cx, eotx}) tok["added_tokens"].push_back(a);
  });
  ASSERT_TRUE(t);
  EXPECT_EQ(t->encode("xabc", false), (Ids{1497, 2625}));  // "xa" "bc"
  EXPECT_EQ(t->encode("zz xab cX", false), (Ids{92, 92, 4096, 223, 4097}));
  EXPECT_EQ(t->encode("xab<|end_of_text|>x", false), (Ids{4096, 1, 90}));
}

// A token found inside the whitespace an rstrip token took starts after it;
// single_word follows Rust's \w ("½" is not a word character, "²" neither).
TEST(TokenizerTest, AddedTokenOverlapsAndWordCharacters) {
  auto t = tiny_with([](json& tok, json&) {
    tok["pre_tokenizer"]["add_prefix_space"] = true;
    json l = added_token(4096, " <L>", true);
    l["lstrip"] = true;
    l["rstrip"] = true;
    json def = added_token(327, "def", false);
    def["single_word"] = true;
    json end = added_token(4097, "<|end", false);
    end["rstrip"] = true;
    for (const json& a : {l, def, end}) tok["added_tokens"].push_back(a);
  });
  ASSERT_TRUE(t);
  EXPECT_EQ(t->encode("<|end <L>3", false), (Ids{4097, 4096, 824}));
  EXPECT_EQ(t->encode("a <L> <L>b", false), (Ids{274, 4096, 4096, 315}));
  EXPECT_EQ(t->encode("\u00bddef`", false), (Ids{223, 129, 124, 327, 850}));  // \u takes exactly 4 digits
  EXPECT_EQ(t->encode("\u00b2def", false), (Ids{223, 129, 113, 327}));
}

// ---- tokenizer_config.json -----------------------------------------------------

TEST(TokenizerTest, ConfigVariants) {
  // Tokens as AddedToken objects, EOS appended, no BOS, named chat templates.
  auto t = tiny_with([](json&, json& c) {
    c["bos_token"] = {{"__type", "AddedToken"}, {"content", "<|begin_of_text|>"}, {"lstrip", false}};
    c["eos_token"] = {{"content", "<|pad|>"}};
    c["add_bos_token"] = false;
    c["add_eos_token"] = true;
    c["chat_template"] = json::array({json{{"name", "tool_use"}, {"template", "T"}},  //
                                      json{{"name", "default"}, {"template", "D"}}});
  });
  ASSERT_TRUE(t);
  EXPECT_EQ(t->bos_id(), 0);
  EXPECT_EQ(t->eos_id(), 2);
  EXPECT_EQ(t->eos_token(), "<|pad|>");
  EXPECT_EQ(t->encode("x"), (Ids{90, 2}));
  EXPECT_EQ(t->chat_template(), "D");

  // add_bos_token defaults to true when bos_token is set; no template is "".
  t = tiny_with([](json&, json& c) {
    c.erase("add_bos_token");
    c.erase("chat_template");
  });
  ASSERT_TRUE(t);
  EXPECT_EQ(t->encode("x"), (Ids{0, 90}));
  EXPECT_EQ(t->chat_template(), "");

  // No bos_token at all: nothing is added.
  t = tiny_with([](json&, json& c) {
    c.erase("add_bos_token");
    c.erase("bos_token");
  });
  ASSERT_TRUE(t);
  EXPECT_EQ(t->bos_id(), std::nullopt);
  EXPECT_EQ(t->encode("x"), (Ids{90}));
}

TEST(TokenizerTest, ChatTemplateJinjaFile) {
  std::string dir = testing::make_temp_dir("nucleus_tok_jinja");
  json c = read_json(testing::model_path("tiny-dsv3/tokenizer_config.json"));
  c.erase("chat_template");
  write_file(dir + "/tokenizer.json", read_json(testing::model_path("tiny-dsv3/tokenizer.json")).dump());
  write_file(dir + "/tokenizer_config.json", c.dump());
  write_file(dir + "/chat_template.jinja", "{{ messages[0]['content'] }}");
  auto t = Tokenizer::load(dir);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ((*t)->chat_template(), "{{ messages[0]['content'] }}");
}

// ---- Pre-tokenizers ------------------------------------------------------------

TEST(TokenizerTest, DigitsGroupedInThrees) {
  auto t = mini(digits_in_threes());
  ASSERT_TRUE(t);
  EXPECT_EQ(t->pre_tokenize("12345"), (Pieces{"123", "45"}));
  EXPECT_EQ(t->encode("12345", false), (Ids{15, 16}));  // "123" "45"
  EXPECT_EQ(t->pre_tokenize("ab 1234567"), (Pieces{"ab\xC4\xA0", "123", "456", "7"}));
  EXPECT_EQ(t->encode("ab 1234567", false), (Ids{17, 12, 15, 16, 6, 7}));
  EXPECT_EQ(t->encode("<s>12345</s>", false), (Ids{18, 15, 16, 19}));
  EXPECT_EQ(t->decode(Ids{18, 15, 16, 19}, true), "12345");
  // Without the split, the best-ranked merge 3+4 wins: "12" "34" "5".
  json no_split = mini_tokenizer(byte_level(false, false));
  no_split["model"]["merges"] = json::array({"3 4", "1 2", "12 3", "4 5", "a b"});  // the "a b" spelling
  auto plain = Tokenizer::from_json(no_split, mini_config());
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  EXPECT_EQ((*plain)->encode("12345", false), (Ids{14, 13, 5}));
}

TEST(TokenizerTest, SplitBehaviors) {
  struct Case {
    json pre;
    std::string text;
    Pieces want;
  };
  const std::vector<Case> cases = {
      {split(R"(\d+)", "Isolated"), "a1b22c333", {"a", "1", "b", "22", "c", "333"}},
      {split(R"(\d)", "Isolated", true), "1a22b", {"1", "a", "2", "2", "b"}},
      {split(R"(\d+)", "Removed"), "a1b22c333", {"a", "b", "c"}},
      {split(R"(\d+)", "Removed", true), "a1b22c333", {"1", "22", "333"}},
      {split(R"(\d)", "Removed", true), "1a22b", {"1", "2", "2"}},
      {split(R"(\d+)", "MergedWithPrevious"), "a1b22c333", {"a1", "b22", "c333"}},
      {split(R"(\d)", "MergedWithPrevious"), "1a22b", {"1", "a2", "2", "b"}},
      {split(R"(\d+)", "MergedWithPrevious", true), "a1b22c333", {"a", "1b", "22c", "333"}},
      {split(R"(\d)", "MergedWithPrevious", true), "1a22b", {"1a", "2", "2b"}},
      {split(R"(\d+)", "MergedWithNext"), "a1b22c333", {"a", "1b", "22c", "333"}},
      {split(R"(\d)", "MergedWithNext"), "1a22b", {"1a", "2", "2b"}},
      {split(R"(\d+)", "MergedWithNext", true), "a1b22c333", {"a1", "b22", "c333"}},
      {split(R"(\d)", "MergedWithNext", true), "1a22b", {"1", "a2", "2", "b"}},
      {split(R"(\d)", "Contiguous"), "1a22b", {"1", "a", "22", "b"}},
      {split(R"(\d)", "Contiguous", true), "1a22b", {"1", "a", "22", "b"}},
      {split("--", "Removed", false, /*literal=*/true), "a--b----c", {"a", "b", "c"}},
      {split("x*", "Isolated"), "axxb", {"a", "xx", "b"}},  // empty matches split nothing
      {{{"type", "Digits"}, {"individual_digits", true}}, "ab123c4", {"ab", "1", "2", "3", "c", "4"}},
      {{{"type", "Digits"}, {"individual_digits", false}}, "ab123c4", {"ab", "123", "c", "4"}},
      // Digits means Unicode numeric (char::is_numeric): "²" and Arabic-Indic "٣" too.
      {{{"type", "Digits"}, {"individual_digits", true}}, "a\u00b2\u06634b", {"a", "\u00b2", "\u0663", "4", "b"}},
      {{{"type", "Digits"}, {"individual_digits", false}}, "a\u00b2\u06634b", {"a", "\u00b2\u06634", "b"}},
      {byte_level(true, true),
       "hello world  it's\n\n x",
       {"\xC4\xA0hello", "\xC4\xA0world", "\xC4\xA0", "\xC4\xA0it", "'s", "\xC4\x8A\xC4\x8A", "\xC4\xA0x"}},
      {byte_level(true, false), " hi there", {"\xC4\xA0hi\xC4\xA0there"}},
      // add_prefix_space applies to every piece a previous step made.
      {sequence({split(" ", "Removed", false, true), byte_level(true, false)}),
       "ab cd",
       {"\u0120ab", "\u0120cd"}},  // U+0120 is "Ġ"
  };
  for (const Case& c : cases) {
    auto t = mini(c.pre);
    ASSERT_TRUE(t) << c.pre.dump();
    EXPECT_EQ(t->pre_tokenize(c.text), c.want) << c.pre.dump() << " on '" << c.text << "'";
  }
}

// Regex classes follow Oniguruma, which HF uses: \s is Unicode White_Space,
// so U+180E MONGOLIAN VOWEL SEPARATOR (in PCRE2's own \s) is not a space.
TEST(TokenizerTest, WhitespaceClassMatchesOniguruma) {
  const Tokenizer& t = tiny();
  EXPECT_EQ(t.pre_tokenize(" \u180eb"), (Pieces{"\u0120\u00e1\u0142\u0130", "b"}));  // "Ġáłİ" "b"
  EXPECT_EQ(t.encode("a\u180e's", false), (Ids{67, 160, 257, 239, 9, 85}));
}

TEST(TokenizerTest, UnknownTokensAndIgnoreMerges) {
  auto make = [](const char* unk, bool fuse_unk, bool ignore_merges) {
    json j = mini_tokenizer(digits_in_threes());
    j["added_tokens"] = json::array();
    j["model"]["vocab"]["<unk>"] = 20;
    j["model"]["vocab"]["345"] = 21;  // no merges lead to it
    j["model"]["unk_token"] = unk ? json(unk) : json(nullptr);
    j["model"]["fuse_unk"] = fuse_unk;
    j["model"]["ignore_merges"] = ignore_merges;
    auto t = Tokenizer::from_json(j, json::object());
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return std::move(t).value();
  };
  // "ab xyz1" pre-tokenizes as "abĠxyz" "1"; x, y and z are not in the vocab.
  auto t = make(nullptr, false, false);
  EXPECT_EQ(t->encode("ab xyz1"), (Ids{17, 12, 1}));  // unknown characters dropped
  EXPECT_EQ(t->encode("345"), (Ids{13, 5}));
  t = make("<unk>", false, false);
  EXPECT_EQ(t->encode("ab xyz1"), (Ids{17, 12, 20, 20, 20, 1}));
  EXPECT_EQ(t->encode("x345y"), (Ids{20, 13, 5, 20}));
  t = make("<unk>", true, false);
  EXPECT_EQ(t->encode("ab xyz1"), (Ids{17, 12, 20, 1}));
  t = make(nullptr, false, true);
  EXPECT_EQ(t->encode("345"), (Ids{21}));  // a whole pre-token in the vocab wins
  EXPECT_EQ(t->encode("x345y"), (Ids{21}));
}

// DeepSeek-V3's own pre-tokenizer (digits in threes, CJK runs, then its main
// pattern; ByteLevel without regex), run over the tiny vocab.
TEST(TokenizerTest, DeepSeekV3PreTokenizer) {
  json pre = sequence({
      split(R"(\p{N}{1,3})", "Isolated"),
      split("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", "Isolated"),
      split(R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|)"
            R"( ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
            "Isolated"),
      byte_level(false, false),
  });
  auto t = tiny_with([&](json& tok, json&) { tok["pre_tokenizer"] = pre; });
  ASSERT_TRUE(t);
  const std::string text =
      "Hello, \u4e16\u754c! 12345 apples\u2014caf\u00e9\n\n\tdef f(x):\n    return x**2  # ok\r\n"
      "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u30ab\u30bf\u30ab\u30ca "
      "\U0001F600\U0001F44D\U0001F3FD 1,234.5678 .Net don't";
  // clang-format off
  const Pieces want_pieces = {
      "Hello", ",", "Ġ", "ä¸ĸçķĮ", "!", "Ġ", "123", "45", "Ġapples", "âĢĶ", "cafÃ©", "ĊĊ", "ĉdef", "Ġf",
      "(x", "):Ċ", "ĠĠĠ", "Ġreturn", "Ġx", "**", "2", "Ġ", "Ġ#", "Ġok", "čĊ", "æĹ¥æľ¬èªŀãģ®ãĥĨãĤŃãĤ¹ãĥĪ",
      "Ġ", "ãĤ«ãĤ¿ãĤ«ãĥĬ", "ĠðŁĺĢðŁĳįðŁı½", "Ġ", "1", ",", "234", ".", "567", "8", "Ġ.", "Net", "Ġdon", "'t"};
  // clang-format on
  EXPECT_EQ(t->pre_tokenize(text), want_pieces);
  const Ids want = {1696, 78,   334, 14,  223, 163, 119, 247,  166, 246, 237,  3,   223, 1111, 21,  3597, 2256, 280,
                    85,   1414, 245, 616, 72,  130, 105, 566,  200, 327, 290,  10,  90,  314,  201, 261,  343,  953,
                    471,  20,   223, 282, 302, 77,  204, 201,  165, 248, 101,  165, 253, 108,  167, 106,  255,  162,
                    226,  109,  162, 228, 231, 162, 227, 258,  162, 227, 120,  162, 228, 233,  223, 162,  227,  107,
                    162,  227,  126, 162, 227, 107, 162, 228,  235, 223, 175,  256, 249, 225,  175, 256,  242,  238,
                    175,  256,  240, 124, 223, 19,  14,  1898, 22,  16,  2679, 25,  26,  1400, 48,  655,  1981, 876};
  EXPECT_EQ(t->encode(text, false), want);
  EXPECT_EQ(t->decode(want), text);
  // The same text through the tiny model's own GPT-2 ByteLevel pre-tokenizer.
  const Ids want_gpt2 = {
      1696, 78,  334, 14,  223, 163, 119, 247, 166, 246, 237,  3,   452, 1898, 3597, 2256, 280,  85,  1414, 245,  616,
      72,   130, 105, 566, 200, 327, 290, 10,  90,  314, 267,  343, 953, 471,  20,   223,  282,  302, 77,   204,  201,
      165,  248, 101, 165, 253, 108, 167, 106, 255, 162, 226,  109, 162, 228,  231,  162,  227,  258, 162,  227,  120,
      162,  228, 233, 223, 162, 227, 107, 162, 227, 126, 162,  227, 107, 162,  228,  235,  223,  175, 256,  249,  225,
      175,  256, 242, 238, 175, 256, 240, 124, 452, 14,  1898, 22,  16,  2679, 25,   26,   1400, 48,  655,  1981, 876};
  EXPECT_EQ(tiny().encode(text, false), want_gpt2);
}

TEST(TokenizerTest, ConcurrentEncodeAgrees) {
  // Threads encode the same texts with a fresh tokenizer, so they fill its
  // BPE cache concurrently; the expected ids come from another instance.
  auto fresh = tiny_with([](json&, json&) {});
  ASSERT_TRUE(fresh);
  const Tokenizer& t = *fresh;
  std::vector<std::string> texts;
  std::vector<Ids> want;
  for (int i = 0; i < 16; ++i) {
    texts.push_back("def f" + std::to_string(i) + "(x):\n    return [x * i for i in range(" + std::to_string(i * 7) +
                    ")]  # \u4f60\u597d\n");
    want.push_back(tiny().encode(texts.back()));
  }
  std::vector<int> mismatches(8, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 8; ++k)
    threads.emplace_back([&, k] {
      for (int rep = 0; rep < 50; ++rep)
        for (size_t i = 0; i < texts.size(); ++i) mismatches[k] += t.encode(texts[i]) != want[i];
    });
  for (auto& th : threads) th.join();
  for (int k = 0; k < 8; ++k) EXPECT_EQ(mismatches[k], 0);
}

// ---- Load errors ---------------------------------------------------------------

// Loads a directory holding `tokenizer_json` (unless null) and
// `config_json` (default: the tiny model's tokenizer_config.json).
Status load_status(const char* tokenizer_json, const std::string& config_json = "") {
  std::string dir = testing::make_temp_dir("nucleus_tok");
  if (tokenizer_json) write_file(dir + "/tokenizer.json", tokenizer_json);
  write_file(
      dir + "/tokenizer_config.json",
      config_json.empty() ? read_json(testing::model_path("tiny-dsv3/tokenizer_config.json")).dump() : config_json);
  auto t = Tokenizer::load(dir);
  return t.ok() ? ok_status() : t.status();
}

Status load_status(const json& tokenizer, const json& config = mini_config()) {
  std::string text = tokenizer.dump();
  return load_status(text.c_str(), config.dump());
}

// Expects a load error of `code` whose message contains `part`.
void expect_error(const Status& s, StatusCode code, const std::string& part) {
  ASSERT_FALSE(s.ok()) << "expected an error containing: " << part;
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(part), std::string::npos) << "message: " << s.message() << "\nexpected: " << part;
}

TEST(TokenizerTest, LoadErrorsForFiles) {
  expect_error(load_status("{\"model\": {"), StatusCode::kInvalidArgument, "/tokenizer.json: not valid JSON");
  expect_error(load_status("[1, 2]"), StatusCode::kInvalidArgument, "/tokenizer.json: not a JSON object");
  expect_error(load_status(nullptr), StatusCode::kNotFound, "/tokenizer.json: cannot open");
  std::string missing = testing::make_temp_dir("nucleus_tok_none") + "/absent";
  auto t = Tokenizer::load(missing);
  ASSERT_FALSE(t.ok());
  expect_error(t.status(), StatusCode::kNotFound, missing + "/tokenizer.json");

  std::string tok = mini_tokenizer(digits_in_threes()).dump();
  expect_error(load_status(tok.c_str(), "not json"), StatusCode::kInvalidArgument,
               "/tokenizer_config.json: not valid JSON");
  std::string dir = testing::make_temp_dir("nucleus_tok_nocfg");
  write_file(dir + "/tokenizer.json", tok);
  t = Tokenizer::load(dir);
  ASSERT_FALSE(t.ok());
  expect_error(t.status(), StatusCode::kNotFound, "/tokenizer_config.json: cannot open");
}

TEST(TokenizerTest, LoadErrorsForUnsupportedComponents) {
  const auto kUnsupported = StatusCode::kUnsupported;
  expect_error(load_status(mini_tokenizer({{"type", "Metaspace"}, {"replacement", "_"}})), kUnsupported,
               "tokenizer.json: pre_tokenizer type 'Metaspace' is not supported");
  expect_error(load_status(mini_tokenizer(sequence({split(R"(\d)", "Isolated"), {{"type", "Whitespace"}}}))),
               kUnsupported, "tokenizer.json: pre_tokenizer.pretokenizers[1] type 'Whitespace' is not supported");
  expect_error(load_status(mini_tokenizer(split(R"(\d)", "Sideways"))), kUnsupported,
               "Split behavior \"Sideways\" is not supported");
  expect_error(load_status(mini_tokenizer(split("(unclosed", "Isolated"))), StatusCode::kInvalidArgument,
               "tokenizer.json: pre_tokenizer: Split pattern: regex '(unclosed' does not compile");

  json j = mini_tokenizer(digits_in_threes());
  j["normalizer"] = {{"type", "NFKC"}};
  expect_error(load_status(j), kUnsupported, "tokenizer.json: normalizer type 'NFKC' is not supported");
  j = mini_tokenizer(digits_in_threes());
  j["decoder"] = {{"type", "Metaspace"}};
  expect_error(load_status(j), kUnsupported, "tokenizer.json: decoder type 'Metaspace' is not supported");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["type"] = "WordPiece";
  expect_error(load_status(j), kUnsupported, "tokenizer.json: model type 'WordPiece' is not supported");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["byte_fallback"] = true;
  expect_error(load_status(j), kUnsupported, "tokenizer.json: model.byte_fallback true is not supported");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["dropout"] = 0.1;
  expect_error(load_status(j), kUnsupported, "tokenizer.json: model.dropout 0.1 is not supported");
}

TEST(TokenizerTest, LoadErrorsForBadVocabMergesAndAddedTokens) {
  const auto kInvalid = StatusCode::kInvalidArgument;
  json j = mini_tokenizer(digits_in_threes());
  j.erase("model");
  expect_error(load_status(j), kInvalid, "tokenizer.json: missing object field 'model'");
  j = mini_tokenizer(digits_in_threes());
  j["model"].erase("vocab");
  expect_error(load_status(j), kInvalid, "tokenizer.json: missing object field 'model.vocab'");
  // No merges: HF tokenizers refuses the file; loading it would split every word into bytes.
  j = mini_tokenizer(digits_in_threes());
  j["model"].erase("merges");
  expect_error(load_status(j), kInvalid, "tokenizer.json: model.merges is missing (a BPE model needs its merges)");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["vocab"]["a"] = "ten";
  expect_error(load_status(j), kInvalid, "tokenizer.json: model.vocab['a'] must be an integer id");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["vocab"]["z"] = 3;  // 3 is "3"
  expect_error(load_status(j), kInvalid, "model.vocab gives id 3 to both");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["merges"].push_back(json::array({"b", "z"}));
  expect_error(load_status(j), kInvalid,
               "tokenizer.json: model.merges[5] (\"b\", \"z\") refers to 'z', which is not in model.vocab");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["merges"].push_back(json::array({"b", "a"}));  // "ba" is not a token
  expect_error(load_status(j), kInvalid, "refers to 'ba', which is not in model.vocab");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["merges"] = json::array({"1  2"});
  expect_error(load_status(j), kInvalid, "model.merges[0] \"1  2\" is not two tokens separated by one space");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["merges"] = json::array({json::array({"1", 2})});
  expect_error(load_status(j), kInvalid, "model.merges[0] must be \"a b\" or [\"a\", \"b\"], got [\"1\",2]");
  j = mini_tokenizer(digits_in_threes());
  j["model"]["unk_token"] = "<unk>";
  expect_error(load_status(j), kInvalid, "model.unk_token '<unk>' is not in model.vocab");
  j = mini_tokenizer(digits_in_threes());
  j["added_tokens"].push_back(added_token(3, "<x>", true));  // 3 is "3"
  expect_error(load_status(j), kInvalid, "added_tokens[2]: '<x>' has id 3, which is already the id of '3'");
  j = mini_tokenizer(digits_in_threes());
  j["added_tokens"].push_back(added_token(30, "<s>", true));
  expect_error(load_status(j), kInvalid, "added_tokens[2]: '<s>' repeats with id 30 (earlier: 18)");
  j = mini_tokenizer(digits_in_threes());
  j["added_tokens"][0].erase("content");
  expect_error(load_status(j), kInvalid, "added_tokens[0]: missing string field 'content'");
  j = mini_tokenizer(digits_in_threes());
  j["added_tokens"][1]["special"] = "yes";
  expect_error(load_status(j), kInvalid, "added_tokens[1]: field 'special' must be true or false, got \"yes\"");
}

TEST(TokenizerTest, LoadErrorsForBadConfig) {
  const auto kInvalid = StatusCode::kInvalidArgument;
  json j = mini_tokenizer(digits_in_threes());
  json c = mini_config();
  c["bos_token"] = "<missing>";
  expect_error(load_status(j, c), kInvalid, "tokenizer_config.json: bos_token '<missing>' is not a token");
  c = mini_config();
  c["eos_token"] = 7;
  expect_error(load_status(j, c), kInvalid, "tokenizer_config.json: field 'eos_token' must be a string");
  c = mini_config();
  c["add_eos_token"] = "yes";
  expect_error(load_status(j, c), kInvalid, "tokenizer_config.json: field 'add_eos_token' must be true or false");
  c = mini_config();
  c.erase("bos_token");
  c["add_bos_token"] = true;
  expect_error(load_status(j, c), kInvalid, "tokenizer_config.json: add_bos_token is true but bos_token is not set");
  c = mini_config();
  c["chat_template"] = 42;
  expect_error(load_status(j, c), kInvalid, "tokenizer_config.json: chat_template must be a string");
}

}  // namespace
}  // namespace nucleus
