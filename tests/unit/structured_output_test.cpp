// Structured output (runtime/structured_output.h) with tiny-dsv3's tokenizer:
// the matcher accepts token sequences of valid documents and refuses invalid
// ones at the first token that cannot continue; its bitmask allows the stop
// token only after a complete document and never special tokens or ids past
// the tokenizer; bad schemas are errors; apply_token_bitmask against hand
// values; and sampling through the mask (random logits, several seeds) always
// yields a document that parses and matches the schema.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "runtime/sampler.h"
#include "runtime/structured_output.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

constexpr int32_t kEos = 1;  // tiny-dsv3: <|end_of_text|>; 0 and 2 are special too

// name: a string of at most 8 characters; age: an integer in [0, 150];
// tags: up to 3 of two words.
const char* kSchema = R"({"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 8},
  "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}},
  "required": ["name", "age"], "additionalProperties": false})";

class StructuredOutputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto tok = Tokenizer::load(testing::model_path("tiny-dsv3"));
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    tokenizer_ = std::move(*tok).release();
    auto c = GrammarCompiler::create(*tokenizer_, tokenizer_->vocab_size(), {kEos});
    if (!c.ok() && c.status().code() == StatusCode::kUnsupported) return;  // built without xgrammar
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    compiler_ = std::move(*c).release();
  }
  void SetUp() override {
    if (!compiler_) GTEST_SKIP() << "built without xgrammar (-DNUCLEUS_XGRAMMAR=OFF)";
  }

  static std::shared_ptr<const CompiledGrammar> compile(StructuredOutputSpec::Kind kind, const std::string& text,
                                                        std::vector<std::string> choices = {}) {
    StructuredOutputSpec spec;
    spec.kind = kind;
    spec.text = text;
    spec.choices = std::move(choices);
    auto g = compiler_->compile(spec);
    EXPECT_TRUE(g.ok()) << g.status().to_string();
    return g.ok() ? *g : nullptr;
  }

  // Feeds `text`'s tokens; returns how many were accepted (all: the size).
  static size_t feed(GrammarMatcher& m, const std::string& text) {
    const std::vector<int32_t> ids = tokenizer_->encode(text, /*add_special_tokens=*/false);
    for (size_t i = 0; i < ids.size(); ++i)
      if (!m.accept_token(ids[i])) return i;
    return ids.size();
  }

  static std::vector<int32_t> mask_of(GrammarMatcher& m) {
    std::vector<int32_t> mask(token_bitmask_words(m.vocab_size()), 0x5a5a5a5a);
    m.fill_next_token_bitmask(mask.data());
    return mask;
  }
  static bool allowed(const std::vector<int32_t>& mask, int32_t t) { return (mask[t / 32] >> (t % 32)) & 1; }

  static Tokenizer* tokenizer_;
  static GrammarCompiler* compiler_;
};
Tokenizer* StructuredOutputTest::tokenizer_ = nullptr;
GrammarCompiler* StructuredOutputTest::compiler_ = nullptr;

TEST_F(StructuredOutputTest, ValidDocumentIsAcceptedAndTerminatesOnStop) {
  auto g = compile(StructuredOutputSpec::Kind::kJsonSchema, kSchema);
  for (const std::string doc : {R"({"name": "Bob", "age": 42})", R"({"name":"","age":0,"tags":["red","blue"]})",
                                "{\n  \"name\": \"Ann\",\n  \"age\": 150\n}"}) {
    GrammarMatcher m(g);
    const size_t n = tokenizer_->encode(doc, false).size();
    EXPECT_EQ(feed(m, doc), n) << doc;
    EXPECT_FALSE(m.is_terminated());
    EXPECT_TRUE(allowed(mask_of(m), kEos)) << doc;
    EXPECT_TRUE(m.accept_token(kEos));
    EXPECT_TRUE(m.is_terminated());
    EXPECT_FALSE(m.accept_token(kEos));  // nothing follows
  }
}

