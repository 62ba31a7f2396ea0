#include "io/tokenizer.h"
#include "io/onig_regex.h"

#include <pcre2.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>

#include "core/check.h"
#include "core/logging.h"
#include "io/regular_file.h"
#include "io/tokenizer_internal.h"

namespace nucleus {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace tokenizer_internal;

namespace {

// The pattern HF's ByteLevel pre-tokenizer splits with when use_regex is set
// (GPT-2's, tokenizers/src/pre_tokenizers/byte_level.rs).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The BPE cache holds pre-tokens up to this size, and this many of them.
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kCacheCapacity = 1 << 17;

// Reads optional boolean `key` of `obj` into *out (left as is when absent).
Status read_bool(const json& obj, const char* key, const std::string& where, bool* out) {
  const json* v = field(obj, key);
  if (!v) return ok_status();
  if (!v->is_boolean())
    return invalid_argument(where + ": field '" + key + "' must be true or false, got " + short_dump(*v));
  *out = v->get<bool>();
  return ok_status();
}

std::string type_of(const json& component) {
  const json* t = field(component, "type");
  return t && t->is_string() ? t->get<std::string>() : "";
}

Status read_file(const fs::path& path, std::string* out) {
  NUCLEUS_ASSIGN_OR_RETURN(*out, read_regular_file(path.string()));  // a FIFO is refused, never read
  return ok_status();
}

StatusOr<json> read_json_file(const fs::path& path) {
  std::string text;
  NUCLEUS_RETURN_IF_ERROR(read_file(path, &text));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument(path.string() + ": not valid JSON");
  if (!j.is_object()) return invalid_argument(path.string() + ": not a JSON object");
  return j;
}

}  // namespace

// ---- Regex ------------------------------------------------------------------

namespace detail {

// A PCRE2 pattern compiled for UTF-8 with Unicode properties (\s, \w, \p{..}
// as in Oniguruma/Rust regex), JIT-compiled when the library supports it.
// Invalid UTF-8 in the subject is allowed: those bytes never match.
class TokenizerRegex {
 public:
  // `literal`: match `pattern` as plain text (Split's {"String": ...}).
  static StatusOr<std::shared_ptr<const TokenizerRegex>> compile(const std::string& pattern, bool literal) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    // PCRE2_LITERAL refuses PCRE2_UCP (it has no character classes to affect).
    uint32_t options = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    std::string translated = literal ? pattern : onig_to_pcre2(pattern);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(), options, &err,
                                     &offset, nullptr);
    if (!code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return invalid_argument("regex '" + pattern + "' does not compile (at offset " + std::to_string(offset) +
                              (translated != pattern ? " of '" + translated + "'" : std::string()) +
                              "): " + reinterpret_cast<const char*>(msg));
    }
    auto re = std::shared_ptr<TokenizerRegex>(new TokenizerRegex());
    re->code_ = code;
    re->pattern_ = pattern;
    // No JIT (unsupported platform, or a build without it) is fine: the
    // interpreter gives the same matches, more slowly.
    (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    return std::shared_ptr<const TokenizerRegex>(std::move(re));
  }

  ~TokenizerRegex() { pcre2_code_free(code_); }
  TokenizerRegex(const TokenizerRegex&) = delete;
  TokenizerRegex& operator=(const TokenizerRegex&) = delete;

  // Appends [begin, end) of the successive non-overlapping matches in `s`,
  // as Rust's find_iter: after an empty match the search resumes one
  // character later.
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
    MatchData md;
    size_t offset = 0;
    while (offset <= s.size()) {
      int rc = match(s, offset, 0, md.get());
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        // A resource limit on pathological input; the rest stays unsplit
        // rather than failing the request.
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        NUCLEUS_LOG_WARN("tokenizer: regex '{}' failed at byte {}: {}; the rest of the text is not split", pattern_,
                         offset, reinterpret_cast<const char*>(msg));
        break;
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      size_t b = ov[0], e = ov[1];
      if (b < offset || e < b) break;  // \K tricks; never in tokenizer patterns
      out.emplace_back(b, e);
      if (e > b) {
        offset = e;
      } else {
        if (b >= s.size()) break;
        offset = b + char_step(s, b);
      }
    }
  }

