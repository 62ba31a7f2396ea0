// CPU reference RMSNorm, optionally fused with the residual add that precedes
// it. y = x * rsqrt(mean(x^2) + eps) * w, computed in f32 (DeepSeek RMSNorm,
// which casts to f32 before normalising).
#pragma once

#include <cstdint>

namespace nucleus::kernels {

// out[r, :] = rmsnorm(x[r, :]) * w
//   x:   [num_rows, width] f32, row stride x_stride
//   w:   [width] f32
//   out: [num_rows, width] f32, row stride out_stride (may alias x)
void rmsnorm_ref(const float* x, int64_t x_stride, const float* w, int64_t num_rows, int64_t width, float eps,
                 float* out, int64_t out_stride);

// residual[r, :] += delta[r, :] (skipped when delta is null), then
// out[r, :] = rmsnorm(residual[r, :]) * w. All [num_rows, width] f32,
// contiguous.
void add_rmsnorm_ref(float* residual, const float* delta, const float* w, int64_t num_rows, int64_t width,
                     float eps, float* out);

}  // namespace nucleus::kernels
