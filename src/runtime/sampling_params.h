// Per-request sampling parameters (the OpenAI / vLLM fields).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace nucleus {

class CompiledGrammar;  // runtime/structured_output.h

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy (argmax)
  int32_t top_k = 0;         // <= 0: all tokens
  float top_p = 1.0f;        // nucleus mass in (0, 1]
  std::optional<uint64_t> seed;  // same seed + same prompt -> same output
  int32_t max_tokens = 16;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;  // finish (reason "stop") on any of these
  std::vector<std::string> stop;        // stop strings (applied to the detokenized text)
  int32_t logprobs = 0;                 // top-N log-probabilities per output token (0: none)
  // vLLM's prompt_logprobs: the log-probability of every prompt token after
  // the first, with the top-N of its position (0: the token's only); unset:
  // not computed (prefill then computes logits for the last position only).
  std::optional<int32_t> prompt_logprobs;

  // vLLM's logit processors (kernels/sampling/logit_adjust.h has the formulas
  // and their order). Defaults leave the logits unchanged.
  float presence_penalty = 0.0f;    // [-2, 2]: subtracted once from every generated token's logit
  float frequency_penalty = 0.0f;   // [-2, 2]: subtracted per occurrence among the generated tokens
  float repetition_penalty = 1.0f;  // > 0: prompt and generated tokens' logits l>0 ? l/rp : l*rp
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias in [-100, 100]), distinct ids
  int32_t min_tokens = 0;           // EOS and stop_token_ids masked until this many tokens are generated
  float min_p = 0.0f;               // [0, 1]: after temperature, drop tokens with p < min_p * p_max
  // Structured output: the output must match this grammar (compiled by the
  // server's GrammarCompiler against the served vocabulary); null: free.
  std::shared_ptr<const CompiledGrammar> grammar;

  // Errors name the field: temperature < 0, top_p outside (0, 1],
  // max_tokens < 1, logprobs or prompt_logprobs outside [0, 20],
  // presence_penalty or frequency_penalty outside [-2, 2], repetition_penalty
  // <= 0, min_p outside [0, 1], min_tokens outside [0, max_tokens], a
  // logit_bias outside [-100, 100] or a repeated or negative id. (Ids past the
  // vocabulary are the engine's check: it knows the vocabulary.)
  Status validate() const;

  // True when a logit processor of vLLM's (penalties, bias, min_tokens at
  // this output index, min_p on a sampled row) changes the row.
  bool adjusts_logits(int64_t output_index) const;
};

}  // namespace nucleus
