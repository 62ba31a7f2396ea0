#include "runtime/device_sampler.h"

#include <algorithm>
#include <string>

#include "core/check.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "kernels/sampling/sampling.cuh"
#include "ops/op_cuda_check.h"
#endif

namespace nucleus {

DeviceSampleRequest make_device_sample_request(const SamplingParams& params, uint64_t seed, int64_t output_index) {
  DeviceSampleRequest r;
  r.temperature = params.temperature;
  r.top_k = params.top_k;
  r.top_p = params.top_p;
  r.seed = seed;
  r.output_index = output_index;
  r.num_logprobs = params.logprobs;
  return r;
}

#ifdef NUCLEUS_HAVE_CUDA

StatusOr<std::unique_ptr<DeviceSampler>> DeviceSampler::create(int64_t max_rows, int64_t vocab) {
  if (max_rows < 1 || max_rows > (int64_t{1} << 30))
    return invalid_argument("device sampler: max_rows " + std::to_string(max_rows) + " is outside [1, 2^30]");
  if (vocab < 1 || vocab > kernels::kMaxSampleVocab)
    return invalid_argument("device sampler: vocab " + std::to_string(vocab) + " is outside [1, 2^24]");
  auto ctx = cuda::get_context();
  if (!ctx.ok()) return ctx.status().with_context("device sampler");
  std::unique_ptr<DeviceSampler> s(new DeviceSampler());
  s->max_rows_ = max_rows;
  s->vocab_ = vocab;
  const size_t params_bytes = max_rows * sizeof(kernels::SampleRowParams);
  const size_t results_bytes = max_rows * sizeof(kernels::SampleRowResult);
  NUCLEUS_CUDA_CHECK(cudaMalloc(&s->d_params_, params_bytes));
  NUCLEUS_CUDA_CHECK(cudaMalloc(&s->d_results_, results_bytes));
  NUCLEUS_CUDA_CHECK(cudaMallocHost(&s->h_params_, params_bytes));
  NUCLEUS_CUDA_CHECK(cudaMallocHost(&s->h_results_, results_bytes));
  return s;
}

DeviceSampler::~DeviceSampler() {
  if (d_params_) cudaFree(d_params_);
  if (d_results_) cudaFree(d_results_);
  if (h_params_) cudaFreeHost(h_params_);
  if (h_results_) cudaFreeHost(h_results_);
}

std::vector<SampleResult> DeviceSampler::sample(const float* logits, const std::vector<DeviceSampleRequest>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  NUCLEUS_CHECK(n <= max_rows_, "device sampler: {} rows > capacity {}", n, max_rows_);
  if (n == 0) return {};
  NUCLEUS_CHECK(logits != nullptr, "device sampler: null logits");
  auto* hp = static_cast<kernels::SampleRowParams*>(h_params_);
  for (int64_t i = 0; i < n; ++i) {
    const DeviceSampleRequest& r = rows[i];
    NUCLEUS_CHECK(r.temperature >= 0.0f && r.top_p > 0.0f && r.top_p <= 1.0f && r.num_logprobs >= 0 &&
                      r.num_logprobs <= kernels::kMaxSampleLogprobs,
                  "device sampler: row {} has temperature {}, top_p {}, logprobs {}", i, r.temperature, r.top_p,
                  r.num_logprobs);
    hp[i] = {r.temperature, r.top_k, r.top_p, r.num_logprobs, r.seed, static_cast<uint64_t>(r.output_index)};
  }
  cudaStream_t stream = cuda::context().stream;
  // A failure here is the step's error (the engine fails the step, or itself
  // when the device's error is sticky), not a stop of the process.
  NUCLEUS_OP_CUDA_CHECK(
      cudaMemcpyAsync(d_params_, h_params_, n * sizeof(kernels::SampleRowParams), cudaMemcpyHostToDevice, stream));
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_sample_rows(logits, n, vocab_,
                                                    static_cast<const kernels::SampleRowParams*>(d_params_),
                                                    static_cast<kernels::SampleRowResult*>(d_results_), stream));
  NUCLEUS_OP_CUDA_CHECK(cudaMemcpyAsync(h_results_, d_results_, n * sizeof(kernels::SampleRowResult),
                                        cudaMemcpyDeviceToHost, stream));
  NUCLEUS_OP_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto* hr = static_cast<const kernels::SampleRowResult*>(h_results_);
  std::vector<SampleResult> out(n);
  for (int64_t i = 0; i < n; ++i) {
    out[i].token = hr[i].token;
    out[i].logprob = hr[i].logprob;
    out[i].top_logprobs.reserve(hr[i].num_top);
    for (int j = 0; j < hr[i].num_top; ++j) out[i].top_logprobs.emplace_back(hr[i].top_ids[j], hr[i].top_logprobs[j]);
  }
  return out;
}

#else  // CPU-only build

StatusOr<std::unique_ptr<DeviceSampler>> DeviceSampler::create(int64_t, int64_t) {
  return unsupported("device sampler: this build has no CUDA kernels (configured without nvcc)");
}

DeviceSampler::~DeviceSampler() = default;

std::vector<SampleResult> DeviceSampler::sample(const float*, const std::vector<DeviceSampleRequest>&) {
  NUCLEUS_CHECK(false, "device sampler used in a CPU-only build");
  return {};
}

#endif

}  // namespace nucleus