  // Whether the pattern matches at s[pos], within the character there.
  bool matches_char_at(std::string_view s, size_t pos) const {
    MatchData md;
    std::string_view one = s.substr(0, pos + char_step(s, pos));
    return match(one, pos, PCRE2_ANCHORED, md.get()) >= 0;
  }

 private:
  // Match data with room for the whole-match offsets (enough: no groups are
  // read), freed on scope exit.
  class MatchData {
   public:
    MatchData() : md_(pcre2_match_data_create(1, nullptr)) { NUCLEUS_CHECK(md_ != nullptr, "out of memory"); }
    ~MatchData() { pcre2_match_data_free(md_); }
    MatchData(const MatchData&) = delete;
    MatchData& operator=(const MatchData&) = delete;
    pcre2_match_data* get() const { return md_; }

   private:
    pcre2_match_data* md_;
  };

  int match(std::string_view s, size_t offset, uint32_t options, pcre2_match_data* md) const {
    auto subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    int rc = pcre2_match(code_, subject, s.size(), offset, options, md, nullptr);
    // The JIT's default 32 KiB stack can run out on long runs of text; the
    // interpreter keeps its backtracking state on the heap.
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(code_, subject, s.size(), offset, options | PCRE2_NO_JIT, md, nullptr);
    return rc;
  }

  TokenizerRegex() = default;
  pcre2_code* code_ = nullptr;
  std::string pattern_;
};

}  // namespace detail

// ---- Loading ------------------------------------------------------------------

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::load(const std::string& model_dir) {
  fs::path dir(model_dir);
  std::error_code ec;
  // Kimi-K2 ships tiktoken.model instead of tokenizer.json.
  const bool tiktoken = !fs::exists(dir / "tokenizer.json", ec) && fs::exists(dir / "tiktoken.model", ec);
  json tokenizer;
  std::string ranks_text;
  if (tiktoken) {
    NUCLEUS_RETURN_IF_ERROR(read_file(dir / "tiktoken.model", &ranks_text));
  } else {
    NUCLEUS_ASSIGN_OR_RETURN(tokenizer, read_json_file(dir / "tokenizer.json"));
  }
  NUCLEUS_ASSIGN_OR_RETURN(json config, read_json_file(dir / "tokenizer_config.json"));
  std::string template_text;
  fs::path jinja = dir / "chat_template.jinja";
  if (fs::exists(jinja, ec)) NUCLEUS_RETURN_IF_ERROR(read_file(jinja, &template_text));
  auto t = tiktoken ? from_tiktoken(ranks_text, config, template_text) : from_json(tokenizer, config, template_text);
  if (!t.ok()) return t.status().with_context(model_dir);
  return t;
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::from_json(const json& tokenizer, const json& config,
                                                          const std::string& chat_template) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->chat_template_ = chat_template;
  // The parsers check each field's type before reading it; this only
  // catches what they missed, so a bad file is an error and never a crash.
  try {
    if (!tokenizer.is_object()) return invalid_argument("tokenizer.json: not a JSON object");
    if (!config.is_object()) return invalid_argument("tokenizer_config.json: not a JSON object");

    if (const json* n = field(tokenizer, "normalizer")) {
      // An empty Sequence is a no-op; anything else changes the text.
      std::string type = type_of(*n);
      const json* list = field(*n, "normalizers");
      bool empty_sequence = type == "Sequence" && list && list->is_array() && list->empty();
      if (!empty_sequence)
        return unsupported("tokenizer.json: normalizer type '" + (type.empty() ? short_dump(*n) : type) +
                           "' is not supported (only null)");
    }
    const json* model = field(tokenizer, "model");
    if (!model || !model->is_object()) return invalid_argument("tokenizer.json: missing object field 'model'");
    NUCLEUS_RETURN_IF_ERROR(t->parse_model(*model));
    const json* added = field(tokenizer, "added_tokens");
    NUCLEUS_RETURN_IF_ERROR(t->parse_added_tokens(added ? *added : json::array()));
    if (const json* pre = field(tokenizer, "pre_tokenizer"))
      NUCLEUS_RETURN_IF_ERROR(t->parse_pre_tokenizer(*pre, "pre_tokenizer"));

    const json* decoder = field(tokenizer, "decoder");
    std::string decoder_type = decoder ? type_of(*decoder) : "null";
    if (decoder_type != "ByteLevel")
      return unsupported("tokenizer.json: decoder type '" + decoder_type + "' is not supported (only ByteLevel)");

    // Decoded bytes of every token, once, so decode() is a table lookup.
    t->bytes_.resize(t->tokens_.size());
    for (size_t id = 0; id < t->tokens_.size(); ++id) {
      t->bytes_[id] = byte_level_decode(t->tokens_[id]);
      t->max_token_bytes_ = std::max(t->max_token_bytes_, static_cast<int64_t>(t->bytes_[id].size()));
    }

    NUCLEUS_RETURN_IF_ERROR(t->parse_config(config));
  } catch (const json::exception& e) {
    return invalid_argument(std::string("tokenizer.json / tokenizer_config.json: unexpected JSON shape: ") + e.what());
  }
  return t;
}

