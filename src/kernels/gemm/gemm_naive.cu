#include "kernels/common/cuda_common.cuh"
#include "kernels/gemm/gemm_naive.cuh"

namespace nucleus::kernels {

namespace {
template <typename Out>
__global__ void gemm_naive_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, WeightView w, int64_t m,
                                  Out* __restrict__ out, int64_t out_stride, bool accumulate) {
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= m * w.n) return;
  const int64_t r = warp / w.n, c = warp % w.n;
  const __nv_bfloat16* xr = x + r * x_stride;
  float acc = 0.0f;
  for (int64_t i = lane; i < w.k; i += 32) acc += __bfloat162float(xr[i]) * w.at(c, i);
  acc = cuda_common::warp_sum(acc);
  if (lane == 0) {
    Out* o = out + r * out_stride + c;
    float v = accumulate ? static_cast<float>(*o) + acc : acc;
    *o = static_cast<Out>(v);
  }
}
}  // namespace

cudaError_t launch_gemm_naive(const __nv_bfloat16* x, int64_t x_stride, const WeightView& w, int64_t m, void* out,
                              DType out_dtype, int64_t out_stride, bool accumulate, cudaStream_t stream) {
  const int64_t warps = m * w.n;
  if (warps == 0) return cudaSuccess;
  const unsigned blocks = cuda_common::ceil_div(warps * 32, 256);
  if (out_dtype == DType::kF32) {
    gemm_naive_kernel<float><<<blocks, 256, 0, stream>>>(x, x_stride, w, m, static_cast<float*>(out), out_stride,
                                                         accumulate);
  } else {
    gemm_naive_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(x, x_stride, w, m,
                                                                 static_cast<__nv_bfloat16*>(out), out_stride,
                                                                 accumulate);
  }
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
