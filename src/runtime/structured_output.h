// Structured output: grammar-constrained sampling on xgrammar's C++ core
// (cmake/xgrammar.cmake; https://github.com/mlc-ai/xgrammar).
//
//   GrammarCompiler   one per server: the tokenizer's vocabulary as xgrammar
//                     sees it, and a cache of compiled grammars. Compiling
//                     (a JSON schema, a regex, an EBNF / Lark grammar, a
//                     choice list) costs milliseconds to seconds, so it runs
//                     on the HTTP request's thread before submission, never
//                     in the engine loop.
//   CompiledGrammar   immutable, shared by the choices of a request
//                     (SamplingParams::grammar).
//   GrammarMatcher    one per sequence (Sequence::grammar_matcher): before
//                     each sampling step it fills the bitmask of the tokens
//                     that may come next; the masked logits are set to -inf
//                     (apply_token_bitmask, or the CUDA kernel
//                     kernels/sampling/token_bitmask.cuh); the sampled token
//                     is then accepted. Accepting a stop token (the engine's
//                     EOS ids) once the grammar is complete terminates it: the
//                     sequence finishes with "stop". Stop tokens are allowed
//                     only where the output is complete.
//
// Bitmask layout (xgrammar's): int32 words [ceil(vocab / 32)]; token t may
// come next iff bit (t % 32) of word t / 32 is set.
//
// Built without xgrammar (-DNUCLEUS_XGRAMMAR=OFF), GrammarCompiler::create
// returns kUnsupported and nothing else is reachable.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace nucleus {

class Tokenizer;

// What a request's output must match.
struct StructuredOutputSpec {
  enum class Kind {
    kJsonObject,  // any JSON object (vLLM: the schema {"type": "object"})
    kJsonSchema,  // `text`: a JSON schema
    kRegex,       // `text`: a regular expression
    kChoice,      // exactly one of `choices`
    kGrammar,     // `text`: an EBNF grammar (GBNF, rule `root`), or Lark when it has no "::="
  };
  Kind kind = Kind::kJsonObject;
  std::string text;
  std::vector<std::string> choices;
  // JSON kinds: whitespace allowed between tokens (vLLM's default; its
  // disable_any_whitespace turns it off: compact separators ", " and ": ").
  bool any_whitespace = true;
};

// A grammar compiled against one vocabulary (opaque; defined in the .cpp).
class CompiledGrammar;

// ceil(vocab_size / 32): the int32 words of one token bitmask.
inline int64_t token_bitmask_words(int64_t vocab_size) { return (vocab_size + 31) / 32; }

class GrammarCompiler {
 public:
  // The vocabulary: token ids [0, vocab_size), vocab_size being the logits
  // width (>= 1). Id t stands for tokenizer.token_bytes(t); ids without bytes
  // (past the tokenizer, gaps) and added tokens marked special are never
  // allowed, except `stop_token_ids` (the engine's EOS ids, in
  // [0, vocab_size)), which end a complete output. Building the vocabulary
  // index costs ~0.1 s per 100k tokens. Errors: kInvalidArgument for sizes
  // or ids out of range; kUnsupported in a build without xgrammar.
  static StatusOr<std::unique_ptr<GrammarCompiler>> create(const Tokenizer& tokenizer, int64_t vocab_size,
                                                           const std::vector<int32_t>& stop_token_ids);
  ~GrammarCompiler();
  GrammarCompiler(const GrammarCompiler&) = delete;
  GrammarCompiler& operator=(const GrammarCompiler&) = delete;

  // Compiles `spec` (cached: the same spec again is served from memory).
  // Thread-safe. Errors: kInvalidArgument with xgrammar's message for a
  // schema, regex or grammar it cannot parse or does not support.
  StatusOr<std::shared_ptr<const CompiledGrammar>> compile(const StructuredOutputSpec& spec) const;

  int64_t vocab_size() const { return vocab_size_; }

 private:
  GrammarCompiler() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t vocab_size_ = 0;
};

// One sequence's position in its grammar. Not thread-safe (the engine loop
// owns it).
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);
  ~GrammarMatcher();
  GrammarMatcher(const GrammarMatcher&) = delete;
  GrammarMatcher& operator=(const GrammarMatcher&) = delete;

  // Writes the tokens allowed next into bitmask[0, token_bitmask_words(vocab_size())).
  // Returns false when every token is allowed (the mask need not be applied).
  // Must not be called once terminated (a bug: checked).
  bool fill_next_token_bitmask(int32_t* bitmask);
  // fill_next_token_bitmask of each matcher into row i of
  // bitmask [matchers.size(), token_bitmask_words(vocab)], on up to 8
  // threads for larger batches (masks cost ~10 us to ~1 ms each). All
  // matchers share one vocab_size and none is terminated (checked).
  static void fill_next_token_bitmasks(const std::vector<GrammarMatcher*>& matchers, int32_t* bitmask);
  // Advances by `token`; false (state unchanged) when the grammar does not
  // allow it here.
  bool accept_token(int32_t token);
  // A stop token was accepted after a complete output: nothing may follow.
  bool is_terminated() const;
  int64_t vocab_size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// logits[t] = -inf for each token t in [0, vocab_size) whose bit is clear.
//   logits: [vocab_size] f32 (host); bitmask: [token_bitmask_words(vocab_size)] int32.
void apply_token_bitmask(float* logits, const int32_t* bitmask, int64_t vocab_size);

}  // namespace nucleus
