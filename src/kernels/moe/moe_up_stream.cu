// The UP GEMM of one-token MoE steps with FP8 gate_up weights in the FP8
// stream scheme (MoeGroupedOptions::up_stream, NUCLEUS_MOE_UP_STREAM;
// interface: moe_grouped.cuh, launch_up_stream).
//
// Work split. blockIdx.y is pair p (expert e = pair_experts[p]); a CTA is
// 8 warps = (8 / S) row groups x S K slices. Row group i of the pair holds
// the weight rows {gate 2i, gate 2i + 1, up 2i, up 2i + 1} (gate_up rows 2i,
// 2i + 1, inter + 2i, inter + 2i + 1), so one group yields h[p, 2i] and
// h[p, 2i + 1]. Each warp runs fp8_stream::accumulate_rows over its slice of
// K (the gate pair and the up pair each read their own scale row); the
// slices are added in slice order (skinny_epilogue::store_sums) and
// h = silu(gate) * up is rounded to bf16 once, as the MMA path's epilogue
// does. No atomics: the same bits on every run.
#include <algorithm>
#include <cstdint>

#include "kernels/common/device_sms.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemm/skinny_epilogue.cuh"
#include "kernels/gemm/skinny_fp8_stream.cuh"
#include "kernels/gemm/skinny_gemm.cuh"
#include "kernels/moe/moe_grouped.cuh"

namespace nucleus::kernels::moe_grouped {

namespace {

using fp8_stream::kRows;
using fp8_stream::kWarps;

struct UpStreamParams {
  const __nv_bfloat16* x;       // [k] the step's token
  const ExpertView* experts;    // [num_experts]
  const int32_t* pair_experts;  // [pairs] the token's top-k ids
  int num_experts;
  int k, inter;
  int slices, chunks_per_slice;  // chunks_per_slice: a multiple of 32
  __nv_bfloat16* h;              // [pairs, inter]
};

__global__ void __launch_bounds__(kWarps * 32, 2) moe_up_stream_kernel(const UpStreamParams p) {
  __shared__ float red[kWarps][kRows];
  __shared__ float sums[kWarps * kRows];  // [row group of the CTA][gate 2i, gate 2i + 1, up 2i, up 2i + 1]
  // The expert ids come from the router just before: wait, then let the
  // dependent (DOWN) start streaming its weights.
  pdl::wait_for_inputs();
  pdl::launch_dependents();
  const int pair = blockIdx.y;
  const int expert = __ldcg(p.pair_experts + pair);
  if (expert < 0 || expert >= p.num_experts) return;  // an id out of range contributes nothing (DOWN skips it too)
  const WeightView w = p.experts[expert].gate_up;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = p.slices, groups_per_cta = kWarps / S;
  const int group = warp / S, slice = warp % S;
  const int j = 2 * (blockIdx.x * groups_per_cta + group);  // h columns j, j + 1
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  const int64_t k = p.k;
  const uint8_t* wrow[kRows] = {base + j * k, base + (j + 1) * k, base + (p.inter + j) * k,
                                base + (p.inter + j + 1) * k};
  const int kb_count = p.k / 128;
  // j is even and block_n a multiple of 128: rows j and j + 1 share a scale row.
  const float* srow[2] = {w.scale_inv + static_cast<int64_t>(j / w.block_n) * kb_count,
                          w.scale_inv + static_cast<int64_t>((p.inter + j) / w.block_n) * kb_count};
  const __nv_bfloat16* xrow[1] = {p.x};
  const int c_begin = slice * p.chunks_per_slice;
  const int c_end = min(p.k / fp8_stream::kChunk, c_begin + p.chunks_per_slice);

  float acc[kRows][1] = {{0.0f}, {0.0f}, {0.0f}, {0.0f}};
  fp8_stream::accumulate_rows<1, fp8_stream::kSteps, 2>(wrow, srow, xrow, c_begin, c_end, lane, true, acc);

  const float mine = skinny_epilogue::warp_sums(acc, lane);
  skinny_epilogue::store_sums<kRows, 1, kWarps>(mine, S, kWarps * kRows, 1, 0, red,
                                                [&](int row, int, float v) { sums[row] = v * fp8_stream::kUnscale; });
  __syncthreads();
  if (threadIdx.x < groups_per_cta) {
    const int g = threadIdx.x;
    const float g0 = sums[g * 4], g1 = sums[g * 4 + 1], u0 = sums[g * 4 + 2], u1 = sums[g * 4 + 3];
    const float h0 = g0 / (1.0f + __expf(-g0)) * u0, h1 = g1 / (1.0f + __expf(-g1)) * u1;
    const int col = 2 * (blockIdx.x * groups_per_cta + g);
    *reinterpret_cast<__nv_bfloat162*>(p.h + static_cast<int64_t>(pair) * p.inter + col) =
        __floats2bfloat162_rn(h0, h1);
  }
}

}  // namespace

int up_stream_slices(int64_t pairs, int64_t inter, int64_t k, int num_sms) {
  // The dense stream scheme's rule (skinny_fp8_stream_slices) over all the
  // pairs' rows at once: pairs x 2 x inter rows of k e4m3.
  return skinny_default_slices(1, pairs * 2 * inter, k / 2, num_sms);
}

cudaError_t launch_up_stream(const GemmArgs& a, cudaStream_t stream) {
  if (a.pair_experts == nullptr || a.num_pairs < 1 || a.k % 128 != 0 || a.n % 64 != 0)
    return cudaErrorInvalidValue;
  UpStreamParams p{};
  p.x = a.a;
  p.experts = a.experts;
  p.pair_experts = a.pair_experts;
  p.num_experts = a.num_experts;
  p.k = a.k;
  p.inter = a.n;
  p.slices = up_stream_slices(a.num_pairs, a.n, a.k, current_device_sms());
  const int chunks = a.k / fp8_stream::kChunk;
  p.chunks_per_slice = ((chunks + p.slices - 1) / p.slices + 31) / 32 * 32;
  p.h = a.c;
  // inter / 2 row groups a pair, kWarps / S of them a CTA (inter % 64 == 0: whole CTAs).
  const dim3 grid(static_cast<unsigned>(a.n / 2 / (kWarps / p.slices)), static_cast<unsigned>(a.num_pairs));
  return pdl::launch(moe_up_stream_kernel, grid, kWarps * 32, 0, a.pdl, stream, p);
}

}  // namespace nucleus::kernels::moe_grouped
