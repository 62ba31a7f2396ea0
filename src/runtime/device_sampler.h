// Token sampling on the GPU for a batch of logit rows, each row with its own
// parameters; same semantics as the CPU sampler (runtime/sampler.h,
// sample_token): greedy argmax (ties to the lower id), or softmax(logits / T)
// restricted to top_k then top_p, one inverse-CDF draw with
// u = counter_uniform(seed, output_index); log-probabilities of the raw
// log_softmax(logits). Rows with penalties, logit_bias, min_tokens or min_p
// draw from an adjusted copy of their row (a scratch buffer, filled by one
// kernel from the rows' sparse adjustment lists, uploaded with the
// parameters), as the CPU sampler does. Given the same logits the token
// equals the CPU's except where u lies within ~1e-7 of a CDF boundary
// (summation order).
// Kernels: kernels/sampling/sampling.cuh (method and costs there).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
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
  float min_p = 0.0f;        // [0, 1]; applied after temperature on sampled rows
  kernels::PenaltyParams penalties{1.0f, 0.0f, 0.0f};  // repetition, frequency, presence
  // The row's entries (TokenAdjustmentBuilder::build; ids distinct and in
  // [0, vocab)), borrowed for the call. Empty and min_p == 0: the raw row.
  std::span<const TokenAdjustment> adjustments{};
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
  // by work on the engine stream (cuda::context().stream), where the kernels
  // run; read only. One result per row, in order. One host copy up (params
  // and adjustment entries) and one host sync (the results' copy); not
  // graph-capturable (it runs after the decode graph's replay). The scratch
  // for adjusted rows ([rows that need one, vocab] f32) and the staging
  // buffers grow on the first call that needs more (a failed allocation
  // throws OpCudaError: the step's error). rows.size() <= max_rows and valid
  // fields (SamplingParams::validate) are the caller's invariants (checked).
  std::vector<SampleResult> sample(const float* logits, const std::vector<DeviceSampleRequest>& rows);

  int64_t max_rows() const { return max_rows_; }
  int64_t vocab() const { return vocab_; }

 private:
  DeviceSampler() = default;
  // Grows the upload buffers to at least upload_bytes and the adjusted-row
  // scratch to at least adjusted_rows rows.
  void reserve(size_t upload_bytes, int64_t adjusted_rows);

  int64_t max_rows_ = 0;
  int64_t vocab_ = 0;
  // Upload: [n SampleRowParams | m AdjustRowParams | entries TokenAdjustment], each 16-byte aligned.
  void* d_upload_ = nullptr;
  void* h_upload_ = nullptr;  // pinned host mirror
  size_t upload_bytes_ = 0;
  float* d_adjusted_ = nullptr;  // [adjusted_rows_, vocab] f32 scratch
  int64_t adjusted_rows_ = 0;
  void* d_results_ = nullptr;  // [max_rows] kernels::SampleRowResult (device)
  void* h_results_ = nullptr;  // pinned host mirror
};

}  // namespace nucleus
