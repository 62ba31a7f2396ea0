// NUCLEUS_BENCH_NEEDS_CUDA
// DeviceSampler::sample per call (params upload, the sampling kernel, results
// copy, one host sync) on batches of `rows` logit rows of `vocab` f32, per
// sampling mode. Logits: normal(0, sd) per row, distinct rows (sd 2: a flat
// distribution whose top-p nucleus holds thousands of tokens; sd 6: peaked).
// The logits stay where the previous call left them (L2 for small batches),
// as after the LM head. Prints the median wall time per call, the device time
// of the call (events), and the logit read rate (rows * vocab * 4 bytes once)
// against 4.58 TB/s of HBM (core/roofline.h); and the CPU sampler's time per
// row for reference.
// Modes with vLLM's logit processors (penalties over N ids, min_p) add the
// adjusted copy of each row (one more read and write of the row, plus a read
// and a masking pass for min_p) and the upload of N 16-byte entries per row.
//   sampling_bench [--quick]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/roofline.h"
#include "runtime/device_sampler.h"
#include "runtime/sampler.h"

using namespace nucleus;

namespace {

constexpr double kHbmBytesPerSecond = roofline::kHbmBytesPerSec;

struct Mode {
  const char* name;
  float temperature;
  int32_t top_k;
  float top_p;
  int32_t num_logprobs;
  float min_p = 0.0f;
  int32_t num_adjusted_ids = 0;  // ids with penalty entries (as prompt + output tokens)
};

const Mode kModes[] = {
    {"greedy", 0.0f, 0, 1.0f, 0},
    {"greedy+logprobs5", 0.0f, 0, 1.0f, 5},
    {"T0.7 top_k50", 0.7f, 50, 1.0f, 0},
    {"T0.6 top_p0.95", 0.6f, 0, 0.95f, 0},
    {"T1 (no top-k/p)", 1.0f, 0, 1.0f, 0},
    {"T1 top_k50 top_p0.9", 1.0f, 50, 0.9f, 0},
    {"greedy +penalties(64 ids)", 0.0f, 0, 1.0f, 0, 0.0f, 64},
    {"T0.7 top_k50 +penalties(64 ids)", 0.7f, 50, 1.0f, 0, 0.0f, 64},
    {"T1 min_p0.05", 1.0f, 0, 1.0f, 0, 0.05f, 0},
    {"T0.6 top_p0.95 min_p0.05 +penalties(4096 ids)", 0.6f, 0, 0.95f, 0, 0.05f, 4096},
};

// N distinct ids spread over the vocabulary: every other one generated
// (count 1..3), all in the prompt.
std::vector<TokenAdjustment> penalty_entries(int32_t n, int64_t vocab) {
  std::vector<TokenAdjustment> out;
  for (int32_t i = 0; i < n; ++i)
    out.push_back({static_cast<int32_t>((int64_t{i} * 7919) % vocab), i % 2 ? 1 + i % 3 : 0, 0.0f,
                   kernels::kAdjustInPrompt});
  return out;
}

std::vector<float> random_rows(int64_t rows, int64_t vocab, float sd, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(rows * vocab);
  for (auto& x : v) x = d(rng);
  return v;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::string why;
  if (!cuda_available(&why)) {
    std::fprintf(stderr, "sampling_bench: %s\n", why.c_str());
    return 1;
  }
  cudaStream_t stream = cuda::context().stream;
  const int iters = quick ? 5 : 30;
  std::printf("| vocab | logits sd | rows | mode | us/call (wall) | us/call (device) | logit GB/s | %% of HBM |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (int64_t vocab : {102400, 129280}) {
    for (float sd : {2.0f, 6.0f}) {
      const int64_t max_rows = 256;
      const auto host = random_rows(max_rows, vocab, sd, static_cast<uint64_t>(vocab) + static_cast<uint64_t>(sd));
      Tensor d = Tensor::empty({max_rows, vocab}, DType::kF32, Device::kCuda);
      copy_to_device(d.raw(), host.data(), host.size() * sizeof(float));
      auto sampler = DeviceSampler::create(max_rows, vocab);
      if (!sampler.ok()) {
        std::fprintf(stderr, "%s\n", sampler.status().to_string().c_str());
        return 1;
      }
      for (int64_t rows : {1, 32, 256}) {
        for (const Mode& m : kModes) {
          std::vector<DeviceSampleRequest> reqs(rows);
          const std::vector<TokenAdjustment> entries = penalty_entries(m.num_adjusted_ids, vocab);
          for (int64_t r = 0; r < rows; ++r) {
            reqs[r] = {m.temperature, m.top_k, m.top_p, static_cast<uint64_t>(r + 1), 0, m.num_logprobs};
            reqs[r].min_p = m.min_p;
            if (m.num_adjusted_ids > 0) {
              reqs[r].penalties = {1.2f, 0.5f, 0.5f};
              reqs[r].adjustments = entries;
            }
          }
          cudaEvent_t start, stop;
          NUCLEUS_CUDA_CHECK(cudaEventCreate(&start));
          NUCLEUS_CUDA_CHECK(cudaEventCreate(&stop));
          std::vector<double> wall, dev;
          for (int i = 0; i < iters + 3; ++i) {
            for (auto& q : reqs) q.output_index = i;  // a new draw each call
            NUCLEUS_CUDA_CHECK(cudaEventRecord(start, stream));
            const auto t0 = std::chrono::steady_clock::now();
            const auto res = (*sampler)->sample(d.data<float>(), reqs);
            const auto t1 = std::chrono::steady_clock::now();
            NUCLEUS_CUDA_CHECK(cudaEventRecord(stop, stream));
            NUCLEUS_CUDA_CHECK(cudaEventSynchronize(stop));
            float ms = 0;
            NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
            if (i < 3) continue;  // warm-up
            wall.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
            dev.push_back(ms * 1e3);
          }
          NUCLEUS_CUDA_CHECK(cudaEventDestroy(start));
          NUCLEUS_CUDA_CHECK(cudaEventDestroy(stop));
          const double us = median(wall), dus = median(dev);
          const double gbs = rows * vocab * 4.0 / (dus * 1e-6) / 1e9;
          std::printf("| %lld | %.0f | %lld | %s | %.1f | %.1f | %.0f | %.1f%% |\n", static_cast<long long>(vocab), sd,
                      static_cast<long long>(rows), m.name, us, dus, gbs, 100.0 * gbs * 1e9 / kHbmBytesPerSecond);
        }
      }
    }
  }
  // CPU reference: sample_token on one row, per mode.
  const int64_t vocab = 129280;
  const auto row = random_rows(1, vocab, 2.0f, 5);
  std::printf("\nCPU sample_token, vocab %lld, sd 2, one row:\n", static_cast<long long>(vocab));
  for (const Mode& m : kModes) {
    SamplingParams sp;
    sp.temperature = m.temperature;
    sp.top_k = m.top_k;
    sp.top_p = m.top_p;
    sp.logprobs = m.num_logprobs;
    sp.min_p = m.min_p;
    const std::vector<TokenAdjustment> entries = penalty_entries(m.num_adjusted_ids, vocab);
    if (m.num_adjusted_ids > 0) sp.repetition_penalty = 1.2f, sp.frequency_penalty = sp.presence_penalty = 0.5f;
    std::vector<double> t;
    for (int i = 0; i < (quick ? 2 : 5); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      volatile int32_t tok = sample_token(row.data(), vocab, sp, 1, i, entries).token;
      (void)tok;
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::printf("  %-46s %9.1f us\n", m.name, median(t));
  }
  return 0;
}
