#include "runtime/structured_output.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/check.h"
#include "io/tokenizer.h"

#ifdef NUCLEUS_HAVE_XGRAMMAR
#include <xgrammar/xgrammar.h>
#endif

namespace nucleus {

void apply_token_bitmask(float* logits, const int32_t* bitmask, int64_t vocab_size) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t w = 0; w < token_bitmask_words(vocab_size); ++w) {
    const uint32_t bits = static_cast<uint32_t>(bitmask[w]);
    if (bits == 0xffffffffu) continue;
    const int64_t end = std::min<int64_t>(vocab_size, (w + 1) * 32);
    for (int64_t t = w * 32; t < end; ++t)
      if (!((bits >> (t - w * 32)) & 1u)) logits[t] = kNegInf;
  }
}

#ifdef NUCLEUS_HAVE_XGRAMMAR

class CompiledGrammar {
 public:
  CompiledGrammar(xgrammar::CompiledGrammar g, int64_t vocab_size) : grammar(std::move(g)), vocab_size(vocab_size) {}
  xgrammar::CompiledGrammar grammar;
  int64_t vocab_size;
};

struct GrammarCompiler::Impl {
  explicit Impl(const xgrammar::TokenizerInfo& info, int threads)
      : compiler(info, threads, /*cache_enabled=*/true, kCacheBytes) {}
  // Compiled grammars kept for reuse (identical schemas are common: one
  // client's requests); the least recently used go past this.
  static constexpr int64_t kCacheBytes = int64_t{256} << 20;
  mutable xgrammar::GrammarCompiler compiler;
};

namespace {

// `root ::= "a" | "b" ...`: each choice as an EBNF string literal (JSON string
// escapes are EBNF's too).
std::string choice_grammar(const std::vector<std::string>& choices) {
  std::string g = "root ::= ";
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i) g += " | ";
    g += nlohmann::json(choices[i]).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  return g;
}

// xgrammar's message without its log prefix ("[hh:mm:ss] path/file.cc:123: ")
// and trailing newline: what the client sees.
std::string error_message(const std::exception& e) {
  std::string m = e.what();
  if (!m.empty() && m[0] == '[') {
    const size_t time_end = m.find("] ");
    const size_t line_end = time_end == std::string::npos ? time_end : m.find(": ", time_end + 2);
    if (line_end != std::string::npos) m = m.substr(line_end + 2);
  }
  while (!m.empty() && (m.back() == '\n' || m.back() == ' ')) m.pop_back();
  return m;
}

}  // namespace

StatusOr<std::unique_ptr<GrammarCompiler>> GrammarCompiler::create(const Tokenizer& tokenizer, int64_t vocab_size,
                                                                   const std::vector<int32_t>& stop_token_ids) {
  if (vocab_size < 1 || vocab_size > std::numeric_limits<int32_t>::max())
    return invalid_argument("structured output: vocab size " + std::to_string(vocab_size) + " is out of range");
  for (int32_t id : stop_token_ids)
    if (id < 0 || id >= vocab_size)
      return invalid_argument("structured output: stop token " + std::to_string(id) + " is outside [0, " +
                              std::to_string(vocab_size) + ")");
  // xgrammar's RAW vocabulary: each id's bytes as they are; "" marks a token
  // the grammar never allows (special tokens, gaps); ids past the tokenizer
  // are padded as such by vocab_size.
  const int64_t known = std::min(vocab_size, tokenizer.vocab_size());
  std::vector<std::string> vocab(known);
  for (int64_t t = 0; t < known; ++t)
    if (!tokenizer.is_special(static_cast<int32_t>(t))) vocab[t] = tokenizer.token_bytes(static_cast<int32_t>(t));
  try {
    xgrammar::TokenizerInfo info(vocab, xgrammar::VocabType::RAW, static_cast<int>(vocab_size),
                                 std::vector<int32_t>(stop_token_ids.begin(), stop_token_ids.end()));
    const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
    std::unique_ptr<GrammarCompiler> c(new GrammarCompiler());
    c->impl_ = std::make_unique<Impl>(info, threads);
    c->vocab_size_ = vocab_size;
    return c;
  } catch (const std::exception& e) {
    return invalid_argument("structured output: xgrammar refused the vocabulary: " + error_message(e));
  }
}

GrammarCompiler::~GrammarCompiler() = default;

StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCompiler::compile(const StructuredOutputSpec& spec) const {
  using Kind = StructuredOutputSpec::Kind;
  try {
    xgrammar::GrammarCompiler& c = impl_->compiler;
    auto done = [&](xgrammar::CompiledGrammar g) {
      return std::make_shared<const CompiledGrammar>(std::move(g), vocab_size_);
    };
    switch (spec.kind) {
      case Kind::kJsonObject:
        return done(c.CompileJSONSchema(R"({"type": "object"})", spec.any_whitespace));
      case Kind::kJsonSchema:
        return done(c.CompileJSONSchema(spec.text, spec.any_whitespace));
      case Kind::kRegex:
        return done(c.CompileRegex(spec.text));
      case Kind::kChoice:
        if (spec.choices.empty()) return invalid_argument("the choice list is empty");
        return done(c.CompileGrammar(choice_grammar(spec.choices)));
      case Kind::kGrammar:
        if (spec.text.find("::=") != std::string::npos) return done(c.CompileGrammar(spec.text));
        return done(c.CompileLark(spec.text));
    }
  } catch (const std::exception& e) {
    return invalid_argument(error_message(e));
  }
  return invalid_argument("unknown structured output kind");
}

struct GrammarMatcher::Impl {
  explicit Impl(std::shared_ptr<const CompiledGrammar> g) : grammar(std::move(g)), matcher(grammar->grammar) {}
  std::shared_ptr<const CompiledGrammar> grammar;
  xgrammar::GrammarMatcher matcher;
};

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : impl_(std::make_unique<Impl>(std::move(grammar))) {}

GrammarMatcher::~GrammarMatcher() = default;

bool GrammarMatcher::fill_next_token_bitmask(int32_t* bitmask) {
  NUCLEUS_CHECK(!impl_->matcher.IsTerminated(), "grammar matcher: mask requested after termination");
  int64_t shape[1] = {token_bitmask_words(impl_->grammar->vocab_size)};
  DLTensor t{};
  t.data = bitmask;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = DLDataType{kDLInt, 32, 1};
  t.shape = shape;
  return impl_->matcher.FillNextTokenBitmask(&t);
}

void GrammarMatcher::fill_next_token_bitmasks(const std::vector<GrammarMatcher*>& matchers, int32_t* bitmask) {
  if (matchers.empty()) return;
  const int64_t vocab = matchers[0]->vocab_size();
  // Below this many rows, threads cost more than they save (xgrammar starts
  // its pool per call).
  constexpr size_t kMinThreadedRows = 8;
  if (matchers.size() < kMinThreadedRows) {
    for (size_t i = 0; i < matchers.size(); ++i) {
      NUCLEUS_CHECK(matchers[i]->vocab_size() == vocab, "grammar vocab {} != {}", matchers[i]->vocab_size(), vocab);
      matchers[i]->fill_next_token_bitmask(bitmask + static_cast<int64_t>(i) * token_bitmask_words(vocab));
    }
    return;
  }
  std::vector<xgrammar::GrammarMatcher> handles;  // shallow: they share the matchers' state
  handles.reserve(matchers.size());
  for (GrammarMatcher* m : matchers) {
    NUCLEUS_CHECK(m->vocab_size() == vocab, "grammar vocab {} != {}", m->vocab_size(), vocab);
    NUCLEUS_CHECK(!m->is_terminated(), "grammar matcher: mask requested after termination");
    handles.push_back(m->impl_->matcher);
  }
  int64_t shape[2] = {static_cast<int64_t>(matchers.size()), token_bitmask_words(vocab)};
  DLTensor t{};
  t.data = bitmask;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 2;
  t.dtype = DLDataType{kDLInt, 32, 1};
  t.shape = shape;
  static const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency() / 2, 1u, 8u));
  xgrammar::BatchGrammarMatcher batch(threads);
  batch.BatchFillNextTokenBitmask(&handles, &t);
}

bool GrammarMatcher::accept_token(int32_t token) {
  if (token < 0 || token >= impl_->grammar->vocab_size || impl_->matcher.IsTerminated()) return false;
  return impl_->matcher.AcceptToken(token);
}

bool GrammarMatcher::is_terminated() const { return impl_->matcher.IsTerminated(); }

int64_t GrammarMatcher::vocab_size() const { return impl_->grammar->vocab_size; }

#else  // built without xgrammar

class CompiledGrammar {};
struct GrammarCompiler::Impl {};
struct GrammarMatcher::Impl {};

StatusOr<std::unique_ptr<GrammarCompiler>> GrammarCompiler::create(const Tokenizer&, int64_t,
                                                                   const std::vector<int32_t>&) {
  return unsupported("structured output needs xgrammar, and this build has none (-DNUCLEUS_XGRAMMAR=OFF)");
}
GrammarCompiler::~GrammarCompiler() = default;
StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCompiler::compile(const StructuredOutputSpec&) const {
  return unsupported("structured output needs xgrammar");
}
GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar>) { NUCLEUS_CHECK(false, "no xgrammar"); }
GrammarMatcher::~GrammarMatcher() = default;
bool GrammarMatcher::fill_next_token_bitmask(int32_t*) { return false; }
void GrammarMatcher::fill_next_token_bitmasks(const std::vector<GrammarMatcher*>&, int32_t*) {}
bool GrammarMatcher::accept_token(int32_t) { return false; }
bool GrammarMatcher::is_terminated() const { return false; }
int64_t GrammarMatcher::vocab_size() const { return 0; }

#endif

}  // namespace nucleus
