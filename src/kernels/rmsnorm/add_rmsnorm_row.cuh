// One row of the residual add + RMSNorm, shared by the plain add+norm kernel
// (rmsnorm.cu) and the fused all-reduce + add + norm kernel
// (allreduce/allreduce_rmsnorm.cu):
//
//   residual[i] = residual[i] + delta(i)       (delta: the one delta, or the ranks' sum)
//   out[i]      = bf16(residual[i] * rsqrt(mean(residual^2) + eps) * w[i])
//
// Thread t of the 256-thread block handles columns t, t + 256, ... and the
// sum of squares is reduced over the block in one fixed order, so both
// kernels run the same arithmetic: a one-rank fused all-reduce gives the
// plain kernel's bits (gpu_tp_test checks it on the whole model). The MoE
// combine that runs the add + norm after it (kernels/moe/moe_grouped.cu)
// runs normalize_row, the second half, on values it loaded itself.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/cuda_common.cuh"

namespace nucleus::kernels::add_norm_row {

constexpr int kThreads = 256;                             // the block size of both kernels
constexpr int64_t kMaxWidth = 8192;
constexpr int kMaxPerThread = kMaxWidth / kThreads;       // 32

// The second half of a row: v[j] holds residual + delta of column
// threadIdx.x + j * kThreads and ss this thread's sum of their squares (in j
// order); reduces ss over the block, then writes res[i] = v (unless res is
// null) and out[i] = bf16(v * rsqrt(mean + eps) * w_at(j, i)). Every thread of
// the block must call this.
template <typename WAt>
__device__ __forceinline__ void normalize_row(const float (&v)[kMaxPerThread], float ss, WAt w_at, int64_t width,
                                              float eps, float* res, __nv_bfloat16* out, float* scratch) {
  ss = cuda_common::block_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(width) + eps);
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (i < width) {
      if (res) res[i] = v[j];
      out[i] = __float2bfloat16(v[j] * inv * w_at(j, i));
    }
  }
}

// Row `res` [width] f32 (in/out), w [width] f32, out [width] bf16; width <=
// kMaxWidth. delta_at(i) gives the f32 delta of column i when has_delta;
// without it the residual is read, not written. scratch: 32 floats of
// shared memory. Every thread of the block must call this.
template <typename DeltaAt>
__device__ __forceinline__ void add_rmsnorm_row(float* res, bool has_delta, DeltaAt delta_at, const float* w,
                                                int64_t width, float eps, __nv_bfloat16* out, float* scratch) {
  float v[kMaxPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    v[j] = 0.0f;
    if (i < width) {
      float x = res[i];
      if (has_delta) x += delta_at(i);
      v[j] = x;
      ss += x * x;
    }
  }
  normalize_row(v, ss, [&](int, int64_t i) { return w[i]; }, width, eps, has_delta ? res : nullptr, out, scratch);
}

// The prezero fill both kernels run on their spare blocks: blocks
// [rows, gridDim.x) zero dst[0, count), grid-stride over them (float4 stores
// when dst is 16-byte aligned). Rows is the caller's block-count type (int or
// int64_t; the index arithmetic follows it, so each kernel keeps its code).
template <typename Rows>
__device__ inline void zero_fill_blocks(float* __restrict__ dst, int64_t count, Rows rows) {
  const int64_t fill_block = blockIdx.x - rows;
  const int64_t stride = (gridDim.x - rows) * static_cast<int64_t>(blockDim.x);
  const int64_t first = fill_block * blockDim.x + threadIdx.x;
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    const int64_t n4 = count / 4;
    float4* d4 = reinterpret_cast<float4*>(dst);
    for (int64_t i = first; i < n4; i += stride) d4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int64_t i = n4 * 4 + first; i < count; i += stride) dst[i] = 0.0f;
  } else {
    for (int64_t i = first; i < count; i += stride) dst[i] = 0.0f;
  }
}

}  // namespace nucleus::kernels::add_norm_row