Status Tokenizer::parse_model(const json& model) {
  const std::string w = "tokenizer.json";
  std::string type = type_of(model);
  // Older files leave out "type"; HF then recognises BPE by its merges.
  if (type.empty() && !field(model, "merges")) return invalid_argument(w + ": model has no 'type'");
  if (!type.empty() && type != "BPE") return unsupported(w + ": model type '" + type + "' is not supported (only BPE)");
  if (const json* d = field(model, "dropout"); d && !(d->is_number() && d->get<double>() == 0.0))
    return unsupported(w + ": model.dropout " + short_dump(*d) + " is not supported (only null)");
  bool byte_fallback = false;
  NUCLEUS_RETURN_IF_ERROR(read_bool(model, "byte_fallback", w + ": model", &byte_fallback));
  if (byte_fallback) return unsupported(w + ": model.byte_fallback true is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json* v = field(model, key);
    if (v && !(v->is_string() && v->get<std::string>().empty()))
      return unsupported(w + ": model." + key + " " + short_dump(*v) + " is not supported (only null)");
  }
  NUCLEUS_RETURN_IF_ERROR(read_bool(model, "fuse_unk", w + ": model", &fuse_unk_));
  NUCLEUS_RETURN_IF_ERROR(read_bool(model, "ignore_merges", w + ": model", &ignore_merges_));

  const json* vocab = field(model, "vocab");
  if (!vocab || !vocab->is_object()) return invalid_argument(w + ": missing object field 'model.vocab'");
  int64_t max_id = -1;
  for (const auto& [token, v] : vocab->items()) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxTokenId)
      return invalid_argument(w + ": model.vocab['" + token + "'] must be an integer id in [0, " +
                              std::to_string(kMaxTokenId) + "], got " + short_dump(v));
    vocab_.emplace(token, static_cast<int32_t>(v.get<int64_t>()));
    max_id = std::max(max_id, v.get<int64_t>());
  }
  tokens_.assign(static_cast<size_t>(max_id + 1), std::string());
  std::vector<uint8_t> used(tokens_.size(), 0);
  for (const auto& [token, id] : vocab_) {
    if (used[id])
      return invalid_argument(w + ": model.vocab gives id " + std::to_string(id) + " to both '" + tokens_[id] +
                              "' and '" + token + "'");
    used[id] = 1;
    tokens_[id] = token;
  }

  if (const json* unk = field(model, "unk_token")) {
    if (!unk->is_string()) return invalid_argument(w + ": model.unk_token must be a string, got " + short_dump(*unk));
    auto it = vocab_.find(unk->get<std::string>());
    if (it == vocab_.end())
      return invalid_argument(w + ": model.unk_token '" + unk->get<std::string>() + "' is not in model.vocab");
    unk_id_ = it->second;
  }

  const json* merges = field(model, "merges");
  if (merges && !merges->is_array()) return invalid_argument(w + ": model.merges must be an array");
  // HF tokenizers refuses a BPE model without merges ("Missing vocab/merges");
  // without them every word would be split into single bytes.
  if (!merges) return invalid_argument(w + ": model.merges is missing (a BPE model needs its merges)");
  merges_.reserve(merges->size());
  int32_t rank = 0;
  for (const json& m : *merges) {
    std::string a, b;
    // Two spellings: "a b" (one space) or ["a", "b"].
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        return invalid_argument(w + ": model.merges[" + std::to_string(rank) + "] \"" + s +
                                "\" is not two tokens separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return invalid_argument(w + ": model.merges[" + std::to_string(rank) +
                              "] must be \"a b\" or [\"a\", \"b\"], got " + short_dump(m));
    }
    auto lookup = [&](const std::string& token) -> StatusOr<int32_t> {
      auto it = vocab_.find(token);
      if (it == vocab_.end())
        return invalid_argument(w + ": model.merges[" + std::to_string(rank) + "] (\"" + a + "\", \"" + b +
                                "\") refers to '" + token + "', which is not in model.vocab");
      return it->second;
    };
    NUCLEUS_ASSIGN_OR_RETURN(int32_t ia, lookup(a));
    NUCLEUS_ASSIGN_OR_RETURN(int32_t ib, lookup(b));
    NUCLEUS_ASSIGN_OR_RETURN(int32_t merged, lookup(a + b));
    // A repeated pair takes its last rank, as HF's map insertion does.
    merges_.insert_or_assign((static_cast<uint64_t>(ia) << 32) | static_cast<uint32_t>(ib),
                             std::make_pair(rank, merged));
    ++rank;
  }
  return ok_status();
}

