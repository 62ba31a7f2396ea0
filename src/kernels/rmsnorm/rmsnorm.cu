#include "kernels/common/cuda_common.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"

namespace nucleus::kernels {

namespace {
using cuda_common::block_sum;

constexpr int kThreads = 256;

// One block per row. The row is read once into registers-by-stride (width <=
// kThreads * kMaxPerThread), normalised, and written.
constexpr int kMaxPerThread = 32;  // width up to 8192

__global__ void add_rmsnorm_kernel(float* __restrict__ residual, const __nv_bfloat16* __restrict__ delta,
                                   const float* __restrict__ w, int64_t width, float eps,
                                   __nv_bfloat16* __restrict__ out) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  float* res = residual + r * width;
  float v[kMaxPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    v[j] = 0.0f;
    if (i < width) {
      float x = res[i];
      if (delta) x += __bfloat162float(delta[r * width + i]);
      v[j] = x;
      ss += x * x;
    }
  }
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(width) + eps);
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (i < width) {
      if (delta) res[i] = v[j];
      out[r * width + i] = __float2bfloat16(v[j] * inv * w[i]);
    }
  }
}

__global__ void rmsnorm_inplace_kernel(__nv_bfloat16* __restrict__ x, int64_t row_stride,
                                       const float* __restrict__ w, int64_t width, float eps) {
  __shared__ float scratch[32];
  __nv_bfloat16* row = x + static_cast<int64_t>(blockIdx.x) * row_stride;
  float v[kMaxPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    v[j] = i < width ? __bfloat162float(row[i]) : 0.0f;
    ss += v[j] * v[j];
  }
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(width) + eps);
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (i < width) row[i] = __float2bfloat16(v[j] * inv * w[i]);
  }
}
}  // namespace

cudaError_t launch_add_rmsnorm(float* residual, const __nv_bfloat16* delta, const float* w, int64_t rows,
                               int64_t width, float eps, __nv_bfloat16* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (width > kThreads * kMaxPerThread) return cudaErrorInvalidValue;
  add_rmsnorm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(residual, delta, w, width, eps, out);
  return cudaGetLastError();
}

cudaError_t launch_rmsnorm_inplace(__nv_bfloat16* x, int64_t row_stride, const float* w, int64_t rows,
                                   int64_t width, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (width > kThreads * kMaxPerThread) return cudaErrorInvalidValue;
  rmsnorm_inplace_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, row_stride, w, width, eps);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
