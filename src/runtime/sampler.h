// Token sampling from one row of logits (CPU reference; the CUDA backend has
// its own kernels with the same semantics).
//
//   First vLLM's logit processors on a copy of the row (min_tokens mask,
//   logit_bias, repetition / frequency / presence penalties; formulas in
//   kernels/sampling/logit_adjust.h), given as a sparse per-token list built
//   by TokenAdjustmentBuilder; then:
//   temperature == 0: argmax (ties to the lower id).
//   otherwise: p = softmax(logits / temperature) restricted to the top_k
//   largest (when top_k > 0), then to the smallest prefix of tokens by
//   decreasing p whose mass reaches top_p; renormalised; one draw with
//   u = uniform(seed, output_index), a counter-based hash, so a request's
//   draws depend only on its seed and position, not on batching or
//   preemption.
// Log-probabilities are of the unmodified distribution log_softmax(logits)
// (vLLM's default logprobs_mode, raw_logprobs), whatever the processors did.
// A row that the processors leave without a finite logit (every id masked)
// yields token 0.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/sampling/logit_adjust.h"
#include "runtime/sampling_params.h"

namespace nucleus {

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;                                // log p(token) under log_softmax(logits)
  std::vector<std::pair<int32_t, float>> top_logprobs;  // params.logprobs entries, by decreasing logprob
};

using kernels::TokenAdjustment;

// logits: [vocab_size] f32. `seed` is the request's seed; output_index counts
// the request's generated tokens from 0. adjustments: the row's entries from
// TokenAdjustmentBuilder::build (ids distinct, < vocab_size); the penalties'
// strengths and min_p come from `params`.
SampleResult sample_token(const float* logits, int64_t vocab_size, const SamplingParams& params, uint64_t seed,
                          int64_t output_index, std::span<const TokenAdjustment> adjustments = {});

// What the penalties and min_tokens need of a sequence besides its params.
struct SampleHistory {
  std::span<const int32_t> prompt_ids;  // the prompt's ids (repeats allowed); read when repetition_penalty != 1
  const std::unordered_map<int32_t, int32_t>* output_counts = nullptr;  // generated id -> occurrences; may be null
  std::span<const int32_t> eos_ids;     // the model's EOS ids: masked with stop_token_ids under min_tokens
};

// Builds a row's sparse adjustment list: one entry per distinct id that is a
// generated token (when a penalty is set), a prompt token (when
// repetition_penalty != 1), a logit_bias key, or an EOS / stop id while
// output_index < min_tokens. Ids outside [0, vocab) are skipped (the engine
// refuses them at admission). Keeps a [vocab] scratch index, so building
// costs O(entries), not O(vocab); not thread-safe.
class TokenAdjustmentBuilder {
 public:
  explicit TokenAdjustmentBuilder(int64_t vocab) : slot_(vocab, 0) {}
  // Appends the entries to *out (not cleared: rows can share one buffer).
  void build(const SamplingParams& params, const SampleHistory& history, int64_t output_index,
             std::vector<TokenAdjustment>* out);

 private:
  std::vector<int32_t> slot_;  // [vocab]: 1 + index into *out of the id's entry, 0 when none (reset after build)
};

// The sampled row's logits after the adjustments and (temperature > 0)
// min_p: the row the CPU sampler draws from. logits: [vocab_size] f32.
std::vector<float> adjusted_logits(const float* logits, int64_t vocab_size, const SamplingParams& params,
                                   std::span<const TokenAdjustment> adjustments);

// A uniform double in [0, 1) from (seed, counter): SplitMix64 finalisers.
double counter_uniform(uint64_t seed, uint64_t counter);

}  // namespace nucleus