Status Tokenizer::parse_added_tokens(const json& tokens, bool vocab_ids_first) {
  const std::string w = "tokenizer.json";
  if (!tokens.is_array()) return invalid_argument(w + ": added_tokens must be an array");
  for (size_t i = 0; i < tokens.size(); ++i) {
    const json& e = tokens[i];
    std::string where = w + ": added_tokens[" + std::to_string(i) + "]";
    const json* content = field(e, "content");
    const json* id = field(e, "id");
    if (!content || !content->is_string()) return invalid_argument(where + ": missing string field 'content'");
    if (!id || !id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() > kMaxTokenId)
      return invalid_argument(where + ": field 'id' must be an integer in [0, " + std::to_string(kMaxTokenId) + "]");
    AddedToken a;
    a.content = content->get<std::string>();
    if (a.content.empty()) continue;  // HF ignores empty added tokens
    NUCLEUS_RETURN_IF_ERROR(read_bool(e, "single_word", where, &a.single_word));
    NUCLEUS_RETURN_IF_ERROR(read_bool(e, "lstrip", where, &a.lstrip));
    NUCLEUS_RETURN_IF_ERROR(read_bool(e, "rstrip", where, &a.rstrip));
    NUCLEUS_RETURN_IF_ERROR(read_bool(e, "special", where, &a.special));
    NUCLEUS_RETURN_IF_ERROR(read_bool(e, "normalized", where, &a.normalized));
    a.id = static_cast<int32_t>(id->get<int64_t>());
    // A token already in the vocab keeps its vocab id (as HF, which only
    // warns when the file says otherwise).
    if (auto it = vocab_.find(a.content); vocab_ids_first && it != vocab_.end()) a.id = it->second;
    if (auto it = added_ids_.find(a.content); it != added_ids_.end()) {
      if (it->second != a.id)
        return invalid_argument(where + ": '" + a.content + "' repeats with id " + std::to_string(a.id) +
                                " (earlier: " + std::to_string(it->second) + ")");
      // A repeat with the same id replaces the earlier entry's flags.
      for (auto& prev : added_)
        if (prev.content == a.content) prev = a;
      continue;
    }
    if (static_cast<size_t>(a.id) >= tokens_.size()) tokens_.resize(static_cast<size_t>(a.id) + 1);
    std::string& slot = tokens_[a.id];
    if (!slot.empty() && slot != a.content)
      return invalid_argument(where + ": '" + a.content + "' has id " + std::to_string(a.id) +
                              ", which is already the id of '" + slot + "'");
    slot = a.content;
    added_ids_.emplace(a.content, a.id);
    added_.push_back(std::move(a));
  }
  special_.assign(tokens_.size(), 0);
  added_by_byte_.assign(512, {});
  bool any_single_word = false;
  for (size_t i = 0; i < added_.size(); ++i) {
    if (added_[i].special) special_[added_[i].id] = 1;
    any_single_word |= added_[i].single_word;
    size_t slot = (added_[i].normalized ? 256 : 0) + static_cast<unsigned char>(added_[i].content[0]);
    added_by_byte_[slot].push_back(static_cast<int32_t>(i));
  }
  for (auto& list : added_by_byte_)
    std::stable_sort(list.begin(), list.end(),
                     [&](int32_t x, int32_t y) { return added_[x].content.size() > added_[y].content.size(); });
  if (any_single_word) {
    // HF tests word boundaries with Rust's regex \w (Unicode: alphabetic,
    // marks, decimal digits, connector punctuation, join controls).
    NUCLEUS_ASSIGN_OR_RETURN(
        word_char_, detail::TokenizerRegex::compile(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])", false));
  }
  return ok_status();
}

