// WeightView: a linear weight as CUDA kernels read it — bf16, or FP8 e4m3
// with 128x128-style block scales (W[n, k] = q[n, k] * scale_inv[n / block_n, k / block_k]).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace nucleus::kernels {

struct WeightView {
  const void* data = nullptr;         // [n, k] bf16 or f8e4m3
  const float* scale_inv = nullptr;  // FP8: [ceil(n / block_n), ceil(k / block_k)] f32; else null
  int64_t n = 0;
  int64_t k = 0;
  int block_n = 0;
  int block_k = 0;

  __host__ __device__ bool fp8() const { return scale_inv != nullptr; }

#ifdef __CUDACC__
  // W[row, col] as f32.
  __device__ __forceinline__ float at(int64_t row, int64_t col) const {
    if (scale_inv) {
      const auto* q = static_cast<const __nv_fp8_e4m3*>(data);
      const int64_t k_blocks = (k + block_k - 1) / block_k;
      return static_cast<float>(q[row * k + col]) * scale_inv[(row / block_n) * k_blocks + col / block_k];
    }
    return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[row * k + col]);
  }
#endif
};

}  // namespace nucleus::kernels
