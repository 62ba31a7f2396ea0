// CUDA RMSNorm kernels (f32 math): y = x * rsqrt(mean(x^2) + eps) * w.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

// residual[r, :] += f32(delta[r, :]) (skipped when delta is null), then
// out[r, :] = bf16(rmsnorm(residual[r, :]) * w).
//   residual: [rows, width] f32 (in/out); delta: [rows, width] bf16 or null;
//   w: [width] f32; out: [rows, width] bf16. Stream-async, graph-safe.
cudaError_t launch_add_rmsnorm(float* residual, const __nv_bfloat16* delta, const float* w, int64_t rows,
                               int64_t width, float eps, __nv_bfloat16* out, cudaStream_t stream);

// In place on the first `width` columns of each row of x ([rows, row_stride] bf16).
cudaError_t launch_rmsnorm_inplace(__nv_bfloat16* x, int64_t row_stride, const float* w, int64_t rows,
                                   int64_t width, float eps, cudaStream_t stream);

}  // namespace nucleus::kernels
