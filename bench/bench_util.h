// What the kernel benchmarks (bench/*_bench.cpp) share: a kernel's device
// time per launch inside CUDA graphs, random device inputs, list flags and the
// models/ directory. Only for CUDA benchmarks.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace nucleus::bench {

constexpr int kLaunchesPerGraph = 20;

// Median microseconds per launch(copy): CUDA graphs of 20 launches rotating
// through `copies` (distinct weight copies, so that a pass reads past the
// L2), events around each graph replay, the median over ~150 ms of replays
// divided by 20. The first two launches run eagerly first (plans,
// workspaces); negative when one of them fails.
inline double median_us_per_launch(int copies, const std::function<bool(int)>& launch) {
  cudaStream_t stream = cuda::context().stream;
  for (int c = 0; c < std::min(copies, 2); ++c)
    if (!launch(c)) return -1;
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int num_graphs = std::max(1, (copies + kLaunchesPerGraph - 1) / kLaunchesPerGraph);
  std::vector<cudaGraphExec_t> execs;
  for (int g = 0; g < num_graphs; ++g) {
    cudaGraph_t graph;
    NUCLEUS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < kLaunchesPerGraph; ++i) NUCLEUS_CHECK(launch((g * kLaunchesPerGraph + i) % copies), "launch");
    NUCLEUS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    NUCLEUS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    NUCLEUS_CUDA_CHECK(cudaGraphDestroy(graph));
    execs.push_back(exec);
  }
  cudaEvent_t e0, e1;
  NUCLEUS_CUDA_CHECK(cudaEventCreate(&e0));
  NUCLEUS_CUDA_CHECK(cudaEventCreate(&e1));
  NUCLEUS_CUDA_CHECK(cudaEventRecord(e0, stream));
  for (auto& ex : execs) NUCLEUS_CUDA_CHECK(cudaGraphLaunch(ex, stream));
  NUCLEUS_CUDA_CHECK(cudaEventRecord(e1, stream));
  NUCLEUS_CUDA_CHECK(cudaEventSynchronize(e1));
  float warm_ms = 0;
  NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&warm_ms, e0, e1));
  const int reps = std::clamp(static_cast<int>(150.0 / std::max(warm_ms, 1e-3f)), 5, 60);
  std::vector<cudaEvent_t> marks(reps * execs.size() + 1);
  for (auto& e : marks) NUCLEUS_CUDA_CHECK(cudaEventCreate(&e));
  NUCLEUS_CUDA_CHECK(cudaEventRecord(marks[0], stream));
  size_t mi = 1;
  for (int r = 0; r < reps; ++r)
    for (auto& ex : execs) {
      NUCLEUS_CUDA_CHECK(cudaGraphLaunch(ex, stream));
      NUCLEUS_CUDA_CHECK(cudaEventRecord(marks[mi++], stream));
    }
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> times;
  for (size_t i = 1; i < marks.size(); ++i) {
    float ms = 0;
    NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i - 1], marks[i]));
    times.push_back(ms);
  }
  for (auto& e : marks) cudaEventDestroy(e);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  for (auto& ex : execs) cudaGraphExecDestroy(ex);
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2] * 1e3 / kLaunchesPerGraph;
}

// A xorshift64 stream, the same sequence in every run.
inline uint64_t next_rand() {
  static uint64_t state = 0x243F6A8885A308D3ull;
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}

// `count` bf16 values on the device, uniform on a grid in [-scale, scale).
inline Tensor random_bf16(int64_t count, float scale) {
  Tensor t = Tensor::empty({count}, DType::kBF16, Device::kCuda);
  std::vector<uint16_t> h(count);
  for (auto& v : h) v = f32_to_bf16(scale * (static_cast<float>(next_rand() % 2000) / 1000.0f - 1.0f));
  copy_to_device(t.raw(), h.data(), h.size() * 2);
  return t;
}

// "1,4,8" -> {1, 4, 8}.
inline std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> v;
  for (const char* p = s; *p;) {
    v.push_back(std::strtoll(p, nullptr, 10));
    p = std::strchr(p, ',');
    if (!p) break;
    ++p;
  }
  return v;
}

// models/: $NUCLEUS_MODELS_DIR, else ./models (run from the repository root),
// else the source tree's.
inline std::string models_dir() {
  if (const char* d = std::getenv("NUCLEUS_MODELS_DIR")) return d;
  if (std::filesystem::exists("models/configs")) return "models";
  return std::string(NUCLEUS_SOURCE_DIR) + "/models";
}

}  // namespace nucleus::bench