TEST_F(StructuredOutputTest, InvalidDocumentIsRefusedAtTheFirstBadToken) {
  auto g = compile(StructuredOutputSpec::Kind::kJsonSchema, kSchema);
  struct Case {
    std::string doc, good_prefix;  // the longest prefix of tokens a matcher must take
  };
  for (const Case& c : std::vector<Case>{
           {R"({"name": 42})", R"({"name": )"},                              // wrong type
           {R"({"age": 1, "name": "x"})", R"({")"},                          // order: name first
           {R"({"name": "x", "age": 151})", R"({"name": "x", "age": 15)"},    // past maximum
           {R"({"name": "x", "age": 1, "extra": 1})", R"({"name": "x", "age": 1, ")"},  // "tags" only
           {R"({"name": "abcdefghi", "age": 1})", R"({"name": "abcdefgh)"},   // maxLength
           {R"([1])", ""}}) {
    GrammarMatcher m(g);
    const std::vector<int32_t> ids = tokenizer_->encode(c.doc, false);
    const size_t accepted = feed(m, c.doc);
    ASSERT_LT(accepted, ids.size()) << c.doc << " was accepted whole";
    // Every token before the refused one lies within the valid prefix, and
    // the refused one reaches past it.
    const std::string before = tokenizer_->decode(std::vector<int32_t>(ids.begin(), ids.begin() + accepted));
    EXPECT_LE(before.size(), c.good_prefix.size()) << c.doc;
    EXPECT_EQ(c.good_prefix.substr(0, before.size()), before) << c.doc;
    EXPECT_GT(before.size() + tokenizer_->token_bytes(ids[accepted]).size(), c.good_prefix.size()) << c.doc;
    EXPECT_FALSE(allowed(mask_of(m), ids[accepted])) << c.doc;  // the mask agrees with accept
  }
}

TEST_F(StructuredOutputTest, StopOnlyAfterACompleteDocument) {
  auto g = compile(StructuredOutputSpec::Kind::kJsonSchema, kSchema);
  GrammarMatcher m(g);
  const std::vector<int32_t> ids = tokenizer_->encode(R"({"name": "Bob", "age": 42})", false);
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::vector<int32_t> mask = mask_of(m);
    EXPECT_FALSE(allowed(mask, kEos)) << "stop allowed after " << i << " tokens";
    EXPECT_TRUE(allowed(mask, ids[i])) << i;
    for (int32_t special : {0, 2}) EXPECT_FALSE(allowed(mask, special));
    ASSERT_TRUE(m.accept_token(ids[i]));
  }
  EXPECT_FALSE(m.accept_token(0));  // a special token is never text
}

