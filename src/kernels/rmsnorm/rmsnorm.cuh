// CUDA RMSNorm kernels (f32 math): y = x * rsqrt(mean(x^2) + eps) * w.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

// The fused residual add + RMSNorm, optionally the prezero donor:
//   residual[r, :] += f32(delta[r, :])   (skipped when delta is null)
//   out[r, :] = bf16(rmsnorm(residual[r, :]) * w)
//   zero_fill[0 .. zero_fill_count) = 0  (prezero: the consumers' f32 outputs)
// The norm takes one 256-thread block per row; the fill runs on fill_blocks
// more blocks of the same launch (decode has few rows, so those blocks land
// on SMs the norm leaves idle), 16-byte stores when zero_fill is 16-byte
// aligned.
struct AddRmsNormParams {
  float* residual = nullptr;     // [rows, width] f32, in/out
  const void* delta = nullptr;   // [rows, width] bf16, or f32 when delta_f32; null: no add
  bool delta_f32 = false;
  const float* w = nullptr;      // [width] f32
  int64_t rows = 0, width = 0;   // width <= 8192
  float eps = 1e-6f;
  __nv_bfloat16* out = nullptr;  // [rows, width] bf16
  float* zero_fill = nullptr;    // [zero_fill_count] f32, or null
  int64_t zero_fill_count = 0;
  int fill_blocks = 0;           // blocks for the fill (>= 1 when zero_fill_count > 0)
  // Launch as a programmatic dependent (PDL, kernels/common/pdl.cuh) of the
  // kernel before it: scheduled early, it waits for that kernel before it
  // reads or writes anything.
  bool pdl = false;
};
// Stream-async, graph-safe. cudaErrorInvalidValue for width > 8192 or a fill
// without fill blocks.
cudaError_t launch_add_rmsnorm(const AddRmsNormParams& p, cudaStream_t stream);

// The plain form: residual += delta (bf16, or null), out = bf16(rmsnorm(residual) * w).
cudaError_t launch_add_rmsnorm(float* residual, const __nv_bfloat16* delta, const float* w, int64_t rows,
                               int64_t width, float eps, __nv_bfloat16* out, cudaStream_t stream);

// In place on the first `width` columns of each row of x ([rows, row_stride] bf16).
// dependent: launched as a programmatic dependent, as AddRmsNormParams::pdl.
cudaError_t launch_rmsnorm_inplace(__nv_bfloat16* x, int64_t row_stride, const float* w, int64_t rows,
                                   int64_t width, float eps, cudaStream_t stream, bool dependent = false);

// Out of place, reading f32 (a split-K GEMM's output) and writing bf16:
//   out[r, :width] = bf16(rmsnorm(x[r, :width]) * w),
//   out[r, width:row_width] = bf16(x[r, width:row_width])   (carried columns, e.g. k_pe)
// x: [rows, x_stride] f32; out: [rows, out_stride] bf16; w: [width] f32.
// Stream-async, graph-safe; width <= 8192. dependent: as AddRmsNormParams::pdl.
cudaError_t launch_rmsnorm_f32_to_bf16(const float* x, int64_t x_stride, const float* w, int64_t rows, int64_t width,
                                       int64_t row_width, float eps, __nv_bfloat16* out, int64_t out_stride,
                                       cudaStream_t stream, bool dependent = false);

}  // namespace nucleus::kernels
