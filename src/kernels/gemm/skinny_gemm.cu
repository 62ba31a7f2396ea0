// Skinny bf16 GEMM for decode (interface and scheme: skinny_gemm.cuh).
//
// Work split. A CTA is 8 warps = (8 / S) row groups x S K slices; warp w owns
// rows [row0, row0 + 4) of W with row0 = (blockIdx.x * 8 / S + w / S) * 4 and
// the K chunks (8 k each) [s * cps, (s + 1) * cps) of slice s = w % S, cps a
// multiple of 32. Lane l takes chunks begin + l, begin + l + 32, ...: each
// load instruction of the warp reads 512 contiguous bytes of a row.
// Rows past n read row n - 1 and x rows past m read row m - 1 (valid memory,
// no predicated loads); their sums are never stored.
#include <algorithm>
#include <cstdint>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/device_sms.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/gemm/skinny_epilogue.cuh"
#include "kernels/gemm/skinny_gemm.cuh"

namespace nucleus::kernels {

namespace {

using cuda_common::bf16x8_to_f32;
using fp8_detail::ld_stream_v4;
using fp8_detail::store_out;

constexpr int kThreads = kSkinnyWarps * 32;
constexpr int kRW = kSkinnyRowsPerWarp;

struct Params {
  const __nv_bfloat16* x;
  int64_t x_stride;
  const __nv_bfloat16* w;
  void* out;
  int64_t out_stride;
  int m, n, k;
  int slices;            // S
  int chunks_per_slice;  // a multiple of 32
  bool accumulate;
  bool out_f32;
};

__device__ __forceinline__ void store(const Params& p, int row, int mi, float v) {
  const int64_t at = static_cast<int64_t>(mi) * p.out_stride + row;
  if (p.out_f32)
    store_out(static_cast<float*>(p.out) + at, v, p.accumulate);
  else
    store_out(static_cast<__nv_bfloat16*>(p.out) + at, v, p.accumulate);
}

// M: x rows the instance computes (m <= M); U: load steps in flight per lane.
template <int M, int U>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(const Params p) {
  constexpr int kOuts = kRW * M;  // sums a warp produces (<= 32)
  __shared__ float red[kSkinnyWarps][kOuts];
  pdl::launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = p.slices;
  const int groups_per_cta = kSkinnyWarps / S;
  const int group = warp / S, slice = warp % S;
  const int row0 = (blockIdx.x * groups_per_cta + group) * kRW;
  const int c_begin = slice * p.chunks_per_slice;
  const int c_end = min(p.k >> 3, c_begin + p.chunks_per_slice);

  const __nv_bfloat16* wrow[kRW];
#pragma unroll
  for (int r = 0; r < kRW; ++r) wrow[r] = p.w + static_cast<int64_t>(min(row0 + r, p.n - 1)) * p.k;
  const __nv_bfloat16* xrow[M];
#pragma unroll
  for (int mi = 0; mi < M; ++mi) xrow[mi] = p.x + static_cast<int64_t>(min(mi, p.m - 1)) * p.x_stride;

  float acc[kRW][M];
#pragma unroll
  for (int r = 0; r < kRW; ++r)
#pragma unroll
    for (int mi = 0; mi < M; ++mi) acc[r][mi] = 0.0f;

  bool waited = false;
  for (int c0 = c_begin + lane; c0 < c_end; c0 += 32 * U) {
    // Every weight load of the U steps first, then the math.
    uint4 wv[U][kRW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < kRW; ++r) wv[u][r] = c < c_end ? ld_stream_v4(wrow[r] + c * 8) : make_uint4(0, 0, 0, 0);
    }
    // The weights do not depend on the previous kernel; x does (PDL: the
    // first weight loads are in flight while it finishes).
    if (!waited) {
      pdl::wait_for_inputs();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= c_end) break;
      float wf[kRW][8];
#pragma unroll
      for (int r = 0; r < kRW; ++r) bf16x8_to_f32(wv[u][r], wf[r]);
#pragma unroll
      for (int mi = 0; mi < M; ++mi) {
        float xf[8];
        bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(xrow[mi] + c * 8)), xf);
#pragma unroll
        for (int r = 0; r < kRW; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][mi] = fmaf(wf[r][e], xf[e], acc[r][mi]);
      }
    }
  }

  pdl::wait_for_inputs();  // before any output access (a lane with no K steps has not waited)

  const float mine = skinny_epilogue::warp_sums(acc, lane);
  skinny_epilogue::store_sums<kRW, M, kSkinnyWarps>(mine, S, p.n, p.m, blockIdx.x * groups_per_cta * kRW, red,
                                                    [&](int row, int mi, float v) { store(p, row, mi, v); });
}

int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <int M>
cudaError_t launch_m(const Params& p, bool pdl_on, cudaStream_t stream) {
  constexpr int U = M <= 2 ? 4 : 2;
  const int64_t groups = ceil_div64(p.n, kRW);
  return pdl::launch(skinny_gemm_kernel<M, U>, ceil_div64(groups, kSkinnyWarps / p.slices), kThreads, 0, pdl_on,
                     stream, p);
}

}  // namespace

cudaError_t skinny_gemm_check(const SkinnyGemmArgs& a) {
  const bool slices_ok = a.slices == 0 || a.slices == 1 || a.slices == 2 || a.slices == 4 || a.slices == 8;
  const bool ok = a.m >= 1 && a.m <= kSkinnyMaxRows && a.n >= 1 && a.k >= 8 && a.k % 8 == 0 &&
                  a.x_stride % 8 == 0 && a.x_stride >= a.k && a.out_stride >= a.n &&
                  reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.w) % 16 == 0 &&
                  a.out != nullptr && a.n < (int64_t{1} << 31) && a.k < (int64_t{1} << 31) && slices_ok;
  return ok ? cudaSuccess : cudaErrorInvalidValue;
}

int skinny_default_slices(int64_t m, int64_t n, int64_t k, int num_sms) {
  (void)m;
  const int64_t groups = ceil_div64(n, kRW);
  const int64_t chunks = k / 8;
  const int64_t target = int64_t{35} * num_sms / 3;  // ~11.7 warps per SM: 1540 on 132 SMs
  int best = 1;
  int64_t best_gap = INT64_MAX;
  for (int s = 1; s <= kSkinnyWarps && (s == 1 || chunks / s >= 32); s *= 2) {
    const int64_t gap = groups * s > target ? groups * s - target : target - groups * s;
    if (gap <= best_gap) best = s, best_gap = gap;  // ties to the larger count
  }
  return best;
}

cudaError_t launch_skinny_gemm(const SkinnyGemmArgs& a, cudaStream_t stream) {
  if (cudaError_t e = skinny_gemm_check(a); e != cudaSuccess) return e;
  Params p{};
  fp8_detail::copy_gemm_operands(p, a);
  p.slices = a.slices > 0 ? a.slices : skinny_default_slices(a.m, a.n, a.k, current_device_sms());
  const int64_t chunks = a.k / 8;
  p.chunks_per_slice = static_cast<int>(ceil_div64(ceil_div64(chunks, p.slices), 32) * 32);
  p.accumulate = a.accumulate;
  p.out_f32 = a.out_f32;
  if (a.m == 1) return launch_m<1>(p, a.pdl, stream);
  if (a.m == 2) return launch_m<2>(p, a.pdl, stream);
  if (a.m <= 4) return launch_m<4>(p, a.pdl, stream);
  return launch_m<8>(p, a.pdl, stream);
}

}  // namespace nucleus::kernels
