// Tokenizer: byte-level BPE as in a Hugging Face tokenizer.json, plus the
// BOS/EOS/chat-template settings of tokenizer_config.json.
//
// Encoding follows the `tokenizers` library step by step, so ids match
// PreTrainedTokenizerFast exactly:
//   1. Added tokens (tokenizer.json "added_tokens") are cut out of the text
//      first, those with "normalized": false before the others, as HF does:
//      at each position the longest one wins (leftmost-longest), with their
//      lstrip / rstrip / single_word flags honoured.
//   2. Each piece between them goes through the pre-tokenizer, one of
//      ByteLevel (add_prefix_space, use_regex: the GPT-2 pattern), Split
//      (Regex or String pattern; behaviors Isolated, Removed,
//      MergedWithPrevious, MergedWithNext, Contiguous; invert), Digits, or a
//      Sequence of them (DeepSeek-V3: three Regex Splits, then ByteLevel
//      without regex). ByteLevel maps every byte to one character of the
//      GPT-2 bytes_to_unicode alphabet.
//   3. Each pre-token is split into characters, looked up in model.vocab and
//      merged by BPE: the adjacent pair with the lowest merge rank first, the
//      leftmost among equals, until no pair has a merge.
// Decoding maps token characters back to bytes (the ByteLevel decoder);
// text that is not valid UTF-8 is kept as raw bytes.
//
// Regexes from tokenizer.json (Oniguruma syntax in HF) are compiled with
// PCRE2 (UTF + UCP, JIT when available) after onig_to_pcre2
// (io/onig_regex.h): \s and \w get Oniguruma's Unicode definitions, and
// \p{..} classes the code points assigned up to Unicode 16.0.0 (HF's
// version) that the system PCRE2's Unicode 14 tables lack.
//
// Kimi-K2's tokenizer (tiktoken format: tiktoken.model, no tokenizer.json)
// is read by from_tiktoken() into the same machinery: the ranks become a
// byte-level vocabulary whose merge of an adjacent pair (a, b) has the rank
// of the token a+b, which is tiktoken's BPE (lowest-rank concatenation
// first, leftmost among equals; a pre-token that is itself a token is not
// split).
//
// Ids are those written in tokenizer.json (an added token that is also in
// model.vocab keeps its vocab id, as in HF).
//
// Supported: model BPE (no dropout, no byte_fallback, no subword prefix or
// suffix; unk_token / fuse_unk / ignore_merges honoured), normalizer null,
// decoder ByteLevel; post_processor, truncation and padding are ignored (BOS
// and EOS come from tokenizer_config.json). Anything else is a load error
// that names the file and the type, e.g.
// "tokenizer.json: pre_tokenizer type 'Metaspace' is not supported".
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"

namespace nucleus {

// Kimi-K2's pre-tokenization pattern (TikTokenTokenizer.pat_str of its
// tokenization_kimi.py), in tiktoken's (Rust fancy-regex) syntax: Han runs
// split from other letters, which use class intersections [..&&[^\p{Han}]].
inline constexpr const char* kKimiPattern =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

// How many special-token ids Kimi's tokenizer reserves after the ranks
// (num_reserved_special_tokens in tokenization_kimi.py): ids n .. n+255 for
// n ranks, named by tokenizer_config.json's added_tokens_decoder, the others
// "<|reserved_token_{id}|>".
inline constexpr int kKimiReservedSpecialTokens = 256;

namespace detail {
// A compiled PCRE2 pattern (defined in tokenizer.cpp).
class TokenizerRegex;
}  // namespace detail

class Tokenizer {
 public:
  // Loads <model_dir>/tokenizer.json and <model_dir>/tokenizer_config.json
  // (both required); a directory with <model_dir>/tiktoken.model and no
  // tokenizer.json (Kimi-K2) is read with from_tiktoken(). The chat template
  // comes from tokenizer_config.json, or else from
  // <model_dir>/chat_template.jinja when that file exists.
  // Errors name the file and the problem: kNotFound for a missing file,
  // kInvalidArgument for bad JSON or a bad field (a merge naming an unknown
  // token, a bos_token that is not a token, ...), kUnsupported for a
  // component type this engine does not implement.
  static StatusOr<std::unique_ptr<Tokenizer>> load(const std::string& model_dir);

