// Log-probabilities of given tokens (the prompt's, for vLLM's prompt_logprobs
// and the completions API's echo with logprobs): prefill computes the logits
// of every prompt position of a request that asks for them, and the row of
// position p scores prompt token p + 1.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace nucleus {

struct TokenLogprobs {
  int32_t token = -1;
  float logprob = 0.0f;  // log_softmax(logits)[token]
  int64_t rank = 0;      // 1 + the number of tokens with a larger logit (vLLM's rank)
  std::vector<std::pair<int32_t, float>> top;  // the top_n largest, by decreasing logprob (ties: lower id)
};

// logits: [vocab_size] f32, one row. log_softmax as the CPU sampler computes
// it (f32 exponentials, f64 sum), so a token's prompt logprob equals the
// logprob that sampler reports when it samples the token from the same row.
TokenLogprobs token_logprobs(const float* logits, int64_t vocab_size, int32_t token, int32_t top_n);

}  // namespace nucleus
