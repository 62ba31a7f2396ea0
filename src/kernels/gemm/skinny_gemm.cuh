// Skinny bf16 GEMM for decode at batch 1..8 (the latency-bound regime):
//   out[m, n] = (accumulate ? out[m, n] : 0) + sum_k x[m, k] * W[n, k]
// with 1 <= m <= 8, bf16 x and W, f32 accumulation, bf16 or f32 out.
//
// At a handful of rows a GEMM does ~m FLOPs per weight byte, so its time is
// the weight's bytes over the bandwidth the kernel reaches; what matters is
// keeping enough weight bytes in flight on every SM. No tensor cores, no
// shared-memory staging of W, no atomics, no zeroing:
//  - a warp owns 4 weight rows (output columns) and one K slice; each lane
//    streams 16 bytes of each of the 4 rows per step (ld.global.nc with
//    L1::no_allocate) and keeps U steps in flight (U = 4 at m <= 2, else 2:
//    up to 256 bytes a lane), x read through L1 (it is small and every warp
//    of the SM reuses it);
//  - the products are f32 FMAs on registers (bf16 -> f32 is a shift);
//  - the 32 lanes' sums are added with shuffles; the S warps of a CTA that
//    share rows (S K slices, S in {1, 2, 4, 8}) add theirs in shared memory
//    in slice order, so results do not depend on timing (bit-identical
//    across runs);
//  - S is chosen so that about 12 warps per SM stream (grid of
//    ceil(n / (4 * 8 / S)) CTAs of 8 warps), each slice at least 256 K.
// PDL: the kernel signals griddepcontrol.launch_dependents at its start (a
// programmatic dependent launched after it may then fill SMs as its CTAs
// retire) and, launched with pdl, waits for its own predecessor only after its
// first weight loads.
// Bytes read: W once (n k 2), x once per SM from L2, out once (twice when
// accumulating).
//
// Framework-free: raw pointers, sizes and strides in elements, a stream; the
// launcher returns a cudaError_t. Stream-async and safe under CUDA-graph
// capture (nothing is allocated, nothing synchronises with the host).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

constexpr int64_t kSkinnyMaxRows = 8;  // largest m
constexpr int kSkinnyRowsPerWarp = 4;  // weight rows (output columns) a warp owns
constexpr int kSkinnyWarps = 8;        // warps per CTA

struct SkinnyGemmArgs {
  const __nv_bfloat16* x = nullptr;  // [m, k] bf16, row stride x_stride; 16-byte aligned rows
  int64_t x_stride = 0;
  const __nv_bfloat16* w = nullptr;  // [n, k] bf16, contiguous, 16-byte aligned
  void* out = nullptr;               // [m, n] bf16 or f32 (out_f32), row stride out_stride
  int64_t out_stride = 0;
  bool out_f32 = false;
  int64_t m = 0, n = 0, k = 0;
  bool accumulate = false;  // out += x W^T instead of out = x W^T
  int slices = 0;           // K slices per row group (1, 2, 4 or 8); 0: skinny_default_slices
  // Launch as a programmatic dependent (PDL) of the previous kernel on the
  // stream: the CTAs may start while it finishes and stream their first
  // weights before waiting for it (griddepcontrol.wait) to read x or touch out.
  bool pdl = false;
};

// cudaSuccess when the kernel takes `a`: 1 <= m <= 8, n >= 1, k >= 8 and
// k % 8 == 0, x_stride % 8 == 0 and >= k, out_stride >= n, x and w 16-byte
// aligned, out non-null, n and k below 2^31, slices 0, 1, 2, 4 or 8;
// cudaErrorInvalidValue otherwise.
cudaError_t skinny_gemm_check(const SkinnyGemmArgs& a);

// The slice count for slices = 0: the S in {1, 2, 4, 8} whose warp count
// ceil(n / 4) * S is nearest to ~11.7 warps per SM (1,540 on 132 SMs), ties
// to the larger S, each slice at least k / S >= 256 deep. Derived from the
// slice sweep of bench/skinny_gemm_bench.cpp on the H200 (docs/perf.md
// "Skinny decode GEMMs"): the best S per shape kept 1,150-2,050 warps busy.
int skinny_default_slices(int64_t m, int64_t n, int64_t k, int num_sms);

// Runs the GEMM on `stream`. Errors: cudaErrorInvalidValue for what
// skinny_gemm_check refuses; launch errors.
cudaError_t launch_skinny_gemm(const SkinnyGemmArgs& a, cudaStream_t stream);

}  // namespace nucleus::kernels
