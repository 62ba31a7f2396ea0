// The SM count of the calling thread's current CUDA device, for launchers that
// size grids by it. Host code; only compiled with CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

namespace nucleus::kernels {

// cudaDevAttrMultiProcessorCount of the current device, read once per device
// (one thread per GPU under tensor parallelism) and cached; 132 (an H200)
// when the attribute cannot be read.
inline int current_device_sms() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];
  int dev = 0;
  cudaGetDevice(&dev);
  const bool cacheable = dev >= 0 && dev < kMaxDevices;
  if (cacheable) {
    const int v = cached[dev].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int v = 0;
  cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
  if (v <= 0) v = 132;
  if (cacheable) cached[dev].store(v, std::memory_order_relaxed);
  return v;
}

}  // namespace nucleus::kernels