Status Tokenizer::parse_pre_tokenizer(const json& pre, const std::string& where) {
  const std::string w = "tokenizer.json: " + where;
  std::string type = type_of(pre);
  if (type == "Sequence") {
    const json* list = field(pre, "pretokenizers");
    if (!list || !list->is_array()) return invalid_argument(w + ": Sequence needs an array 'pretokenizers'");
    for (size_t i = 0; i < list->size(); ++i)
      NUCLEUS_RETURN_IF_ERROR(parse_pre_tokenizer((*list)[i], where + ".pretokenizers[" + std::to_string(i) + "]"));
    return ok_status();
  }
  Step step;
  if (type == "ByteLevel") {
    // HF's defaults when a field is missing: add_prefix_space and use_regex on.
    step.kind = StepKind::kByteLevel;
    step.add_prefix_space = true;
    bool use_regex = true;
    NUCLEUS_RETURN_IF_ERROR(read_bool(pre, "add_prefix_space", w, &step.add_prefix_space));
    NUCLEUS_RETURN_IF_ERROR(read_bool(pre, "use_regex", w, &use_regex));
    if (use_regex) {
      auto re = detail::TokenizerRegex::compile(kGpt2Pattern, false);
      if (!re.ok()) return internal_error(w + ": " + re.status().message());
      step.regex = *re;
    }
  } else if (type == "Split") {
    step.kind = StepKind::kSplit;
    const json* pattern = field(pre, "pattern");
    const json* regex = pattern ? field(*pattern, "Regex") : nullptr;
    const json* literal = pattern ? field(*pattern, "String") : nullptr;
    const json* p = regex ? regex : literal;
    if (!p || !p->is_string())
      return invalid_argument(w + ": Split needs 'pattern' {\"Regex\": \"...\"} or {\"String\": \"...\"}");
    auto re = detail::TokenizerRegex::compile(p->get<std::string>(), /*literal=*/p == literal);
    if (!re.ok()) return invalid_argument(w + ": Split pattern: " + re.status().message());
    step.regex = *re;
    const json* behavior = field(pre, "behavior");
    std::string b = behavior && behavior->is_string() ? behavior->get<std::string>() : "";
    if (b == "Isolated") {
      step.behavior = SplitBehavior::kIsolated;
    } else if (b == "Removed") {
      step.behavior = SplitBehavior::kRemoved;
    } else if (b == "MergedWithPrevious") {
      step.behavior = SplitBehavior::kMergedWithPrevious;
    } else if (b == "MergedWithNext") {
      step.behavior = SplitBehavior::kMergedWithNext;
    } else if (b == "Contiguous") {
      step.behavior = SplitBehavior::kContiguous;
    } else {
      return unsupported(w + ": Split behavior " + (behavior ? short_dump(*behavior) : "(missing)") +
                         " is not supported (Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous)");
    }
    NUCLEUS_RETURN_IF_ERROR(read_bool(pre, "invert", w, &step.invert));
  } else if (type == "Digits") {
    // HF splits on char::is_numeric: Unicode Nd, Nl and No, one character a match.
    step.kind = StepKind::kDigits;
    NUCLEUS_RETURN_IF_ERROR(read_bool(pre, "individual_digits", w, &step.individual_digits));
    auto re = detail::TokenizerRegex::compile(R"(\p{N})", false);
    if (!re.ok()) return internal_error(w + ": " + re.status().message());
    step.regex = *re;
  } else {
    return unsupported("tokenizer.json: " + where + " type '" + (type.empty() ? short_dump(pre) : type) +
                       "' is not supported (ByteLevel, Split, Digits, Sequence)");
  }
  steps_.push_back(std::move(step));
  return ok_status();
}

