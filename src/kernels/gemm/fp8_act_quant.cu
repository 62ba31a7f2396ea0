// Dynamic per-1x128 activation quantization: one warp per (row, 128-column
// group), four columns per lane. See launch_fp8_act_quant in fp8_gemm.cuh.
#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/common/cuda_common.cuh"
#include "kernels/gemm/fp8_gemm.cuh"

namespace nucleus::kernels {

namespace {

constexpr int kWarpsPerBlock = 8;

// kVec: x rows and xq rows allow 8-byte / 4-byte vector access and k % 4 == 0.
template <bool kVec>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    fp8_act_quant_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, int64_t m, int64_t m_pad, int64_t k,
                         uint8_t* __restrict__ xq, int64_t xq_stride, float* __restrict__ scales,
                         int64_t scale_row_stride, int64_t scale_group_stride) {
  const int64_t groups = (k + kFp8Block - 1) / kFp8Block;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= m_pad * groups) return;
  const int lane = threadIdx.x & 31;
  const int64_t row = item / groups, group = item % groups;
  const int64_t c0 = group * kFp8Block + lane * 4;
  const __nv_bfloat16* xr = x + row * x_stride;

  float v[4];
  if (row >= m) {  // padding rows: zeros
    v[0] = v[1] = v[2] = v[3] = 0.0f;
  } else if (kVec) {
    if (c0 < k) {
      const uint2 raw = *reinterpret_cast<const uint2*>(xr + c0);
      const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
      const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
      v[0] = __low2float(p0);
      v[1] = __high2float(p0);
      v[2] = __low2float(p1);
      v[3] = __high2float(p1);
    } else {
      v[0] = v[1] = v[2] = v[3] = 0.0f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = c0 + i < k ? __bfloat162float(xr[c0 + i]) : 0.0f;
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = cuda_common::warp_max(amax);
  const float scale = amax / 448.0f;  // IEEE division (the CPU reference does the same)

  uint8_t q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    q[i] = scale > 0.0f ? static_cast<uint8_t>(__nv_cvt_float_to_fp8(v[i] / scale, __NV_SATFINITE, __NV_E4M3)) : 0;
  uint8_t* qr = xq + row * xq_stride;
  if (kVec) {
    if (c0 < k)
      *reinterpret_cast<uint32_t*>(qr + c0) = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<uint32_t>(q[3]) << 24);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (c0 + i < k) qr[c0 + i] = q[i];
  }
  if (lane == 0) scales[row * scale_row_stride + group * scale_group_stride] = scale;
}

}  // namespace

cudaError_t launch_fp8_act_quant(const __nv_bfloat16* x, int64_t x_stride, int64_t m, int64_t k, uint8_t* xq,
                                 int64_t xq_stride, float* scales, int64_t scale_row_stride,
                                 int64_t scale_group_stride, cudaStream_t stream, int64_t m_pad) {
  m_pad = std::max(m, m_pad);
  if (m_pad <= 0 || k <= 0) return cudaSuccess;
  const int64_t items = m_pad * ((k + kFp8Block - 1) / kFp8Block);
  const unsigned blocks = cuda_common::ceil_div(items, kWarpsPerBlock);
  const bool vec = k % 4 == 0 && x_stride % 4 == 0 && xq_stride % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(x) % 8 == 0 && reinterpret_cast<uintptr_t>(xq) % 4 == 0;
  if (vec) {
    fp8_act_quant_kernel<true><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(x, x_stride, m, m_pad, k, xq, xq_stride, scales,
                                                                           scale_row_stride, scale_group_stride);
  } else {
    fp8_act_quant_kernel<false><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(x, x_stride, m, m_pad, k, xq, xq_stride, scales,
                                                                            scale_row_stride, scale_group_stride);
  }
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
