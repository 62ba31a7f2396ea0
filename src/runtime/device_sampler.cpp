#include "runtime/device_sampler.h"

#include <algorithm>
#include <climits>
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
  r.min_p = params.min_p;
  r.penalties = {params.repetition_penalty, params.frequency_penalty, params.presence_penalty};
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
  s->upload_bytes_ = params_bytes;
  NUCLEUS_CUDA_CHECK(cudaMalloc(&s->d_upload_, params_bytes));
  NUCLEUS_CUDA_CHECK(cudaMalloc(&s->d_results_, results_bytes));
  NUCLEUS_CUDA_CHECK(cudaMallocHost(&s->h_upload_, params_bytes));
  NUCLEUS_CUDA_CHECK(cudaMallocHost(&s->h_results_, results_bytes));
  return s;
}

DeviceSampler::~DeviceSampler() {
  if (d_upload_) cudaFree(d_upload_);
  if (d_adjusted_) cudaFree(d_adjusted_);
  if (d_results_) cudaFree(d_results_);
  if (h_upload_) cudaFreeHost(h_upload_);
  if (h_results_) cudaFreeHost(h_results_);
}

namespace {
size_t align16(size_t n) { return (n + 15) & ~size_t{15}; }
}  // namespace

// Called between calls only: the previous call synchronized the stream, so
// the old buffers are idle when freed.
void DeviceSampler::reserve(size_t upload_bytes, int64_t adjusted_rows) {
  if (upload_bytes > upload_bytes_) {
    const size_t bytes = std::max(upload_bytes, upload_bytes_ * 2);
    NUCLEUS_OP_CUDA_CHECK(cudaFree(d_upload_));
    NUCLEUS_OP_CUDA_CHECK(cudaFreeHost(h_upload_));
    d_upload_ = h_upload_ = nullptr;
    upload_bytes_ = 0;
    NUCLEUS_OP_CUDA_CHECK(cudaMalloc(&d_upload_, bytes));
    NUCLEUS_OP_CUDA_CHECK(cudaMallocHost(&h_upload_, bytes));
    upload_bytes_ = bytes;
  }
  if (adjusted_rows > adjusted_rows_) {
    const int64_t rows = std::min(max_rows_, std::max(adjusted_rows, adjusted_rows_ * 2));
    NUCLEUS_OP_CUDA_CHECK(cudaFree(d_adjusted_));
    d_adjusted_ = nullptr;
    adjusted_rows_ = 0;
    const size_t bytes = static_cast<size_t>(rows) * vocab_ * sizeof(float);
    NUCLEUS_OP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_adjusted_), bytes));
    adjusted_rows_ = rows;
  }
}

std::vector<SampleResult> DeviceSampler::sample(const float* logits, const std::vector<DeviceSampleRequest>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  NUCLEUS_CHECK(n <= max_rows_, "device sampler: {} rows > capacity {}", n, max_rows_);
  if (n == 0) return {};
  NUCLEUS_CHECK(logits != nullptr, "device sampler: null logits");
  // Which rows draw from an adjusted copy, and the upload's layout.
  int64_t num_adjusted = 0, num_entries = 0;
  for (const DeviceSampleRequest& r : rows) {
    if (!r.adjustments.empty() || (r.min_p > 0.0f && r.temperature != 0.0f)) {
      ++num_adjusted;
      num_entries += static_cast<int64_t>(r.adjustments.size());
    }
  }
  NUCLEUS_CHECK(num_entries <= INT32_MAX, "device sampler: {} adjustment entries", num_entries);
  const size_t adjust_offset = align16(n * sizeof(kernels::SampleRowParams));
  const size_t entries_offset = align16(adjust_offset + num_adjusted * sizeof(kernels::AdjustRowParams));
  const size_t upload_bytes = entries_offset + num_entries * sizeof(kernels::TokenAdjustment);
  reserve(upload_bytes, num_adjusted);
  auto* base = static_cast<char*>(h_upload_);
  auto* hp = reinterpret_cast<kernels::SampleRowParams*>(base);
  auto* ha = reinterpret_cast<kernels::AdjustRowParams*>(base + adjust_offset);
  auto* he = reinterpret_cast<kernels::TokenAdjustment*>(base + entries_offset);
  int32_t adjusted = 0, entry = 0;
  for (int64_t i = 0; i < n; ++i) {
    const DeviceSampleRequest& r = rows[i];
    NUCLEUS_CHECK(r.temperature >= 0.0f && r.top_p > 0.0f && r.top_p <= 1.0f && r.num_logprobs >= 0 &&
                      r.num_logprobs <= kernels::kMaxSampleLogprobs && r.min_p >= 0.0f && r.min_p <= 1.0f &&
                      r.penalties.repetition > 0.0f,
                  "device sampler: row {} has temperature {}, top_p {}, logprobs {}, min_p {}, repetition {}", i,
                  r.temperature, r.top_p, r.num_logprobs, r.min_p, r.penalties.repetition);
    int32_t adjusted_row = -1;
    if (!r.adjustments.empty() || (r.min_p > 0.0f && r.temperature != 0.0f)) {
      for (const TokenAdjustment& e : r.adjustments)
        NUCLEUS_CHECK(e.id >= 0 && e.id < vocab_, "device sampler: row {} adjusts id {} of vocab {}", i, e.id, vocab_);
      std::copy(r.adjustments.begin(), r.adjustments.end(), he + entry);
      ha[adjusted] = {static_cast<int32_t>(i), entry, static_cast<int32_t>(r.adjustments.size()), r.temperature,
                      r.min_p, r.penalties};
      entry += static_cast<int32_t>(r.adjustments.size());
      adjusted_row = adjusted++;
    }
    hp[i] = {r.temperature, r.top_k, r.top_p, r.num_logprobs, r.seed, static_cast<uint64_t>(r.output_index),
             adjusted_row, 0};
  }
  cudaStream_t stream = cuda::context().stream;
  // A failure here is the step's error (the engine fails the step, or itself
  // when the device's error is sticky), not a stop of the process.
  NUCLEUS_OP_CUDA_CHECK(cudaMemcpyAsync(d_upload_, h_upload_, upload_bytes, cudaMemcpyHostToDevice, stream));
  auto* dbase = static_cast<char*>(d_upload_);
  if (num_adjusted > 0)
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_adjust_rows(
        logits, vocab_, num_adjusted, reinterpret_cast<const kernels::AdjustRowParams*>(dbase + adjust_offset),
        reinterpret_cast<const kernels::TokenAdjustment*>(dbase + entries_offset), d_adjusted_, stream));
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_sample_rows(logits, num_adjusted > 0 ? d_adjusted_ : nullptr, n, vocab_,
                                                    reinterpret_cast<const kernels::SampleRowParams*>(dbase),
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