Status Tokenizer::parse_config(const json& config, bool default_add_bos) {
  const std::string w = "tokenizer_config.json";
  // bos_token / eos_token: a string, or an AddedToken object {"content": ...}.
  auto read_token = [&](const char* key, std::string* text, std::optional<int32_t>* id) -> Status {
    const json* v = field(config, key);
    if (!v) return ok_status();
    const json* content = v->is_object() ? field(*v, "content") : v;
    if (!content || !content->is_string())
      return invalid_argument(w + ": field '" + key + "' must be a string or {\"content\": string}, got " +
                              short_dump(*v));
    *text = content->get<std::string>();
    *id = token_to_id(*text);
    if (!*id) return invalid_argument(w + ": " + key + " '" + *text + "' is not a token of tokenizer.json");
    return ok_status();
  };
  NUCLEUS_RETURN_IF_ERROR(read_token("bos_token", &bos_token_, &bos_id_));
  NUCLEUS_RETURN_IF_ERROR(read_token("eos_token", &eos_token_, &eos_id_));
  add_bos_ = default_add_bos && bos_id_.has_value();
  add_eos_ = false;
  NUCLEUS_RETURN_IF_ERROR(read_bool(config, "add_bos_token", w, &add_bos_));
  NUCLEUS_RETURN_IF_ERROR(read_bool(config, "add_eos_token", w, &add_eos_));
  if (add_bos_ && !bos_id_) return invalid_argument(w + ": add_bos_token is true but bos_token is not set");
  if (add_eos_ && !eos_id_) return invalid_argument(w + ": add_eos_token is true but eos_token is not set");

  if (const json* ct = field(config, "chat_template")) {
    if (ct->is_string()) {
      chat_template_ = ct->get<std::string>();
    } else if (ct->is_array()) {
      // Named templates [{"name": ..., "template": ...}]: the "default" one.
      chat_template_.clear();
      for (const json& e : *ct) {
        const json* name = field(e, "name");
        const json* text = field(e, "template");
        if (!name || !name->is_string() || !text || !text->is_string())
          return invalid_argument(w + ": chat_template entries must be {\"name\": string, \"template\": string}");
        if (name->get<std::string>() == "default") chat_template_ = text->get<std::string>();
      }
    } else {
      return invalid_argument(w + ": chat_template must be a string or a list of {name, template}, got " +
                              short_dump(*ct));
    }
  }
  return ok_status();
}

Tokenizer::~Tokenizer() = default;

// ---- Lookups ------------------------------------------------------------------

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = added_ids_.find(token); it != added_ids_.end()) return it->second;
  if (auto it = vocab_.find(token); it != vocab_.end()) return it->second;
  return std::nullopt;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < special_.size() && special_[id];
}

const std::string& Tokenizer::id_to_token(int32_t id) const {
  static const std::string kNone;
  return id >= 0 && id < vocab_size() ? tokens_[id] : kNone;
}

std::string Tokenizer::token_bytes(int32_t id) const { return id >= 0 && id < vocab_size() ? bytes_[id] : std::string(); }

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;  // no token: nothing, as Hugging Face's decode
    if (skip_special_tokens && is_special(id)) continue;
    out += bytes_[id];
  }
  return out;
}

// ---- Encoding -----------------------------------------------------------------

// HF AddedVocabulary::find_matches: leftmost-longest matches; a single_word
// token next to a word character is skipped; lstrip / rstrip widen the match
// over neighbouring whitespace. The word and whitespace tests see only
// text[begin, end), as HF sees only the piece it splits.
void Tokenizer::find_added_tokens(std::string_view text, size_t begin, size_t end, bool normalized,
                                  std::vector<Segment>& out) const {
  std::string_view piece = text.substr(begin, end - begin);
  const auto* lists = &added_by_byte_[normalized ? 256 : 0];
  size_t start_offset = 0;  // end of the previous segment
  for (size_t pos = 0; pos < piece.size();) {
    const AddedToken* hit = nullptr;
    for (int32_t idx : lists[static_cast<unsigned char>(piece[pos])]) {
      if (piece.substr(pos).starts_with(added_[idx].content)) {
        hit = &added_[idx];
        break;  // longest first
      }
    }
    if (!hit) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + hit->content.size();
    // The search goes on from the end of the match, even when rstrip below
    // takes more: a token may then start inside the stripped whitespace,
    // and is cut to start after it (as HF does for lstrip tokens; for others
    // HF would emit those bytes twice).
    pos = stop;
    if (hit->single_word) {
      bool word_before = start > 0 && word_char_->matches_char_at(piece, prev_char_start(piece, start));
      bool word_after = stop < piece.size() && word_char_->matches_char_at(piece, stop);
      if (word_before || word_after) continue;
    }
    size_t n = 0;
    if (hit->lstrip) {
      while (start > 0) {
        size_t p = prev_char_start(piece, start);
        if (!white_space_at(piece, p, &n)) break;
        start = p;
      }
    }
    start = std::max(start, start_offset);
    if (hit->rstrip)
      while (stop < piece.size() && white_space_at(piece, stop, &n)) stop += n;
    if (stop <= start) continue;  // wholly inside the previous token's whitespace
    if (start_offset < start) out.push_back({begin + start_offset, begin + start, -1});
    out.push_back({begin + start, begin + stop, hit->id});
    start_offset = stop;
  }
  if (start_offset < piece.size()) out.push_back({begin + start_offset, end, -1});
}

