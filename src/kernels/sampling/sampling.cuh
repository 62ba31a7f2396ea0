// Token sampling on the device for a batch of logit rows, with the CPU
// sampler's semantics (runtime/sampler.h, sample_token):
//   temperature == 0: argmax, ties to the lower id.
//   otherwise: p = softmax(logits / temperature) restricted to the top_k
//   largest (when 0 < top_k < vocab), then to the smallest prefix by
//   decreasing p whose mass reaches top_p, renormalised; one inverse-CDF draw
//   with u = counter_uniform(seed, output_index) (SplitMix64, bit-exact).
//   Order everywhere: decreasing logit, ties to the lower id.
// Log-probabilities are of the raw distribution log_softmax(logits).
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

namespace nucleus::kernels {

constexpr int kMaxSampleLogprobs = 20;
constexpr int64_t kMaxSampleVocab = int64_t{1} << 24;  // ids fit the key's low 24 bits

// One row's parameters (32 bytes, copied to the device per call).
struct SampleRowParams {
  float temperature;      // 0: greedy; > 0: sampled
  int32_t top_k;          // <= 0 or >= vocab: no top-k restriction
  float top_p;            // (0, 1]; 1: no top-p restriction
  int32_t num_logprobs;   // [0, kMaxSampleLogprobs]: top-N raw log-probabilities to return
  uint64_t seed;          // the request's seed
  uint64_t output_index;  // the request's generated-token count (the draw's counter)
};

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
//   params:  [num_rows] (device); results: [num_rows] (device).
// Errors: cudaErrorInvalidValue when vocab is outside [1, kMaxSampleVocab].
// Stream-async, graph-safe (no allocation, no host sync).
cudaError_t launch_sample_rows(const float* logits, int64_t num_rows, int64_t vocab, const SampleRowParams* params,
                               SampleRowResult* results, cudaStream_t stream);

// out[i] = counter_uniform(seeds[i], counters[i]) computed on the device (for
// tests: bit-identical to the CPU's). All arrays [n] on the device.
cudaError_t launch_counter_uniform(const uint64_t* seeds, const uint64_t* counters, int64_t n, double* out,
                                   cudaStream_t stream);

}  // namespace nucleus::kernels
