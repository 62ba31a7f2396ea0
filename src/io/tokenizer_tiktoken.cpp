// Tokenizer::from_tiktoken: Kimi-K2's tiktoken-format tokenizer on the
// shared byte-level BPE (see tokenizer.h), and Kimi's encode() chunking.
#include <algorithm>
#include <charconv>
#include <map>
#include <string>
#include <vector>

#include "io/tiktoken_ranks.h"
#include "io/tokenizer.h"
#include "io/tokenizer_internal.h"

namespace nucleus {

using json = nlohmann::json;
using namespace tokenizer_internal;

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::from_tiktoken(std::string_view ranks_text, const json& config,
                                                              const std::string& chat_template,
                                                              std::string_view pattern) {
  const std::string w = "tiktoken.model";
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->chat_template_ = chat_template;
  try {
    if (!config.is_object()) return invalid_argument("tokenizer_config.json: not a JSON object");
    NUCLEUS_ASSIGN_OR_RETURN(std::vector<std::string> ranks, parse_tiktoken_ranks(ranks_text, w));
    const auto n = static_cast<int64_t>(ranks.size());
    if (n + kKimiReservedSpecialTokens - 1 > kMaxTokenId)
      return invalid_argument(w + ": " + std::to_string(n) + " ranks leave no room for the special tokens under id " +
                              std::to_string(kMaxTokenId));

    // The vocabulary in the byte-level alphabet, as HF's converted tiktoken
    // tokenizers spell it, so the BPE and ByteLevel steps are shared.
    const ByteAlphabet& a = byte_alphabet();
    StringMap by_bytes;  // raw token bytes -> rank
    by_bytes.reserve(ranks.size());
    t->tokens_.resize(ranks.size());
    t->vocab_.reserve(ranks.size());
    for (int32_t id = 0; id < n; ++id) {
      std::string& token = t->tokens_[id];
      for (char c : ranks[id]) token += a.byte_to_char[static_cast<unsigned char>(c)];
      t->vocab_.emplace(token, id);
      by_bytes.emplace(ranks[id], id);
    }
    for (int b = 0; b < 256; ++b)
      if (!by_bytes.contains(std::string(1, static_cast<char>(b))))
        return invalid_argument(w + ": byte " + std::to_string(b) +
                                " has no rank (tiktoken needs a token for each of the 256 bytes)");
    // tiktoken merges the adjacent pair whose concatenation has the lowest
    // rank: every split (a, b) of a token into two tokens is a merge whose
    // rank is the token's.
    for (int32_t id = 0; id < n; ++id) {
      std::string_view bytes = ranks[id];
      for (size_t k = 1; k < bytes.size(); ++k) {
        auto left = by_bytes.find(bytes.substr(0, k));
        if (left == by_bytes.end()) continue;
        auto right = by_bytes.find(bytes.substr(k));
        if (right == by_bytes.end()) continue;
        t->merges_.emplace((static_cast<uint64_t>(left->second) << 32) | static_cast<uint32_t>(right->second),
                           std::make_pair(id, id));
      }
    }
    t->ignore_merges_ = true;  // a pre-token that is a token stays whole
    t->kimi_chunking_ = true;

    // Special tokens: the reserved ids after the ranks, plus any further
    // ids tokenizer_config.json names.
    std::map<int64_t, json> named;
    if (const json* decoder = field(config, "added_tokens_decoder")) {
      if (!decoder->is_object())
        return invalid_argument("tokenizer_config.json: added_tokens_decoder must be an object {\"id\": {...}}");
      for (const auto& [key, entry] : decoder->items()) {
        int64_t id = -1;
        auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
        if (ec != std::errc() || end != key.data() + key.size() || id < n || id > kMaxTokenId)
          return invalid_argument("tokenizer_config.json: added_tokens_decoder key '" + key +
                                  "' must be an id in [" + std::to_string(n) + ", " + std::to_string(kMaxTokenId) +
                                  "] (the ids before are tiktoken.model's ranks)");
        named[id] = entry;
      }
    }
    for (int64_t id = n; id < n + kKimiReservedSpecialTokens; ++id) {
      std::string name = "<|reserved_token_";
      name += std::to_string(id);
      name += "|>";
      named.try_emplace(id, json{{"content", std::move(name)}});
    }
    json added = json::array();
    for (auto& [id, entry] : named) {
      json e = entry.is_object() ? entry : json::object();
      e["id"] = id;
      e["special"] = true;      // tiktoken's special tokens
      e["normalized"] = false;  // no normalizer runs anyway
      added.push_back(std::move(e));
    }
    NUCLEUS_RETURN_IF_ERROR(t->parse_added_tokens(added, /*vocab_ids_first=*/false));

    json pre = {{"type", "Sequence"},
                {"pretokenizers",
                 {{{"type", "Split"},
                   {"pattern", {{"Regex", std::string(pattern)}}},
                   {"behavior", "Removed"},  // with invert: the matches are the pre-tokens, text between
                   {"invert", true}},        // them (none with Kimi's pattern) is dropped, as tiktoken does
                  {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    NUCLEUS_RETURN_IF_ERROR(t->parse_pre_tokenizer(pre, "tiktoken pattern"));

    // Decoded bytes: the ranks' bytes, and the special tokens' own text.
    t->bytes_.resize(t->tokens_.size());
    for (size_t id = 0; id < t->tokens_.size(); ++id) {
      t->bytes_[id] = static_cast<int64_t>(id) < n ? std::move(ranks[id]) : t->tokens_[id];
      t->max_token_bytes_ = std::max(t->max_token_bytes_, static_cast<int64_t>(t->bytes_[id].size()));
    }
    NUCLEUS_RETURN_IF_ERROR(t->parse_config(config, /*default_add_bos=*/false));
  } catch (const json::exception& e) {
    return invalid_argument(std::string("tokenizer_config.json: unexpected JSON shape: ") + e.what());
  }
  return t;
}

namespace {

// Python's str.isspace(): Unicode White_Space plus U+001C..U+001F.
bool python_isspace(std::string_view s, size_t i) {
  uint32_t cp = 0;
  return utf8_char_len(s, i, &cp) != 0 && (is_white_space(cp) || (cp >= 0x1C && cp <= 0x1F));
}

}  // namespace

std::vector<std::string_view> Tokenizer::kimi_chunks(std::string_view text) {
  std::vector<std::string_view> out;
  size_t slice_begin = 0;
  while (slice_begin < text.size()) {
    // A slice of kKimiMaxEncodeChars characters (Python indexes by code point).
    size_t slice_end = slice_begin;
    for (size_t n = 0; n < kKimiMaxEncodeChars && slice_end < text.size(); ++n) slice_end += char_step(text, slice_end);
    std::string_view slice = text.substr(slice_begin, slice_end - slice_begin);
    // _split_whitespaces_or_nonwhitespaces: cut before the character that
    // makes a run of the same kind longer than kKimiMaxRunChars.
    size_t run = 0, start = 0;
    bool run_is_space = python_isspace(slice, 0);
    for (size_t i = 0; i < slice.size(); i += char_step(slice, i)) {
      bool space = python_isspace(slice, i);
      if (space != run_is_space) {
        run = 1;
        run_is_space = space;
      } else if (++run > kKimiMaxRunChars) {
        out.push_back(slice.substr(start, i - start));
        start = i;
        run = 1;
      }
    }
    out.push_back(slice.substr(start));
    slice_begin = slice_end;
  }
  return out;
}

}  // namespace nucleus