// HF AddedVocabulary::extract_and_normalize: tokens with normalized false
// are cut out first, then those with normalized true from what is left (no
// normalizer runs in between here). Segments cover the text in order.
std::vector<Tokenizer::Segment> Tokenizer::split_added_tokens(std::string_view text) const {
  std::vector<Segment> first, out;
  find_added_tokens(text, 0, text.size(), /*normalized=*/false, first);
  for (const Segment& seg : first) {
    if (seg.id >= 0) {
      out.push_back(seg);
    } else {
      find_added_tokens(text, seg.begin, seg.end, /*normalized=*/true, out);
    }
  }
  return out;
}

namespace {

// HF NormalizedString::split: `matches` (ascending, non-overlapping) plus the
// gaps between them cover `s`; `behavior` decides which become pieces.
// Empty pieces are dropped, as PreTokenizedString::split does.
template <typename Behavior>
void split_pieces(std::string_view s, const std::vector<std::pair<size_t, size_t>>& matches, bool invert,
                  Behavior behavior, std::vector<std::string>& out) {
  struct Part {
    size_t b, e;
    bool is_match;
  };
  std::vector<Part> parts;
  size_t prev = 0;
  for (auto [b, e] : matches) {
    if (prev != b) parts.push_back({prev, b, false});
    parts.push_back({b, e, true});
    prev = e;
  }
  if (prev != s.size()) parts.push_back({prev, s.size(), false});
  if (invert)
    for (auto& p : parts) p.is_match = !p.is_match;

  using B = decltype(behavior);
  std::vector<Part> kept;  // is_match here means "remove"
  bool previous_match = false;
  switch (behavior) {
    case B::kIsolated:
      for (const auto& p : parts) kept.push_back({p.b, p.e, false});
      break;
    case B::kRemoved:
      kept = parts;
      break;
    case B::kContiguous:
      for (const auto& p : parts) {
        if (p.is_match == previous_match && !kept.empty()) {
          kept.back().e = p.e;
        } else {
          kept.push_back({p.b, p.e, false});
        }
        previous_match = p.is_match;
      }
      break;
    case B::kMergedWithPrevious:
      for (const auto& p : parts) {
        if (p.is_match && !previous_match && !kept.empty()) {
          kept.back().e = p.e;
        } else {
          kept.push_back({p.b, p.e, false});
        }
        previous_match = p.is_match;
      }
      break;
    case B::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->is_match && !previous_match && !kept.empty()) {
          kept.back().b = it->b;
        } else {
          kept.push_back({it->b, it->e, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  for (const auto& p : kept)
    if (!p.is_match && p.e > p.b) out.emplace_back(s.substr(p.b, p.e - p.b));
}

}  // namespace

void Tokenizer::apply_step(const Step& step, std::vector<std::string>& pieces) const {
  std::vector<std::string> out;
  std::vector<std::pair<size_t, size_t>> matches;
  for (const std::string& piece : pieces) {
    matches.clear();
    switch (step.kind) {
      case StepKind::kSplit:
        step.regex->find_all(piece, matches);
        split_pieces(piece, matches, step.invert, step.behavior, out);
        break;
      case StepKind::kDigits:
        // Every numeric character is a match; Contiguous then joins runs of them.
        step.regex->find_all(piece, matches);
        split_pieces(piece, matches, false,
                     step.individual_digits ? SplitBehavior::kIsolated : SplitBehavior::kContiguous, out);
        break;
      case StepKind::kByteLevel: {
        std::string s = step.add_prefix_space && !piece.starts_with(' ') ? " " + piece : piece;
        std::vector<std::string> subs;
        if (step.regex) {
          step.regex->find_all(s, matches);
          split_pieces(s, matches, false, SplitBehavior::kIsolated, subs);
        } else {
          subs.push_back(std::move(s));
        }
        const ByteAlphabet& a = byte_alphabet();
        for (const std::string& sub : subs) {
          std::string mapped;
          mapped.reserve(sub.size() * 2);
          for (char c : sub) mapped += a.byte_to_char[static_cast<unsigned char>(c)];
          out.push_back(std::move(mapped));
        }
        break;
      }
    }
  }
  pieces = std::move(out);
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  std::vector<std::string> pieces;
  if (text.empty()) return pieces;
  pieces.emplace_back(text);
  for (const Step& step : steps_) apply_step(step, pieces);
  return pieces;
}

void Tokenizer::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mu_);
    if (auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t first = out.size();
  bpe_uncached(word, out);
  if (cacheable) {
    std::unique_lock lock(cache_mu_);
    if (cache_.size() < kCacheCapacity)
      cache_.emplace(std::string(word), std::vector<int32_t>(out.begin() + first, out.end()));
  }
}

// HF BPE::merge_word + Word::merge_all: characters -> vocab ids (unknown ones
// -> unk_token, or dropped when there is none), then merges applied lowest
// rank first, leftmost first among equal ranks, through a priority queue of
// candidate pairs that are re-validated when popped.
void Tokenizer::bpe_uncached(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> syms;
  syms.reserve(word.size());
  auto add = [&](int32_t id) {
    int32_t n = static_cast<int32_t>(syms.size());
    syms.push_back({id, n - 1, -1, true});
    if (n > 0) syms[n - 1].next = n;
  };
  bool pending_unk = false;
  for (size_t i = 0; i < word.size();) {
    size_t n = char_step(word, i);
    auto it = vocab_.find(word.substr(i, n));
    i += n;
    if (it != vocab_.end()) {
      if (pending_unk) {
        add(*unk_id_);
        pending_unk = false;
      }
      add(it->second);
    } else if (unk_id_) {
      if (pending_unk && !fuse_unk_) add(*unk_id_);
      pending_unk = true;
    }
  }
  if (pending_unk) add(*unk_id_);

  struct Candidate {
    int32_t rank, pos, new_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  auto find_merge = [&](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
    auto it = merges_.find((static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i)
    if (auto m = find_merge(syms[i].id, syms[i + 1].id)) queue.push({m->first, i, m->second});
  while (!queue.empty()) {
    Candidate top = queue.top();
    queue.pop();
    Symbol& cur = syms[top.pos];
    if (!cur.alive || cur.next < 0) continue;
    Symbol& right = syms[cur.next];
    // Stale if either side changed since the candidate was queued.
    auto m = find_merge(cur.id, right.id);
    if (!m || m->second != top.new_id) continue;
    cur.id = top.new_id;
    right.alive = false;
    cur.next = right.next;
    if (cur.next >= 0) syms[cur.next].prev = top.pos;
    if (cur.prev >= 0)
      if (auto pm = find_merge(syms[cur.prev].id, cur.id)) queue.push({pm->first, cur.prev, pm->second});
    if (cur.next >= 0)
      if (auto nm = find_merge(cur.id, syms[cur.next].id)) queue.push({nm->first, top.pos, nm->second});
  }
  for (const Symbol& s : syms)
    if (s.alive) out.push_back(s.id);
}

void Tokenizer::encode_chunk(std::string_view text, std::vector<int32_t>& ids) const {
  for (const Segment& seg : split_added_tokens(text)) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    for (const std::string& piece : pre_tokenize(text.substr(seg.begin, seg.end - seg.begin))) bpe(piece, ids);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 2);
  if (add_special_tokens && add_bos_) ids.push_back(*bos_id_);
  if (kimi_chunking_) {
    for (std::string_view chunk : kimi_chunks(text)) encode_chunk(chunk, ids);
  } else {
    encode_chunk(text, ids);
  }
  if (add_special_tokens && add_eos_) ids.push_back(*eos_id_);
  return ids;
}

}  // namespace nucleus
