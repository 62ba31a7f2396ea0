// The end of the skinny decode GEMMs that give each warp R weight rows and
// one K slice (skinny_gemm.cu; the stream scheme of skinny_fp8_gemm.cu): each
// lane holds partial sums acc[r][mi] (weight row r of the warp, x row mi) of
// its k; the S warps of a row group (adjacent warps, S K slices) are added in
// slice order, so results do not depend on timing (no atomics, no zeroing,
// bit-identical across runs). Only for .cu files.
#pragma once

#include <cuda_runtime.h>

namespace nucleus::kernels::skinny_epilogue {

// The warp's sums over its lanes (a butterfly): lane j < R * M returns sum j
// (row j / M, x row j % M); the other lanes return 0. Warp-collective.
template <int R, int M>
__device__ __forceinline__ float warp_sums(const float (&acc)[R][M], int lane) {
  float mine = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
      float v = acc[r][mi];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == r * M + mi) mine = v;
    }
  return mine;
}

// Stores a CTA's sums (mine: warp_sums of the calling lane) through
// store(row, mi, v) for rows < n and x rows < m. The CTA is W warps = (W / S)
// row groups of S adjacent warps; first_row: the CTA's first weight row
// (blockIdx.x * (W / S) * R). S == 1: each lane j < R * M stores its sum;
// otherwise the slices are added in shared memory (red) in slice order, after
// a __syncthreads (every thread of the CTA must call it).
template <int R, int M, int W, typename Store>
__device__ __forceinline__ void store_sums(float mine, int S, int n, int m, int first_row, float (&red)[W][R * M],
                                           Store store) {
  constexpr int kOuts = R * M;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (S == 1) {
    const int row = first_row + warp * R + lane / M, mi = lane % M;
    if (lane < kOuts && row < n && mi < m) store(row, mi, mine);
    return;
  }
  if (lane < kOuts) red[warp][lane] = mine;
  __syncthreads();
  const int t = threadIdx.x;
  if (t < (W / S) * kOuts) {
    const int g = t / kOuts, j = t % kOuts;
    float v = 0.0f;
    for (int s = 0; s < S; ++s) v += red[g * S + s][j];
    const int row = first_row + g * R + j / M, mi = j % M;
    if (row < n && mi < m) store(row, mi, v);
  }
}

}  // namespace nucleus::kernels::skinny_epilogue
