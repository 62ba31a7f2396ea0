#include "kernels/common/cuda_common.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/rmsnorm/add_rmsnorm_row.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"

namespace nucleus::kernels {

namespace {
using cuda_common::block_sum;

constexpr int kThreads = 256;

// One block per row. The row is read once into registers-by-stride (width <=
// kThreads * kMaxPerThread), normalised, and written.
constexpr int kMaxPerThread = 32;  // width up to 8192
static_assert(kThreads == add_norm_row::kThreads && kMaxPerThread == add_norm_row::kMaxPerThread);

__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

template <typename Delta>
__global__ void add_rmsnorm_kernel(float* __restrict__ residual, const Delta* __restrict__ delta,
                                   const float* __restrict__ w, int64_t rows, int64_t width, float eps,
                                   __nv_bfloat16* __restrict__ out, float* __restrict__ zero_fill,
                                   int64_t zero_fill_count) {
  pdl::launch_dependents();  // a skinny GEMM after the norm may start streaming its weights
  pdl::wait_for_inputs();    // launched as a dependent: the kernel before has finished
  if (blockIdx.x >= rows) {  // a prezero fill block
    add_norm_row::zero_fill_blocks(zero_fill, zero_fill_count, rows);
    return;
  }
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  // add_rmsnorm_row.cuh: the fused all-reduce kernel's row code too.
  add_norm_row::add_rmsnorm_row(
      residual + r * width, delta != nullptr, [&](int64_t i) { return to_f32(delta[r * width + i]); }, w, width, eps,
      out + r * width, scratch);
}

// Normalises the first `width` columns of row blockIdx.x of x into out and
// converts columns [width, row_width) (none when x and out alias: in place).
template <typename In>
__global__ void rmsnorm_kernel(const In* x, int64_t x_stride, const float* __restrict__ w, int64_t width,
                               int64_t row_width, float eps, __nv_bfloat16* out, int64_t out_stride) {
  pdl::launch_dependents();  // a skinny GEMM after the norm may start streaming its weights
  pdl::wait_for_inputs();    // launched as a dependent: the kernel before has finished
  __shared__ float scratch[32];
  const In* row = x + static_cast<int64_t>(blockIdx.x) * x_stride;
  __nv_bfloat16* orow = out + static_cast<int64_t>(blockIdx.x) * out_stride;
  float v[kMaxPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    v[j] = i < width ? to_f32(row[i]) : 0.0f;
    ss += v[j] * v[j];
  }
  ss = block_sum(ss, scratch);  // every read of the row's first `width` columns precedes every write below
  const float inv = rsqrtf(ss / static_cast<float>(width) + eps);
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (i < width) orow[i] = __float2bfloat16(v[j] * inv * w[i]);
  }
  for (int64_t i = width + threadIdx.x; i < row_width; i += kThreads) orow[i] = __float2bfloat16(to_f32(row[i]));
}
}  // namespace

cudaError_t launch_add_rmsnorm(const AddRmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.width > kThreads * kMaxPerThread) return cudaErrorInvalidValue;
  const bool fill = p.zero_fill != nullptr && p.zero_fill_count > 0;
  if (fill && p.fill_blocks < 1) return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>(p.rows + (fill ? p.fill_blocks : 0));
  const int64_t fill_count = fill ? p.zero_fill_count : 0;
  const cudaError_t e =
      p.delta_f32
          ? pdl::launch(add_rmsnorm_kernel<float>, grid, kThreads, 0, p.pdl, stream, p.residual,
                        static_cast<const float*>(p.delta), p.w, p.rows, p.width, p.eps, p.out, p.zero_fill, fill_count)
          : pdl::launch(add_rmsnorm_kernel<__nv_bfloat16>, grid, kThreads, 0, p.pdl, stream, p.residual,
                        static_cast<const __nv_bfloat16*>(p.delta), p.w, p.rows, p.width, p.eps, p.out, p.zero_fill,
                        fill_count);
  return e != cudaSuccess ? e : cudaGetLastError();
}

cudaError_t launch_add_rmsnorm(float* residual, const __nv_bfloat16* delta, const float* w, int64_t rows,
                               int64_t width, float eps, __nv_bfloat16* out, cudaStream_t stream) {
  AddRmsNormParams p;
  p.residual = residual;
  p.delta = delta;
  p.w = w;
  p.rows = rows;
  p.width = width;
  p.eps = eps;
  p.out = out;
  return launch_add_rmsnorm(p, stream);
}

cudaError_t launch_rmsnorm_inplace(__nv_bfloat16* x, int64_t row_stride, const float* w, int64_t rows,
                                   int64_t width, float eps, cudaStream_t stream, bool dependent) {
  if (rows == 0) return cudaSuccess;
  if (width > kThreads * kMaxPerThread) return cudaErrorInvalidValue;
  const cudaError_t e = pdl::launch(rmsnorm_kernel<__nv_bfloat16>, rows, kThreads, 0, dependent, stream,
                                    static_cast<const __nv_bfloat16*>(x), row_stride, w, width, width, eps, x,
                                    row_stride);
  return e != cudaSuccess ? e : cudaGetLastError();
}

cudaError_t launch_rmsnorm_f32_to_bf16(const float* x, int64_t x_stride, const float* w, int64_t rows, int64_t width,
                                       int64_t row_width, float eps, __nv_bfloat16* out, int64_t out_stride,
                                       cudaStream_t stream, bool dependent) {
  if (rows == 0) return cudaSuccess;
  if (width > kThreads * kMaxPerThread || row_width < width) return cudaErrorInvalidValue;
  const cudaError_t e = pdl::launch(rmsnorm_kernel<float>, rows, kThreads, 0, dependent, stream, x, x_stride, w, width,
                                    row_width, eps, out, out_stride);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace nucleus::kernels
