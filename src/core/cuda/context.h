// The CUDA device contexts: per device one stream for the engine's work, the
// cuBLASLt handle and its workspace; and the device allocator that
// Tensor::empty(..., Device::kCuda) uses. A thread works on one device: device
// 0 unless it called bind_thread_to_device (tensor parallelism runs one
// thread per GPU). Only compiled with CUDA.
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

// Most devices a process drives (tensor parallelism: 8 GPUs of a host).
constexpr int kMaxDevices = 16;

// The calling thread's device's context, initialised on first use. Errors
// when there is no such device or it is not a Hopper GPU.
StatusOr<Context*> get_context();
// The calling thread's device's initialised context (checks that init happened).
Context& context();
// Binds the calling thread to `device` (cudaSetDevice, and context() then
// returns that device's context, initialised here). Errors: no such device,
// not sm_90, or device >= kMaxDevices.
Status bind_thread_to_device(int device);
// The device the calling thread is bound to (0 unless bound otherwise).
int thread_device();
// Number of CUDA devices visible to the process (0 when none or no driver).
int device_count();
// Bytes currently held by Tensor allocations on the device.
size_t allocated_bytes();

}  // namespace nucleus::cuda
