// Device helpers of the FP8 GEMM kernels: e4m3 -> bf16 conversion in
// registers, the bf16 tensor-core MMA, and output stores. Only for .cu files.
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

// d += a * b, m16n8k16, bf16 inputs, f32 accumulators (PTX fragment layouts:
// a: rows g / g+8, k pairs 2t / 2t+8; b: k pairs 2t / 2t+8, column g;
// d: rows g / g+8, columns 2t, 2t+1; g = lane / 4, t = lane % 4).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
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
