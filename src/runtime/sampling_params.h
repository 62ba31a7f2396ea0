// Per-request sampling parameters (the OpenAI / vLLM fields).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
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
  // Structured output: the output must match this grammar (compiled by the
  // server's GrammarCompiler against the served vocabulary); null: free.
  std::shared_ptr<const CompiledGrammar> grammar;

  // Errors name the field: temperature < 0, top_p outside (0, 1],
  // max_tokens < 1, logprobs outside [0, 20].
  Status validate() const;
};

}  // namespace nucleus
