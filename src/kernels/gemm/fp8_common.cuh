// Device helpers of the FP8 GEMM kernels: e4m3 -> bf16 conversion in
// registers, streamed loads and output stores (the bf16 tensor-core MMA is
// ptx::mma_m16n8k16_bf16 in kernels/common/ptx.cuh). Only for .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace nucleus::kernels::fp8_detail {

// Four e4m3 bytes w = [b3 b2 b1 b0] -> two bf16x2 words lo = {b0, b1},
// hi = {b2, b3} (lower element in the low half), exactly.
// Each byte s.eeee.mmm is moved to bf16 bits s.0000eeee.mmm0000: a bf16 whose
// value is the e4m3 value times 2^-120 (normals and subnormals alike, since
// both formats' subnormals scale the same way); one bf16x2 multiply by 2^120
// (exact, subnormal inputs included) restores it. Integer ops only, so the
// conversion stays off the slow conversion unit.
__device__ __forceinline__ void e4m3x4_to_bf16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t t0 = __byte_perm(w, 0u, 0x1404);  // [b1, 0, b0, 0]
  const uint32_t t1 = __byte_perm(w, 0u, 0x3424);  // [b3, 0, b2, 0]
  const uint32_t r0 = (t0 & 0x80008000u) | ((t0 >> 4) & 0x07f007f0u);
  const uint32_t r1 = (t1 & 0x80008000u) | ((t1 >> 4) & 0x07f007f0u);
  constexpr uint32_t k2p120 = 0x7B807B80u;  // bf16x2 {2^120, 2^120}
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(lo) : "r"(r0), "r"(k2p120));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(hi) : "r"(r1), "r"(k2p120));
}

// Zeroes a warp's accumulator fragments [row tiles][token tiles][4].
template <int R, int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[R][NT][4]) {
#pragma unroll
  for (int rt = 0; rt < R; ++rt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][j][i] = 0.0f;
}

// Copies the operand fields every GEMM's kernel parameters share (x,
// x_stride, w, out, out_stride, m, n, k; the sizes narrowed to int) from the
// launch arguments. Host side.
template <typename Params, typename Args>
inline void copy_gemm_operands(Params& p, const Args& a) {
  p.x = a.x;
  p.x_stride = a.x_stride;
  p.w = a.w;
  p.out = a.out;
  p.out_stride = a.out_stride;
  p.m = static_cast<int>(a.m);
  p.n = static_cast<int>(a.n);
  p.k = static_cast<int>(a.k);
}

// 16 bytes of weights, streamed: read-only, not kept in L1 (it holds x).
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <typename Out>
__device__ __forceinline__ float load_out(const Out* p);
template <>
__device__ __forceinline__ float load_out<float>(const float* p) {
  return *p;
}
template <>
__device__ __forceinline__ float load_out<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}

template <typename Out>
__device__ __forceinline__ Out to_out(float v);
template <>
__device__ __forceinline__ float to_out<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// out[i] = v, or out[i] += v (the add in f32, then one rounding).
template <typename Out>
__device__ __forceinline__ void store_out(Out* p, float v, bool accumulate) {
  if (accumulate) v += load_out<Out>(p);
  *p = to_out<Out>(v);
}

}  // namespace nucleus::kernels::fp8_detail