TEST_F(StructuredOutputTest, IdsPastTheTokenizerAreNeverAllowed) {
  // A logits width past the tokenizer (published checkpoints pad vocab_size).
  const int64_t vocab = tokenizer_->vocab_size() + 45;
  auto c = GrammarCompiler::create(*tokenizer_, vocab, {kEos});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  StructuredOutputSpec spec;  // json_object: text of many kinds is allowed inside strings
  auto g = (*c)->compile(spec);
  ASSERT_TRUE(g.ok());
  GrammarMatcher m(*g);
  ASSERT_EQ(feed(m, R"({"k": "v)"), tokenizer_->encode(R"({"k": "v)", false).size());
  const std::vector<int32_t> mask = mask_of(m);
  ASSERT_EQ(mask.size(), static_cast<size_t>(token_bitmask_words(vocab)));
  int64_t num_allowed = 0;
  for (int64_t t = 0; t < vocab; ++t) num_allowed += allowed(mask, static_cast<int32_t>(t));
  EXPECT_GT(num_allowed, 1000);  // most of a string's continuations
  for (int64_t t = tokenizer_->vocab_size(); t < vocab; ++t) EXPECT_FALSE(allowed(mask, static_cast<int32_t>(t))) << t;
  EXPECT_FALSE(m.accept_token(static_cast<int32_t>(vocab - 1)));
  EXPECT_FALSE(m.accept_token(static_cast<int32_t>(vocab)));
  EXPECT_FALSE(m.accept_token(-1));
  // Bad arguments.
  EXPECT_FALSE(GrammarCompiler::create(*tokenizer_, 0, {}).ok());
  EXPECT_FALSE(GrammarCompiler::create(*tokenizer_, vocab, {static_cast<int32_t>(vocab)}).ok());
}

TEST_F(StructuredOutputTest, JsonObjectRegexChoiceGrammar) {
  using Kind = StructuredOutputSpec::Kind;
  struct Case {
    Kind kind;
    std::string text;
    std::vector<std::string> choices;
    std::string good, bad;
  };
  for (const Case& c : std::vector<Case>{
           {Kind::kJsonObject, "", {}, R"({"a": [1, {"b": null}]})", R"("just a string")"},
           {Kind::kRegex, "[0-9]{3}-[a-z]+", {}, "123-abc", "12-abc"},
           {Kind::kChoice, "", {"yes", "no", "say \"hi\""}, "say \"hi\"", "maybe"},
           {Kind::kGrammar, R"g(root ::= "(" [0-9]+ ")")g", {}, "(42)", "(4a)"},
           {Kind::kGrammar, "start: \"x\" NUM\nNUM: /[0-9]+/", {}, "x12", "y12"}}) {
    auto g = compile(c.kind, c.text, c.choices);
    ASSERT_TRUE(g) << c.text;
    GrammarMatcher good(g), bad(g);
    EXPECT_EQ(feed(good, c.good), tokenizer_->encode(c.good, false).size()) << c.good;
    EXPECT_TRUE(good.accept_token(kEos)) << c.good;
    EXPECT_TRUE(good.is_terminated());
    const size_t n = tokenizer_->encode(c.bad, false).size();
    const size_t taken = feed(bad, c.bad);
    EXPECT_TRUE(taken < n || !bad.accept_token(kEos)) << c.bad << " was accepted";
  }
}

TEST_F(StructuredOutputTest, BadSpecsAreInvalidArgument) {
  using Kind = StructuredOutputSpec::Kind;
  for (const auto& [kind, text] : std::vector<std::pair<Kind, std::string>>{
           {Kind::kJsonSchema, "{"},                         // not JSON
           {Kind::kJsonSchema, R"({"type": "nonsense"})"},   // not a type
           {Kind::kJsonSchema, R"({"type": "integer", "minimum": 5, "maximum": 1})"},  // unsatisfiable
           {Kind::kRegex, "([a-z]"},
           {Kind::kGrammar, "root ::= undefined_rule"}}) {
    StructuredOutputSpec spec;
    spec.kind = kind;
    spec.text = text;
    auto g = compiler_->compile(spec);
    ASSERT_FALSE(g.ok()) << text << " compiled";
    EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_FALSE(g.status().message().empty());
  }
  StructuredOutputSpec empty_choice;
  empty_choice.kind = Kind::kChoice;
  EXPECT_FALSE(compiler_->compile(empty_choice).ok());
}

TEST_F(StructuredOutputTest, BatchFillEqualsOneByOne) {
  auto g = compile(StructuredOutputSpec::Kind::kJsonSchema, kSchema);
  const std::vector<std::string> prefixes = {"", "{", R"({"name")", R"({"name": "a)", R"({"name": "ab", "age": 1)",
                                             R"({"name": "", "age": 12, "tags": [)", R"({"name":"x","age":0})"};
  for (size_t n : {size_t{3}, size_t{12}}) {  // below and above the threaded batch size
    std::vector<std::unique_ptr<GrammarMatcher>> own;
    std::vector<GrammarMatcher*> matchers;
    for (size_t i = 0; i < n; ++i) {
      own.push_back(std::make_unique<GrammarMatcher>(g));
      ASSERT_EQ(feed(*own.back(), prefixes[i % prefixes.size()]),
                tokenizer_->encode(prefixes[i % prefixes.size()], false).size());
      matchers.push_back(own.back().get());
    }
    const int64_t words = token_bitmask_words(tokenizer_->vocab_size());
    std::vector<int32_t> batch(n * words, 0x12345678);
    GrammarMatcher::fill_next_token_bitmasks(matchers, batch.data());
    for (size_t i = 0; i < n; ++i) {
      const std::vector<int32_t> one = mask_of(*matchers[i]);
      EXPECT_TRUE(std::equal(one.begin(), one.end(), batch.begin() + i * words)) << "row " << i << " of " << n;
    }
  }
}

TEST(TokenBitmaskTest, ApplyMatchesHandValues) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits(70);
  for (int i = 0; i < 70; ++i) logits[i] = static_cast<float>(i);
  // Word 0: tokens 0 and 31; word 1: all; word 2: tokens 64 and 69 (bits 0 and
  // 5), and the bits past the vocabulary (6..31) set.
  std::vector<int32_t> mask = {static_cast<int32_t>(0x80000001u), -1, static_cast<int32_t>(0xffffffe1u)};
  apply_token_bitmask(logits.data(), mask.data(), 70);
  for (int i = 0; i < 70; ++i) {
    const bool keep = i == 0 || i == 31 || (i >= 32 && i < 64) || i == 64 || i == 69;
    if (keep)
      EXPECT_EQ(logits[i], static_cast<float>(i)) << i;
    else
      EXPECT_EQ(logits[i], -inf) << i;
  }
  EXPECT_EQ(token_bitmask_words(1), 1);
  EXPECT_EQ(token_bitmask_words(32), 1);
  EXPECT_EQ(token_bitmask_words(33), 2);
  EXPECT_EQ(token_bitmask_words(129280), 4040);
}

