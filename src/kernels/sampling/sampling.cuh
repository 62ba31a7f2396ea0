// Token sampling on the device for a batch of logit rows, with the CPU
// sampler's semantics (runtime/sampler.h, sample_token):
//   temperature == 0: argmax, ties to the lower id.
//   otherwise: p = softmax(logits / temperature) restricted to the top_k
//   largest (when 0 < top_k < vocab), then to the smallest prefix by
//   decreasing p whose mass reaches top_p, renormalised; one inverse-CDF draw
//   with u = counter_uniform(seed, output_index) (SplitMix64, bit-exact).
//   Order everywhere: decreasing logit, ties to the lower id.
// Log-probabilities are of the raw distribution log_softmax(logits).
// Rows with vLLM's logit processors (penalties, logit_bias, min_tokens, min_p)
// draw from an adjusted copy written by launch_adjust_rows (formulas:
// kernels/sampling/logit_adjust.h) while their logprobs stay those of the raw
// row (vLLM's raw_logprobs).
//
// Method (one 1024-thread block per row, no full sort):
//   1. one pass: max, argmax, log-sum-exp (online).
//   2. sampled rows: radix select on the 64-bit key (ordered logit bits,
//      inverted id) with 11-bit digits. A pass builds a histogram of counts
//      (top_k) or of fixed-point masses p * 2^31 / total (top_p cut, draw);
//      the digit where the running measure crosses the target is kept, and
//      passes go on until the crossing bucket (or everything above it) has at
//      most 4096 candidates. Those are gathered into shared memory and
//      bitonic-sorted; the mass above them is summed exactly (f64) during the
//      gather; the crossing is found with an f64 scan over the sorted
//      candidates, p computed like the CPU (exp(l / T - l_max / T) in f64).
//      The integer histograms only pick buckets: a draw can differ from the
//      CPU only where u lies within ~1e-7 (relative) of a CDF boundary.
//   3. top-N log-probabilities: the same select by count (N <= 20).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/sampling/logit_adjust.h"

namespace nucleus::kernels {

constexpr int kMaxSampleLogprobs = 20;
constexpr int64_t kMaxSampleVocab = int64_t{1} << 24;  // ids fit the key's low 24 bits

// One row's parameters (40 bytes, copied to the device per call).
struct SampleRowParams {
  float temperature;      // 0: greedy; > 0: sampled
  int32_t top_k;          // <= 0 or >= vocab: no top-k restriction
  float top_p;            // (0, 1]; 1: no top-p restriction
  int32_t num_logprobs;   // [0, kMaxSampleLogprobs]: top-N raw log-probabilities to return
  uint64_t seed;          // the request's seed
  uint64_t output_index;  // the request's generated-token count (the draw's counter)
  int32_t adjusted_row;   // -1: draw from the raw row; else the row of `adjusted` to draw from
  int32_t reserved;       // 0
};

// One row that draws from an adjusted copy (32 bytes, copied per call).
struct AdjustRowParams {
  int32_t src_row;        // row of the raw logits
  int32_t first_entry;    // its TokenAdjustments are entries[first_entry, first_entry + num_entries)
  int32_t num_entries;    // >= 0; ids distinct, in [0, vocab)
  float temperature;      // the row's temperature (min_p applies after it; 0: no min_p)
  float min_p;            // [0, 1]; 0: none
  PenaltyParams penalties;
};

// adjusted[r] = the raw row rows[r].src_row with each entry's logit replaced
// by adjust_logit(raw, entry, penalties), then (min_p > 0, temperature > 0)
// the entries failing keep_min_p against the adjusted row's max set to -inf.
//   logits:   [*, vocab] f32 (device), read only.
//   rows:     [num_adjusted] (device); entries: [sum of num_entries] (device).
//   adjusted: [num_adjusted, vocab] f32 (device), written.
// Errors: cudaErrorInvalidValue when vocab is outside [1, kMaxSampleVocab].
// Stream-async, graph-safe.
cudaError_t launch_adjust_rows(const float* logits, int64_t vocab, int64_t num_adjusted, const AdjustRowParams* rows,
                               const TokenAdjustment* entries, float* adjusted, cudaStream_t stream);

// One row's result.
struct SampleRowResult {
  int32_t token;                                  // sampled (or argmax) id
  float logprob;                                  // log_softmax(logits)[token]
  int32_t num_top;                                // min(num_logprobs, vocab)
  int32_t top_ids[kMaxSampleLogprobs];            // by decreasing logit, ties to the lower id
  float top_logprobs[kMaxSampleLogprobs];         // log_softmax(logits)[top_ids[i]]
};

// Samples one token per row.
//   logits:  [num_rows, vocab] f32, row stride vocab (device). Rows need a
//            finite maximum; -inf entries are allowed (probability 0).
//   adjusted: [*, vocab] f32 (device), the rows that params' adjusted_row
//            name (from launch_adjust_rows); may be null when none does.
//            The token is drawn from it (argmax for greedy rows; token 0
//            when it holds no finite logit); logprobs are the raw row's.
//   params:  [num_rows] (device); results: [num_rows] (device).
// Errors: cudaErrorInvalidValue when vocab is outside [1, kMaxSampleVocab].
// Stream-async, graph-safe (no allocation, no host sync).
cudaError_t launch_sample_rows(const float* logits, const float* adjusted, int64_t num_rows, int64_t vocab,
                               const SampleRowParams* params, SampleRowResult* results, cudaStream_t stream);

// out[i] = counter_uniform(seeds[i], counters[i]) computed on the device (for
// tests: bit-identical to the CPU's). All arrays [n] on the device.
cudaError_t launch_counter_uniform(const uint64_t* seeds, const uint64_t* counters, int64_t n, double* out,
                                   cudaStream_t stream);

}  // namespace nucleus::kernels
