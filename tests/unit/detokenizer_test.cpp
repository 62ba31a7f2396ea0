// Incremental detokenization with the tiny model's byte-level tokenizer: the
// reference generations stream back to their decoded text, multi-byte
// characters split over byte tokens are never cut, and stop strings stop at
// the right place without leaking a partial match. (In this tokenizer every
// byte of a CJK character or emoji is a token of its own.)
#include "io/detokenizer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;

const Tokenizer& tiny() {
  static std::unique_ptr<Tokenizer> t = [] {
    auto r = Tokenizer::load(testing::model_path("tiny-dsv3"));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    return r.ok() ? std::move(r).value() : nullptr;
  }();
  return *t;
}

Ids encode(const std::string& text) { return tiny().encode(text, /*add_special_tokens=*/false); }

// Whether `s` is whole UTF-8 characters (no cut sequence, no stray byte).
bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

// Feeds `ids` one at a time; the pieces add() returned (finish() not called).
std::vector<std::string> feed(IncrementalDetokenizer& d, const Ids& ids) {
  std::vector<std::string> pieces;
  for (int32_t id : ids) pieces.push_back(d.add(id));
  return pieces;
}

std::string join(const std::vector<std::string>& pieces) {
  std::string s;
  for (const auto& p : pieces) s += p;
  return s;
}

// All the text of `ids`: the add() pieces, then finish().
std::string stream_all(IncrementalDetokenizer& d, const Ids& ids) {
  std::string s = join(feed(d, ids));
  return s + d.finish();
}

TEST(DetokenizerTest, ReferenceGenerationsStreamToTheirDecodedText) {
  std::ifstream in(testing::model_path("ref/cases.json"));
  json cases = json::parse(in);
  int checked = 0;
  for (const char* model : {"tiny-dsv3", "tiny-dsv3-fp8"}) {
    for (const json& c : cases[model]) {
      Ids ids = c["greedy_token_ids"].get<Ids>();
      IncrementalDetokenizer d(tiny(), {});
      std::string streamed = stream_all(d, ids);
      EXPECT_EQ(streamed, tiny().decode(ids, /*skip_special_tokens=*/true));
      EXPECT_EQ(streamed, c["greedy_text"].get<std::string>());
      EXPECT_EQ(d.text(), streamed);
      EXPECT_FALSE(d.stopped());
      ++checked;
    }
  }
  EXPECT_EQ(checked, 12);
}

TEST(DetokenizerTest, MultiByteCharactersAreNeverCut) {
  const std::string text = "你好，世界！🎉 héllo wörld ok";
  Ids ids = encode(text);
  int partial_tokens = 0;  // tokens that are not whole characters on their own
  for (int32_t id : ids) partial_tokens += !valid_utf8(tiny().token_bytes(id));
  ASSERT_GT(partial_tokens, 10) << "the test needs characters split across tokens";
  IncrementalDetokenizer d(tiny(), {});
  std::vector<std::string> pieces = feed(d, ids);
  for (const auto& p : pieces) EXPECT_TRUE(valid_utf8(p)) << "piece cuts a character: " << p;
  EXPECT_EQ(join(pieces), text);
  EXPECT_EQ(d.finish(), "");
  // "你" is three byte tokens: nothing until the third.
  IncrementalDetokenizer one(tiny(), {});
  Ids ni = encode("你");
  ASSERT_EQ(ni.size(), 3u);
  EXPECT_EQ(one.add(ni[0]), "");
  EXPECT_EQ(one.add(ni[1]), "");
  EXPECT_EQ(one.add(ni[2]), "你");
}

TEST(DetokenizerTest, StopStringAcrossTokens) {
  // "world. STOP" starts inside the token " w" and spans " w", "or", "ld",
  // ".", " STOP".
  const std::string stop = "world. STOP";
  for (bool include : {false, true}) {
    const std::string expected = include ? "Hello world. STOP" : "Hello ";
    IncrementalDetokenizer d(tiny(), {stop}, true, include);
    std::string released;
    for (int32_t id : encode("Hello world. STOP here and more")) {
      released += d.add(id);
      // No piece ever carries text past the final answer: the partial
      // match "w", "wor", "world", "world." stays held back.
      EXPECT_EQ(expected.compare(0, released.size(), released), 0) << "leaked: " << released;
    }
    EXPECT_TRUE(d.stopped());
    EXPECT_EQ(d.stop_string(), stop);
    EXPECT_EQ(released, expected);
    EXPECT_EQ(d.text(), released);
    // Nothing after a stop, even at finish.
    EXPECT_EQ(d.add(encode(" x")[0]), "");
    EXPECT_EQ(d.finish(), "");
    EXPECT_EQ(d.text(), released);
  }
}

TEST(DetokenizerTest, StopStringInsideOneToken) {
  // "abc" is one token; the text after "b" in it must not come out.
  IncrementalDetokenizer d(tiny(), {"b"});
  EXPECT_EQ(join(feed(d, encode("xxabcdef"))), "xxa");
  EXPECT_TRUE(d.stopped());
}