// Minimal checks of a document against kSchema (types, bounds, keys).
bool matches_schema(const json& j) {
  if (!j.is_object() || !j.contains("name") || !j.contains("age")) return false;
  for (const auto& [k, v] : j.items())
    if (k != "name" && k != "age" && k != "tags") return false;
  if (!j["name"].is_string() || !j["age"].is_number_integer()) return false;
  // maxLength counts code points.
  const std::string name = j["name"].get<std::string>();
  int64_t chars = 0;
  for (unsigned char ch : name) chars += (ch & 0xc0) != 0x80;
  if (chars > 8 || j["age"].get<int64_t>() < 0 || j["age"].get<int64_t>() > 150) return false;
  if (j.contains("tags")) {
    if (!j["tags"].is_array() || j["tags"].size() > 3) return false;
    for (const auto& t : j["tags"])
      if (t != "red" && t != "blue") return false;
  }
  return true;
}

TEST_F(StructuredOutputTest, SamplingThroughTheMaskGivesValidDocuments) {
  auto g = compile(StructuredOutputSpec::Kind::kJsonSchema, kSchema);
  const int64_t vocab = tokenizer_->vocab_size();
  std::vector<int32_t> mask(token_bitmask_words(vocab));
  std::vector<float> logits(vocab);
  SamplingParams params;  // temperature 1
  int finished = 0;
  for (uint64_t seed = 0; seed < 8; ++seed) {
    GrammarMatcher m(g);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> d(0.0f, 2.0f);
    std::vector<int32_t> out;
    for (int step = 0; step < 400 && !m.is_terminated(); ++step) {
      for (auto& l : logits) l = d(rng);
      if (m.fill_next_token_bitmask(mask.data())) apply_token_bitmask(logits.data(), mask.data(), vocab);
      const SampleResult r = sample_token(logits.data(), vocab, params, seed, step);
      ASSERT_TRUE(m.accept_token(r.token)) << "seed " << seed << " step " << step << " token " << r.token;
      out.push_back(r.token);
    }
    if (!m.is_terminated()) continue;  // ran past the budget: a valid prefix, not checked
    ++finished;
    ASSERT_EQ(out.back(), kEos);
    out.pop_back();
    const std::string text = tokenizer_->decode(out);
    const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(j.is_discarded()) << "seed " << seed << ": not JSON: " << text;
    EXPECT_TRUE(matches_schema(j)) << "seed " << seed << ": " << text;
  }
  EXPECT_GE(finished, 6);
}

}  // namespace
}  // namespace nucleus
