// The CUDA device context: one device (0), one stream for the engine's work,
// the cuBLASLt handle and its workspace, and the device allocator that
// Tensor::empty(..., Device::kCuda) uses. Only compiled with CUDA.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "core/status.h"

namespace nucleus::cuda {

struct Context {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;  // cuBLASLt workspace
  size_t workspace_bytes = 0;
  int num_sms = 0;
  size_t l2_bytes = 0;
  size_t total_memory = 0;
  std::string name;
};

// Initialises the context on first use (device 0). Errors when no device.
StatusOr<Context*> get_context();
// The initialised context (checks that init happened).
Context& context();
// Bytes currently held by Tensor allocations on the device.
size_t allocated_bytes();

}  // namespace nucleus::cuda
