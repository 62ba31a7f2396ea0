// Small device helpers shared by the kernels: warp/block reductions and
// bf16 <-> f32 vector access.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

namespace nucleus::kernels::cuda_common {

// Runs `f` (returning cudaError_t) once per CUDA device for this call site --
// the calling thread's current device -- and returns what it returned there.
// For per-device set-up such as cudaFuncSetAttribute: a function's attributes
// belong to one device's context, so with one thread per GPU (tensor
// parallelism) a process-wide `static` would set them on the first device
// only. Each lambda type is its own call site (its own statics).
template <typename F>
cudaError_t once_per_device(F f) {
  constexpr int kMaxDevices = 64;
  static std::once_flag flags[kMaxDevices];
  static cudaError_t results[kMaxDevices];
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (dev < 0 || dev >= kMaxDevices) return f();
  std::call_once(flags[dev], [&] { results[dev] = f(); });
  return results[dev];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). Every
// thread gets the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int num_warps = (blockDim.x + 31) >> 5;
  v = lane < num_warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

inline unsigned ceil_div(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// lo, hi -> bf16x2 (lo in the low half, as the MMA fragments and memory
// order want it), each rounded to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 8 bf16 (16 bytes) -> 8 f32: a bf16 is the high half of its f32.
__device__ __forceinline__ void bf16x8_to_f32(const uint4& v, float (&f)[8]) {
  f[0] = __uint_as_float(v.x << 16);
  f[1] = __uint_as_float(v.x & 0xffff0000u);
  f[2] = __uint_as_float(v.y << 16);
  f[3] = __uint_as_float(v.y & 0xffff0000u);
  f[4] = __uint_as_float(v.z << 16);
  f[5] = __uint_as_float(v.z & 0xffff0000u);
  f[6] = __uint_as_float(v.w << 16);
  f[7] = __uint_as_float(v.w & 0xffff0000u);
}

}  // namespace nucleus::kernels::cuda_common
