// The workspace of a split-K GEMM (bf16 split-K and FP8 linear): f32 partial
// sums and per-tile counters, allocated once on first use and kept (CUDA
// graphs hold their addresses).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/check.h"
#include "core/status.h"
#include "ops/op_cuda_check.h"

namespace nucleus::cuda_ops {

// Fills `ws` (a kernels::SplitKWorkspace or Fp8SplitWorkspace: fields
// partial, counters, partial_floats, num_counters) with `partial_floats`
// floats and `num_counters` ints, the counters zeroed on `stream`. Must run
// outside CUDA-graph capture (a bug otherwise: stops with `what`). Errors:
// kResourceExhausted naming `what` when cudaMalloc fails; the error is
// cleared (not sticky), nothing is kept, and a later step may retry.
template <typename Workspace>
Status allocate_split_workspace(Workspace& ws, int64_t partial_floats, int64_t num_counters, cudaStream_t stream,
                                const char* what) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  NUCLEUS_OP_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
  NUCLEUS_CHECK(st == cudaStreamCaptureStatusNone,
                "{} must be allocated outside CUDA-graph capture; run one eager step first", what);
  float* partial = nullptr;
  int* counters = nullptr;
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&partial), partial_floats * sizeof(float));
  if (e == cudaSuccess) e = cudaMalloc(reinterpret_cast<void**>(&counters), num_counters * sizeof(int));
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky
    if (partial) cudaFree(partial);
    return resource_exhausted(std::string("cudaMalloc of ") + what + " failed: " + cudaGetErrorString(e));
  }
  NUCLEUS_OP_CUDA_CHECK(cudaMemsetAsync(counters, 0, num_counters * sizeof(int), stream));
  ws.partial = partial;
  ws.counters = counters;
  ws.partial_floats = partial_floats;
  ws.num_counters = num_counters;
  return ok_status();
}

}  // namespace nucleus::cuda_ops