  // Builds a tiktoken-format tokenizer (Kimi-K2) from the text of its ranks
  // file (tiktoken.model: "<base64 bytes> <rank>" lines, see
  // parse_tiktoken_ranks) and tokenizer_config.json (`config`, may be an
  // empty object), as tokenization_kimi.py's TikTokenTokenizer builds its
  // tiktoken.Encoding: pre-tokens from `pattern` (tiktoken syntax), BPE over
  // the ranks, and the special tokens ids n .. n+kKimiReservedSpecialTokens-1
  // (n ranks), named by config's added_tokens_decoder (entries with ids past
  // them are added too) or "<|reserved_token_{id}|>", all special and
  // matched in text before pre-tokenization. BOS/EOS and the chat template as
  // in from_json, except that BOS is only prepended when config sets
  // add_bos_token (Kimi's tokenizer adds none). As Kimi's encode(), texts
  // longer than 400,000 characters, and runs of more than 25,000 characters
  // without (or of only) whitespace, are cut into chunks encoded
  // separately (see kimi_chunks). Errors: kInvalidArgument
  // naming tiktoken.model and the line, or tokenizer_config.json and the
  // field; a ranks file lacking one of the 256 single bytes (tiktoken
  // cannot encode with it) is refused.
  static StatusOr<std::unique_ptr<Tokenizer>> from_tiktoken(std::string_view ranks_text, const nlohmann::json& config,
                                                            const std::string& chat_template = "",
                                                            std::string_view pattern = kKimiPattern);

  // Builds a tokenizer from the parsed contents of tokenizer.json and
  // tokenizer_config.json (`config` may be an empty object). `chat_template`
  // is used when `config` has none. Errors as load(), naming the files by
  // their base names.
  static StatusOr<std::unique_ptr<Tokenizer>> from_json(const nlohmann::json& tokenizer, const nlohmann::json& config,
                                                        const std::string& chat_template = "");

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Text -> ids. Added and special tokens written literally in the text
  // become their ids. With add_special_tokens, BOS is prepended when
  // tokenizer_config.json's add_bos_token holds (default: true when a
  // bos_token is set) and EOS appended when add_eos_token holds (default
  // false). Text that is not valid UTF-8 is encoded byte by byte where the
  // invalid bytes are. Thread-safe.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;

  // Ids -> text: the concatenated token_bytes() of the ids (invalid UTF-8,
  // such as half of a multi-byte character, is kept as is).
  // skip_special_tokens drops the added tokens marked special. An id no
  // token has (past vocab_size(): a checkpoint's embedding is often padded
  // past its tokenizer, and such ids can be sampled) gives "", as Hugging
  // Face's decode skips ids it has no token for.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // The raw bytes token `id` stands for, for incremental detokenization.
  // As HF's ByteLevel decoder: each character of the token is mapped back to
  // its byte, unless one of them is outside the byte alphabet, in which case
  // the token's own UTF-8 text is used (so "<|end_of_text|>" gives itself).
  // An id no token has (a gap, or outside [0, vocab_size())) gives "".
  std::string token_bytes(int32_t id) const;

  // The token string of `id` as written in tokenizer.json (byte-level
  // alphabet, e.g. "Ġthe"); "" for an id no token has (in a gap, or outside
  // [0, vocab_size())).
  const std::string& id_to_token(int32_t id) const;

  // True when `id` is an added token marked "special": true. False for ids
  // outside [0, vocab_size()).
  bool is_special(int32_t id) const;

  // The id of a vocab or added-token string (added tokens first), if any.
  std::optional<int32_t> token_to_id(std::string_view token) const;

  // Max id + 1 over model.vocab and added_tokens (ids may have gaps).
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  // The most bytes one token stands for (token_bytes(), added tokens
  // included): a text of B bytes encodes to at least B / max_token_bytes()
  // tokens, before any normalizer.
  int64_t max_token_bytes() const { return max_token_bytes_; }

