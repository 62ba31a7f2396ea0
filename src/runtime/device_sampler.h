// Token sampling on the GPU for a batch of logit rows, each row with its own
// parameters; same semantics as the CPU sampler (runtime/sampler.h,
// sample_token): greedy argmax (ties to the lower id), or softmax(logits / T)
// restricted to top_k then top_p, one inverse-CDF draw with
// u = counter_uniform(seed, output_index); log-probabilities of the raw
// log_softmax(logits). Given the same logits the token equals the CPU's
// except where u lies within ~1e-7 of a CDF boundary (summation order).
// Kernels: kernels/sampling/sampling.cuh (method and costs there).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/status.h"
#include "runtime/sampler.h"
#include "runtime/sampling_params.h"

namespace nucleus {

// One row's sampling request (the fields of SamplingParams that sampling uses).
struct DeviceSampleRequest {
  float temperature = 1.0f;  // 0: greedy
  int32_t top_k = 0;         // <= 0 or >= vocab: all tokens
  float top_p = 1.0f;        // (0, 1]
  uint64_t seed = 0;         // the request's seed
  int64_t output_index = 0;  // the request's generated-token count (from 0)
  int32_t num_logprobs = 0;  // [0, 20]: top-N raw log-probabilities to return
};

// The request for `params` at generated-token position `output_index`.
DeviceSampleRequest make_device_sample_request(const SamplingParams& params, uint64_t seed, int64_t output_index);

class DeviceSampler {
 public:
  // max_rows: rows per call at most; vocab: row width (<= 2^24). Allocates
  // the device and pinned host buffers. Errors: InvalidArgument for sizes out
  // of range, Unsupported without a usable CUDA device (or a CPU-only build).
  static StatusOr<std::unique_ptr<DeviceSampler>> create(int64_t max_rows, int64_t vocab);
  ~DeviceSampler();
  DeviceSampler(const DeviceSampler&) = delete;
  DeviceSampler& operator=(const DeviceSampler&) = delete;

  // logits: device pointer [rows.size(), vocab] f32, row stride vocab, written
  // by work on the engine stream (cuda::context().stream), where the kernel
  // runs. One result per row, in order. One host sync (the results' copy);
  // not graph-capturable. rows.size() <= max_rows and valid fields
  // (SamplingParams::validate) are the caller's invariants (checked).
  std::vector<SampleResult> sample(const float* logits, const std::vector<DeviceSampleRequest>& rows);

  int64_t max_rows() const { return max_rows_; }
  int64_t vocab() const { return vocab_; }

 private:
  DeviceSampler() = default;

  int64_t max_rows_ = 0;
  int64_t vocab_ = 0;
  void* d_params_ = nullptr;   // [max_rows] kernels::SampleRowParams (device)
  void* d_results_ = nullptr;  // [max_rows] kernels::SampleRowResult (device)
  void* h_params_ = nullptr;   // pinned host mirrors
  void* h_results_ = nullptr;
};

}  // namespace nucleus
