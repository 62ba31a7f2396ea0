// Token sampling from one row of logits (CPU reference; the CUDA backend has
// its own kernels with the same semantics).
//
//   temperature == 0: argmax (ties to the lower id).
//   otherwise: p = softmax(logits / temperature) restricted to the top_k
//   largest (when top_k > 0), then to the smallest prefix of tokens by
//   decreasing p whose mass reaches top_p; renormalised; one draw with
//   u = uniform(seed, output_index), a counter-based hash, so a request's
//   draws depend only on its seed and position, not on batching or
//   preemption.
// Log-probabilities are of the unmodified distribution log_softmax(logits).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "runtime/sampling_params.h"

namespace nucleus {

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;                                // log p(token) under log_softmax(logits)
  std::vector<std::pair<int32_t, float>> top_logprobs;  // params.logprobs entries, by decreasing logprob
};

// logits: [vocab_size] f32. `seed` is the request's seed; output_index counts
// the request's generated tokens from 0.
SampleResult sample_token(const float* logits, int64_t vocab_size, const SamplingParams& params, uint64_t seed,
                          int64_t output_index);

// A uniform double in [0, 1) from (seed, counter): SplitMix64 finalisers.
double counter_uniform(uint64_t seed, uint64_t counter);

}  // namespace nucleus
