// The store of a GEMM computed into an f32 scratch at a padded height (the
// cuBLASLt FP8 path when m is not a multiple of 4): copy or add its first m
// rows into the output. See launch_fp8_store_rows in fp8_gemm.cuh.
#include "kernels/common/cuda_common.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/gemm/fp8_gemm.cuh"

namespace nucleus::kernels {

namespace {

template <typename Out>
__global__ void fp8_store_rows_kernel(const float* __restrict__ y, int64_t m, int64_t n, Out* __restrict__ out,
                                      int64_t out_stride, bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  const int64_t r = i / n, c = i % n;
  fp8_detail::store_out<Out>(out + r * out_stride + c, y[i], accumulate);
}

}  // namespace

cudaError_t launch_fp8_store_rows(const float* y, int64_t m, int64_t n, void* out, DType out_dtype,
                                  int64_t out_stride, bool accumulate, cudaStream_t stream) {
  if (m <= 0 || n <= 0) return cudaSuccess;
  const unsigned blocks = cuda_common::ceil_div(m * n, 256);
  if (out_dtype == DType::kF32) {
    fp8_store_rows_kernel<float><<<blocks, 256, 0, stream>>>(y, m, n, static_cast<float*>(out), out_stride,
                                                             accumulate);
  } else if (out_dtype == DType::kBF16) {
    fp8_store_rows_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(y, m, n, static_cast<__nv_bfloat16*>(out),
                                                                     out_stride, accumulate);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