TEST(DetokenizerTest, MultiByteStopStrings) {
  {
    IncrementalDetokenizer d(tiny(), {"世界"});
    std::vector<std::string> pieces = feed(d, encode("你好，世界！再见"));
    for (const auto& p : pieces) EXPECT_TRUE(valid_utf8(p));
    EXPECT_EQ(join(pieces), "你好，");
    EXPECT_TRUE(d.stopped());
    EXPECT_EQ(d.stop_string(), "世界");
  }
  {
    IncrementalDetokenizer d(tiny(), {"🎉"}, true, /*include_stop_str_in_output=*/true);
    EXPECT_EQ(join(feed(d, encode("party 🎉 time"))), "party 🎉");
    EXPECT_TRUE(d.stopped());
  }
  {
    // Same first character, then a different one: "世" is held back, then
    // released with what follows.
    IncrementalDetokenizer d(tiny(), {"世界"});
    Ids ids = encode("世人");
    std::string first = join(feed(d, Ids(ids.begin(), ids.begin() + 3)));
    EXPECT_EQ(first, "");
    EXPECT_EQ(join(feed(d, Ids(ids.begin() + 3, ids.end()))), "世人");
    EXPECT_FALSE(d.stopped());
  }
}

TEST(DetokenizerTest, PartialMatchThatDivergesIsReleased) {
  IncrementalDetokenizer d(tiny(), {"STOP"});
  // Tokens: "a", " ST", "O", "X", " b", " STOP", " c".
  Ids ids = encode("a STOX b STOP c");
  ASSERT_EQ(ids.size(), 7u);
  EXPECT_EQ(d.add(ids[0]), "a");
  EXPECT_EQ(d.add(ids[1]), " ");    // "ST" held
  EXPECT_EQ(d.add(ids[2]), "");     // "STO" held
  EXPECT_EQ(d.add(ids[3]), "STOX");  // diverged: released
  EXPECT_EQ(d.add(ids[4]), " b");
  EXPECT_EQ(d.add(ids[5]), " ");
  EXPECT_TRUE(d.stopped());
  EXPECT_EQ(d.text(), "a STOX b ");
  EXPECT_EQ(d.add(ids[6]), "");
}

TEST(DetokenizerTest, StopStringsThatArePrefixesOfEachOther) {
  // The first to complete wins: the shorter, whichever order they are given.
  for (auto stops : {std::vector<std::string>{"abc", "abcdef"}, std::vector<std::string>{"abcdef", "abc"}}) {
    IncrementalDetokenizer d(tiny(), stops);
    EXPECT_EQ(join(feed(d, encode("xxabcdef"))), "xx");
    EXPECT_EQ(d.stop_string(), "abc");
  }
  // Ending at the same place: the one starting earlier (less text out).
  IncrementalDetokenizer d(tiny(), {"bc", "abc"});
  EXPECT_EQ(join(feed(d, encode("xxabcdef"))), "xx");
  EXPECT_EQ(d.stop_string(), "abc");
  // Only the longer one's prefix is held: "abcd" is held back for "abcdef"
  // until it diverges.
  IncrementalDetokenizer longer(tiny(), {"abcdef", "zz"});
  Ids ids = encode("xxabcdex");
  std::string before_last = join(feed(longer, Ids(ids.begin(), ids.end() - 1)));
  EXPECT_EQ(before_last, "xx");
  std::string last = longer.add(ids.back());
  EXPECT_EQ(last + longer.finish(), "abcdex");
  EXPECT_FALSE(longer.stopped());
}

TEST(DetokenizerTest, FinishReleasesAPartialStopPrefix) {
  IncrementalDetokenizer d(tiny(), {"STOP"});
  EXPECT_EQ(join(feed(d, encode("value: ST"))), "value: ");
  EXPECT_EQ(d.finish(), "ST");
  EXPECT_EQ(d.text(), "value: ST");
  EXPECT_FALSE(d.stopped());
  EXPECT_EQ(d.stop_string(), "");
  EXPECT_EQ(d.finish(), "");  // once only
}

TEST(DetokenizerTest, IncompleteOrInvalidUtf8BecomesReplacementCharacters) {
  // An incomplete tail at finish: one U+FFFD (Python's errors="replace").
  Ids ids = encode("ok 世");
  IncrementalDetokenizer d(tiny(), {});
  EXPECT_EQ(join(feed(d, Ids(ids.begin(), ids.end() - 1))), "ok ");
  EXPECT_EQ(d.finish(), "\xEF\xBF\xBD");
  // Bytes that can never become a character are replaced as they arrive: a
  // lead byte followed by ASCII, and a stray continuation byte.
  Ids lead = encode("世");
  Ids cont = encode("\x80");
  ASSERT_EQ(cont.size(), 1u);
  IncrementalDetokenizer bad(tiny(), {});
  EXPECT_EQ(bad.add(lead[0]), "");
  EXPECT_EQ(bad.add(encode("A")[0]), "\xEF\xBF\xBD" "A");
  EXPECT_EQ(bad.add(cont[0]), "\xEF\xBF\xBD");
  EXPECT_TRUE(valid_utf8(bad.text()));
}

TEST(DetokenizerTest, SpecialTokens) {
  const Tokenizer& t = tiny();
  ASSERT_TRUE(t.bos_id().has_value());
  ASSERT_TRUE(t.is_special(*t.bos_id()));
  Ids ids = encode("hi");
  ids.insert(ids.begin(), *t.bos_id());
  IncrementalDetokenizer skip(t, {});
  EXPECT_EQ(stream_all(skip, ids), "hi");
  IncrementalDetokenizer keep(t, {}, /*skip_special_tokens=*/false);
  EXPECT_EQ(stream_all(keep, ids), t.bos_token() + "hi");
  EXPECT_EQ(keep.text(), t.decode(ids));
}

TEST(DetokenizerTest, EmptyStopStringsAreIgnored) {
  IncrementalDetokenizer d(tiny(), {"", "zzz"});
  EXPECT_EQ(stream_all(d, encode("hello")), "hello");
  EXPECT_FALSE(d.stopped());
}

}  // namespace
}  // namespace nucleus