  // BOS / EOS ids from tokenizer_config.json's bos_token / eos_token, if set.
  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }
  // Their strings; "" when unset.
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }
  // Whether encode(text, true) prepends BOS / appends EOS.
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }

  // The Jinja chat template; "" when the model has none.
  const std::string& chat_template() const { return chat_template_; }

  // The pre-tokens of `text` (no added-token splitting), in the byte-level
  // alphabet when the pre-tokenizer has a ByteLevel step: what HF's
  // pre_tokenizer.pre_tokenize_str returns, without offsets. For tests and
  // debugging.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

 private:
  // One added token of tokenizer.json.
  struct AddedToken {
    std::string content;
    int32_t id = 0;
    bool single_word = false;
    bool lstrip = false;
    bool rstrip = false;
    bool normalized = true;  // matched in the second pass (see split_added_tokens)
    bool special = false;
  };
  // A run of text: an added token (id >= 0) or text to pre-tokenize (id -1).
  struct Segment {
    size_t begin = 0, end = 0;
    int32_t id = -1;
  };
  // One pre-tokenizer step (a Sequence is flattened into its steps).
  enum class StepKind { kSplit, kByteLevel, kDigits };
  enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };
  struct Step {
    StepKind kind = StepKind::kSplit;
    std::shared_ptr<const detail::TokenizerRegex> regex;  // kSplit, kDigits (\p{N}), kByteLevel with use_regex
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;             // kSplit
    bool add_prefix_space = false;   // kByteLevel
    bool individual_digits = false;  // kDigits
  };
  // Hash that lets maps keyed by std::string be searched with string_view.
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using StringMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

  Tokenizer() = default;
  Status parse_model(const nlohmann::json& model);
  // `vocab_ids_first`: an added token that is also a vocab entry keeps the
  // vocab id (HF); tiktoken's special tokens keep their own ids.
  Status parse_added_tokens(const nlohmann::json& tokens, bool vocab_ids_first = true);
  Status parse_pre_tokenizer(const nlohmann::json& pre, const std::string& where);
  // `default_add_bos`: whether BOS is prepended when add_bos_token is absent
  // and bos_token is set.
  Status parse_config(const nlohmann::json& config, bool default_add_bos = true);

  std::vector<Segment> split_added_tokens(std::string_view text) const;
  // One matching pass over text[begin, end) with the tokens whose
  // `normalized` flag equals `normalized`; appends segments covering it.
  void find_added_tokens(std::string_view text, size_t begin, size_t end, bool normalized,
                         std::vector<Segment>& out) const;
  void apply_step(const Step& step, std::vector<std::string>& pieces) const;
  // Appends the ids of `text`: added tokens, pre-tokens, BPE.
  void encode_chunk(std::string_view text, std::vector<int32_t>& ids) const;
  // Kimi's encode() (tokenization_kimi.py, as Llama 3's tokenizer.py) cuts
  // the text before tiktoken sees it: into slices of kKimiMaxEncodeChars
  // characters, each cut again before a character that would make a run of
  // whitespace (Python's str.isspace) or of non-whitespace longer than
  // kKimiMaxRunChars. The chunks, in order, covering `text`.
  static std::vector<std::string_view> kimi_chunks(std::string_view text);
  static constexpr size_t kKimiMaxEncodeChars = 400'000;
  static constexpr size_t kKimiMaxRunChars = 25'000;
  // Appends the BPE ids of one pre-token.
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& out) const;

  StringMap vocab_;                  // model.vocab
  StringMap added_ids_;              // added token content -> id
  std::vector<std::string> tokens_;  // id -> token string ("" when unused)
  std::vector<std::string> bytes_;   // id -> decoded bytes
  int64_t max_token_bytes_ = 1;      // the longest bytes_ entry
  std::vector<uint8_t> special_;     // id -> added token marked special
  std::vector<AddedToken> added_;
  // For [normalized * 256 + first byte], indexes into added_ of the tokens
  // starting with that byte, longest first, so the first match at a
  // position is the longest.
  std::vector<std::vector<int32_t>> added_by_byte_;
  std::shared_ptr<const detail::TokenizerRegex> word_char_;  // \w, for single_word

  // BPE merges: (left id << 32 | right id) -> (rank, merged id).
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  bool kimi_chunking_ = false;  // from_tiktoken: encode kimi_chunks() separately
  std::vector<Step> steps_;

  std::string bos_token_, eos_token_, chat_template_;
  std::optional<int32_t> bos_id_, eos_id_;
  bool add_bos_ = false, add_eos_ = false;

  // Pre-token -> ids. Prompts repeat words, and BPE is the costly step.
  // Bounded: once full, new words are not cached.
  mutable std::shared_mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace nucleus
