// Grouped-GEMM MoE: token alignment (counts, prefix sums, scatter, m-tile
// work list), the weighted combine, and the host-side choice of the GEMM
// variant. The GEMMs themselves: moe_grouped_gemm.cuh.
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/device_sms.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemm/fp8_gemm.cuh"  // launch_fp8_act_quant (W8A8 steps)
#include "kernels/moe/moe_grouped.cuh"
#include "kernels/rmsnorm/add_rmsnorm_row.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"

namespace nucleus::kernels {

namespace {

constexpr int kAlignThreads = 1024;  // one thread per expert in the scans (num_experts <= 1024)
constexpr int kMaxWidth = 16384;     // hidden and inter (the K of the GEMMs)

int64_t max_tiles_for(int64_t pairs, int64_t num_experts, int bm) {
  return pairs / bm + std::min(pairs, num_experts);  // sum_e ceil(c_e / bm) <= floor(P / bm) + active experts
}

size_t align_up(size_t v) { return (v + 255) & ~static_cast<size_t>(255); }

// One CTA: count pairs per expert, exclusive sums of rows and of m-tiles,
// scatter pairs into expert-sorted order (order inside an expert unspecified),
// write the m-tile work list.
__global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(const int32_t* __restrict__ ids, int num_pairs, int num_experts, int bm, MoeGroupedWorkspace ws) {
  using Scan = cub::BlockScan<int, kAlignThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int cursor[kAlignThreads];    // counts, then the next free row of each expert
  __shared__ int row_off[kAlignThreads];   // first sorted row of each expert
  __shared__ int tile_off[kAlignThreads];  // first m-tile of each expert
  pdl::wait_for_inputs();  // topk_ids come from the router
  pdl::launch_dependents();
  const int tid = threadIdx.x;
  cursor[tid] = 0;
  __syncthreads();
  for (int p = tid; p < num_pairs; p += kAlignThreads) {
    const int e = ids[p];
    if (e >= 0 && e < num_experts) atomicAdd(&cursor[e], 1);
  }
  __syncthreads();
  const int count = cursor[tid];
  int rows_before, rows_total, tiles_before, tiles_total;
  Scan(scan_tmp).ExclusiveSum(count, rows_before, rows_total);
  __syncthreads();  // scan_tmp reused
  Scan(scan_tmp).ExclusiveSum((count + bm - 1) / bm, tiles_before, tiles_total);
  row_off[tid] = rows_before;
  tile_off[tid] = tiles_before;
  cursor[tid] = rows_before;
  if (tid < num_experts) ws.expert_offsets[tid] = rows_before;
  if (tid == 0) {
    ws.expert_offsets[num_experts] = rows_total;
    *ws.num_tiles = tiles_total;
  }
  __syncthreads();
  for (int p = tid; p < num_pairs; p += kAlignThreads) {
    const int e = ids[p];
    if (e >= 0 && e < num_experts) {
      const int pos = atomicAdd(&cursor[e], 1);
      ws.sorted_pairs[pos] = p;
      ws.pair_pos[p] = pos;
    } else {
      ws.pair_pos[p] = -1;
    }
  }
  for (int i = tid; i < tiles_total; i += kAlignThreads) {
    // The expert of tile i: the last e with tile_off[e] <= i (empty experts precede it).
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (tile_off[mid] <= i) lo = mid;
      else hi = mid - 1;
    }
    ws.tile_expert[i] = lo;
    ws.tile_row0[i] = row_off[lo] + (i - tile_off[lo]) * bm;
  }
}

// UP split-K, the sum: h[r, j] = silu(g) * u with g = sum_s partial[s, r, j]
// and u = sum_s partial[s, r, inter + j], splits in order (f32), for the
// step's sorted rows r < expert_offsets[num_experts] (align-free:
// expert_offsets null, r < partial_rows, the step's pairs). Two columns a thread.
// DOWN may start first (PDL): it reads nothing before its own wait but the
// work list, final once UP's wait returned (UP triggers after it), and
// streams its first weights while UP drains and this kernel sums.
__global__ void moe_up_finish_kernel(const float* __restrict__ partial, int k_splits, int partial_rows, int inter,
                                     const int32_t* __restrict__ expert_offsets, int num_experts,
                                     __nv_bfloat16* __restrict__ h) {
  pdl::launch_dependents();
  pdl::wait_for_inputs();  // the partial sums come from UP
  const int rows = expert_offsets ? expert_offsets[num_experts] : partial_rows;
  const int pairs_per_row = inter / 2;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<int64_t>(rows) * pairs_per_row) return;
  const int r = static_cast<int>(i / pairs_per_row), j = static_cast<int>(i % pairs_per_row) * 2;
  float2 g = make_float2(0.0f, 0.0f), u = make_float2(0.0f, 0.0f);
  for (int sp = 0; sp < k_splits; ++sp) {
    const float* row = partial + (static_cast<int64_t>(sp) * partial_rows + r) * (2 * inter);
    const float2 gs = *reinterpret_cast<const float2*>(row + j), us = *reinterpret_cast<const float2*>(row + inter + j);
    g.x += gs.x;
    g.y += gs.y;
    u.x += us.x;
    u.y += us.y;
  }
  const float h0 = g.x / (1.0f + __expf(-g.x)) * u.x, h1 = g.y / (1.0f + __expf(-g.y)) * u.y;
  *reinterpret_cast<__nv_bfloat162*>(h + static_cast<int64_t>(r) * inter + j) = __floats2bfloat162_rn(h0, h1);
}

// out[t, c..c+8) = sum_k w[t, k] * y[pair_pos[t, k], c..c+8), k in order, f32.
// Align-free (pair_pos null): pair p's row is p, and a pair whose id
// (ids[p]) is outside [0, num_experts) adds nothing.
// kPrefetch (MoeGroupedOptions::combine_prefetch): the positions and weights
// of up to kCombineChunk pairs are loaded first, then their rows (a row of a
// pair that adds nothing is read from row 0 and not used), then summed in k
// order: two rounds of loads a chunk instead of two a pair (the loop without
// it waits for pair k's row before it reads pair k + 1's position). The same
// sums in the same order, so the same bits.
constexpr int kCombineChunk = 8;
constexpr int kCombineNormMaxPairs = 64;  // top_k of moe_combine_add_rmsnorm_kernel (larger: two launches)

__device__ __forceinline__ void combine_add(float (&acc)[8], float w, const uint4& v) {
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(b[j]);
    acc[2 * j] += w * f.x;
    acc[2 * j + 1] += w * f.y;
  }
}

// acc = sum_k w[t, k] * y[row of pair (t, k), c..c+8), k in order (the
// combine of one token's 8 columns, moe_combine_kernel's body).
template <bool kPrefetch>
__device__ __forceinline__ void combine_columns(const __nv_bfloat16* __restrict__ y, const int32_t* __restrict__ pair_pos,
                                                const int32_t* __restrict__ ids, int num_experts,
                                                const float* __restrict__ weights, int64_t t, int c, int hidden,
                                                int top_k, float (&acc)[8]) {
  auto position = [&](int64_t p) {
    return pair_pos ? pair_pos[p] : (ids[p] >= 0 && ids[p] < num_experts ? static_cast<int>(p) : -1);
  };
  auto row = [&](int pos) { return *reinterpret_cast<const uint4*>(y + static_cast<int64_t>(pos) * hidden + c); };
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  if constexpr (kPrefetch) {
    for (int k0 = 0; k0 < top_k; k0 += kCombineChunk) {
      int pos[kCombineChunk];
      float w[kCombineChunk];
#pragma unroll
      for (int j = 0; j < kCombineChunk; ++j) {
        const int64_t p = t * top_k + k0 + j;
        pos[j] = k0 + j < top_k ? position(p) : -1;
        w[j] = k0 + j < top_k ? weights[p] : 0.0f;
      }
      uint4 v[kCombineChunk];
#pragma unroll
      for (int j = 0; j < kCombineChunk; ++j) v[j] = row(pos[j] < 0 ? 0 : pos[j]);
#pragma unroll
      for (int j = 0; j < kCombineChunk; ++j)
        if (pos[j] >= 0) combine_add(acc, w[j], v[j]);
    }
  } else {
    for (int k = 0; k < top_k; ++k) {
      const int64_t p = t * top_k + k;
      const int pos = position(p);
      if (pos < 0) continue;
      combine_add(acc, weights[p], row(pos));
    }
  }
}

__device__ __forceinline__ uint4 to_bf16x8(const float (&acc)[8]) {
  uint4 o;
  __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int j = 0; j < 4; ++j) ob[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  return o;
}

template <bool kPrefetch>
__global__ void moe_combine_kernel(const __nv_bfloat16* __restrict__ y, const int32_t* __restrict__ pair_pos,
                                   const int32_t* __restrict__ ids, int num_experts,
                                   const float* __restrict__ weights, int64_t num_tokens, int hidden, int top_k,
                                   __nv_bfloat16* __restrict__ out) {
  pdl::wait_for_inputs();  // y comes from DOWN
  pdl::launch_dependents();
  const int vecs = hidden / 8;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= num_tokens * vecs) return;
  const int64_t t = i / vecs;
  const int c = static_cast<int>(i % vecs) * 8;
  float acc[8];
  combine_columns<kPrefetch>(y, pair_pos, ids, num_experts, weights, t, c, hidden, top_k, acc);
  *reinterpret_cast<uint4*>(out + t * hidden + c) = to_bf16x8(acc);
}

// The combine and the residual add + RMSNorm after it (MoeCombineNorm), one
// block of add_norm_row::kThreads a token, the same bits as
// moe_combine_kernel followed by the add + norm kernel: the block sums its
// token's row as the combine does (k order, rounded to bf16 once, written to
// out), keeps it in shared memory and runs the norm kernel's arithmetic on it
// (add_norm_row::normalize_row, columns strided over the threads).
//
// What it reads besides y is final before it launches, so it loads that
// before its PDL wait, through L2: its launch means every CTA of DOWN passed
// its wait, so UP (or UP's split-K sum) had completed, so had the align and
// router kernels and the add + norm before the router (each waits before it
// triggers its dependent, or is waited for by one that does). That leaves
// one round of loads (y's rows) after the wait. The pairs' positions and
// weights are kept in shared memory (top_k <= kCombineNormMaxPairs).
// Blocks [num_tokens, gridDim.x) are a prezero donor's fill.
__global__ void __launch_bounds__(add_norm_row::kThreads)
    moe_combine_add_rmsnorm_kernel(const __nv_bfloat16* __restrict__ y, const int32_t* __restrict__ pair_pos,
                                   const int32_t* __restrict__ ids, int num_experts,
                                   const float* __restrict__ weights, int64_t num_tokens, int hidden, int top_k,
                                   __nv_bfloat16* __restrict__ out, MoeCombineNorm norm) {
  using add_norm_row::kMaxPerThread;
  using add_norm_row::kThreads;
  if (blockIdx.x >= num_tokens) {  // the fill's buffer was last read by GEMMs long finished, but keep the order
    pdl::wait_for_inputs();
    pdl::launch_dependents();
    add_norm_row::zero_fill_blocks(norm.zero_fill, norm.zero_fill_count, num_tokens);
    return;
  }
  __shared__ __align__(16) __nv_bfloat16 row[add_norm_row::kMaxWidth];
  __shared__ int s_pos[kCombineNormMaxPairs];
  __shared__ float s_w[kCombineNormMaxPairs];
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  // Before the wait: positions and weights, the residual row, the norm weights.
  if (threadIdx.x < top_k) {
    const int64_t p = t * top_k + threadIdx.x;
    const int32_t id = __ldcg(ids + p);
    s_pos[threadIdx.x] = pair_pos ? __ldcg(pair_pos + p) : (id >= 0 && id < num_experts ? static_cast<int>(p) : -1);
    s_w[threadIdx.x] = __ldcg(weights + p);
  }
  const float* res_row = norm.residual + t * hidden;
  float v[kMaxPerThread], w[kMaxPerThread];
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    v[j] = i < hidden ? __ldcg(res_row + i) : 0.0f;
    w[j] = i < hidden ? norm.w[i] : 0.0f;
  }
  pdl::wait_for_inputs();  // y comes from DOWN
  pdl::launch_dependents();
  __syncthreads();  // s_pos, s_w
  for (int c = threadIdx.x * 8; c < hidden; c += kThreads * 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k0 = 0; k0 < top_k; k0 += kCombineChunk) {  // the rows of 8 pairs in flight, summed in k order
      uint4 r[kCombineChunk];
#pragma unroll
      for (int j = 0; j < kCombineChunk; ++j) {
        const int pos = k0 + j < top_k ? s_pos[k0 + j] : -1;
        r[j] = *reinterpret_cast<const uint4*>(y + static_cast<int64_t>(pos < 0 ? 0 : pos) * hidden + c);
      }
#pragma unroll
      for (int j = 0; j < kCombineChunk; ++j)
        if (k0 + j < top_k && s_pos[k0 + j] >= 0) combine_add(acc, s_w[k0 + j], r[j]);
    }
    const uint4 o = to_bf16x8(acc);
    *reinterpret_cast<uint4*>(out + t * hidden + c) = o;
    *reinterpret_cast<uint4*>(row + c) = o;
  }
  __syncthreads();  // row
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (i < hidden) {
      v[j] += __bfloat162float(row[i]);
      ss += v[j] * v[j];
    }
  }
  add_norm_row::normalize_row(v, ss, [&](int j, int64_t) { return w[j]; }, hidden, norm.eps, norm.residual + t * hidden,
                              norm.normed + t * hidden, scratch);
}

using moe_grouped::GemmArgs;
using moe_grouped::launch_grouped_gemm_impl;

template <bool kUp>
cudaError_t launch_gemm(int bm, bool fp8, bool regs, const GemmArgs& a, int64_t max_tiles, cudaStream_t stream) {
  constexpr int kBnSmall = kUp ? 128 : 64;  // DOWN: narrower tiles for more CTAs at small batches
  switch (bm) {
    case 16:
      if (fp8 && regs && a.k % 128 == 0) return launch_grouped_gemm_impl<16, kBnSmall, true, kUp, true>(a, max_tiles, stream);
      return fp8 ? launch_grouped_gemm_impl<16, kBnSmall, true, kUp, false>(a, max_tiles, stream)
                 : launch_grouped_gemm_impl<16, kBnSmall, false, kUp, false>(a, max_tiles, stream);
    case 32:
      if (fp8 && regs && a.k % 128 == 0) return launch_grouped_gemm_impl<32, kBnSmall, true, kUp, true>(a, max_tiles, stream);
      return fp8 ? launch_grouped_gemm_impl<32, kBnSmall, true, kUp, false>(a, max_tiles, stream)
                 : launch_grouped_gemm_impl<32, kBnSmall, false, kUp, false>(a, max_tiles, stream);
    case 64:
      return fp8 ? launch_grouped_gemm_impl<64, 128, true, kUp, false>(a, max_tiles, stream)
                 : launch_grouped_gemm_impl<64, 128, false, kUp, false>(a, max_tiles, stream);
    case 128:
      return fp8 ? launch_grouped_gemm_impl<128, 128, true, kUp, false>(a, max_tiles, stream)
                 : launch_grouped_gemm_impl<128, 128, false, kUp, false>(a, max_tiles, stream);
    default:
      return cudaErrorInvalidValue;  // unsupported tile height
  }
}

int down_bn(int bm) { return bm <= 32 ? 64 : 128; }

}  // namespace

namespace {
// Rows of x a workspace for `max_pairs` pairs quantizes (W8A8 steps), and
// whether it carves the W8A8 buffers at all (FP8 gate_up in 128-wide K blocks).
int64_t w8a8_tokens(const MoeGroupedShape& s, int64_t max_pairs) {
  return s.gate_up_block_k == 128 ? (max_pairs + s.top_k - 1) / std::max<int64_t>(1, s.top_k) : 0;
}
}  // namespace

size_t moe_grouped_workspace_bytes(const MoeGroupedShape& s, int64_t max_pairs) {
  const int64_t tiles = max_tiles_for(max_pairs, s.num_experts, 16);
  const int64_t qt = w8a8_tokens(s, max_pairs), qp = qt > 0 ? max_pairs : 0;
  return align_up((s.num_experts + 1) * 4) + 2 * align_up(max_pairs * 4) + 2 * align_up(tiles * 4) + align_up(4) +
         align_up(max_pairs * s.inter * 2) + align_up(max_pairs * s.hidden * 2) +
         align_up(kMoeUpSplitRows * 2 * s.inter * 4) + align_up(qt * s.hidden) + align_up(qt * (s.hidden / 128) * 4) +
         align_up(qp * s.inter) + align_up(qp * ((s.inter + 127) / 128) * 4);
}

MoeGroupedWorkspace moe_grouped_workspace_carve(void* base, const MoeGroupedShape& s, int64_t max_pairs) {
  const int64_t tiles = max_tiles_for(max_pairs, s.num_experts, 16);
  char* p = static_cast<char*>(base);
  auto take = [&](size_t bytes) {
    char* r = p;
    p += align_up(bytes);
    return r;
  };
  MoeGroupedWorkspace ws;
  ws.expert_offsets = reinterpret_cast<int32_t*>(take((s.num_experts + 1) * 4));
  ws.sorted_pairs = reinterpret_cast<int32_t*>(take(max_pairs * 4));
  ws.pair_pos = reinterpret_cast<int32_t*>(take(max_pairs * 4));
  ws.tile_expert = reinterpret_cast<int32_t*>(take(tiles * 4));
  ws.tile_row0 = reinterpret_cast<int32_t*>(take(tiles * 4));
  ws.num_tiles = reinterpret_cast<int32_t*>(take(4));
  ws.h = reinterpret_cast<__nv_bfloat16*>(take(max_pairs * s.inter * 2));
  ws.y = reinterpret_cast<__nv_bfloat16*>(take(max_pairs * s.hidden * 2));
  ws.up_partial = reinterpret_cast<float*>(take(kMoeUpSplitRows * 2 * s.inter * 4));
  if (const int64_t qt = w8a8_tokens(s, max_pairs); qt > 0) {
    ws.x_fp8 = reinterpret_cast<uint8_t*>(take(qt * s.hidden));
    ws.x_scale = reinterpret_cast<float*>(take(qt * (s.hidden / 128) * 4));
    ws.h_fp8 = reinterpret_cast<uint8_t*>(take(max_pairs * s.inter));
    ws.h_scale = reinterpret_cast<float*>(take(max_pairs * ((s.inter + 127) / 128) * 4));
  }
  ws.max_pairs = max_pairs;
  return ws;
}

const char* moe_grouped_unsupported(const MoeGroupedShape& s, const WeightView& gate_up, const WeightView& down) {
  if (s.num_experts < 1 || s.num_experts > kAlignThreads) return "num_experts outside [1, 1024]";
  if (s.top_k < 1 || s.top_k > s.num_experts) return "top_k outside [1, num_experts]";
  if (s.hidden % 128 != 0) return "hidden_size not a multiple of 128";
  if (s.inter % 64 != 0) return "moe_intermediate_size not a multiple of 64";
  if (s.hidden > kMaxWidth || s.inter > kMaxWidth) return "hidden_size or moe_intermediate_size above 16384";
  if (gate_up.n != 2 * s.inter || gate_up.k != s.hidden) return "gate_up is not [2 * inter, hidden]";
  if (down.n != s.hidden || down.k != s.inter) return "down is not [hidden, inter]";
  for (const WeightView* w : {&gate_up, &down}) {
    if (!w->fp8()) continue;
    if (w->block_n <= 0 || w->block_n % 128 != 0) return "FP8 block_n not a multiple of 128";
    if (w->block_k <= 0 || w->block_k % 64 != 0) return "FP8 block_k not a multiple of 64";
    if ((w->k + w->block_k - 1) / w->block_k > moe_grouped::kMaxKBlocks) return "FP8 weight has over 128 K blocks";
  }
  return nullptr;
}

int moe_grouped_pick_bm(int64_t num_tokens, const MoeGroupedShape& s) {
  const int64_t pairs = num_tokens * s.top_k;
  if (pairs <= 0) return 16;
  // Expected rows per active expert (routing spread evenly): a tile height
  // that holds most experts in one m-tile keeps decode at one weight read.
  const double rows = static_cast<double>(pairs) / static_cast<double>(std::min(pairs, s.num_experts));
  if (rows <= 10) return 16;
  if (rows <= 24) return 32;
  if (rows <= 64) return 64;
  return 128;
}

bool moe_grouped_deep_ring(int64_t ctas, int64_t k_tiles, int num_sms) {
  return ctas <= 4 * static_cast<int64_t>(num_sms) && k_tiles >= 20;
}

int moe_grouped_up_splits(int64_t num_tokens, const MoeGroupedShape& s, int bm, int num_sms, bool bf16_weights) {
  const int64_t pairs = num_tokens * s.top_k;
  if (bm != 16 || pairs <= 0) return 1;
  const int64_t ctas = std::min(pairs, s.num_experts) * (s.inter / 64);  // expert column tiles at most
  const int64_t k_tiles = s.hidden / 128;                                 // of the register path's 128 k
  int splits = 1;
  while (splits < kMoeUpMaxSplits && ctas * splits < static_cast<int64_t>(num_sms) &&
         pairs * 2 * splits <= kMoeUpSplitRows && k_tiles >= 4 * 2 * splits)
    splits *= 2;
  // The deep ring's second wave (bf16): two splits on the 4-stage ring, all resident.
  const int64_t k_tiles64 = s.hidden / 64;
  if (splits == 1 && bf16_weights && ctas > num_sms && moe_grouped_deep_ring(ctas, k_tiles64, num_sms) &&
      !moe_grouped_deep_ring(2 * ctas, k_tiles64 / 2, num_sms) && 2 * ctas <= 3 * static_cast<int64_t>(num_sms) &&
      pairs * 2 * 2 <= kMoeUpSplitRows && k_tiles >= 4 * 2)
    splits = 2;
  return splits;
}

bool moe_grouped_w8a8(const MoeGroupedShape& s, int bm, bool gate_up_fp8, bool down_fp8,
                      const MoeGroupedOptions& opt) {
  const bool applies = bm == 128 && gate_up_fp8 && down_fp8 && s.gate_up_block_k == 128 && s.down_block_k == 128 &&
                       s.hidden % 128 == 0 && s.inter % 128 == 0;
  return applies && opt.fp8_w8a8 != 0 && opt.wgmma != 0;
}

bool moe_grouped_wgmma(const MoeGroupedShape& s, int bm, const MoeGroupedOptions& opt) {
  return bm == 128 && moe_grouped::wgmma_shape_ok(s.hidden, s.inter) && opt.wgmma != 0;
}

bool moe_grouped_up_stream(int64_t num_tokens, const MoeGroupedShape& s, int bm, bool gate_up_fp8,
                           const MoeGroupedOptions& opt) {
  const bool applies = opt.align_free && num_tokens == 1 && bm == 16 && gate_up_fp8 && s.gate_up_block_k == 128;
  return applies && opt.up_stream != 0;
}

cudaError_t launch_moe_grouped(const __nv_bfloat16* x, int64_t num_tokens, const int32_t* topk_ids,
                               const float* topk_weights, const MoeGroupedShape& s, const ExpertView* experts,
                               bool gate_up_fp8, bool down_fp8, const MoeGroupedWorkspace& ws, __nv_bfloat16* out,
                               cudaStream_t stream, const MoeGroupedOptions& opt, const MoeCombineNorm& norm) {
  if (num_tokens == 0) return cudaSuccess;
  if (norm.residual && (s.hidden > add_norm_row::kMaxWidth || (norm.zero_fill_count > 0 && norm.fill_blocks < 1)))
    return cudaErrorInvalidValue;
  const int64_t pairs = num_tokens * s.top_k;
  if (num_tokens < 0 || pairs > ws.max_pairs) return cudaErrorInvalidValue;
  if (pairs * std::max(s.hidden, s.inter) >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // 32-bit offsets
  const int bm = opt.force_bm ? opt.force_bm : moe_grouped_pick_bm(num_tokens, s);
  if (bm != 16 && bm != 32 && bm != 64 && bm != 128) return cudaErrorInvalidValue;
  const int64_t max_tiles = max_tiles_for(pairs, s.num_experts, bm);
  // One token: its top_k ids are distinct experts, so pair k can be m-tile k
  // (one row) without the align launch (GemmArgs::pair_experts).
  const bool align_free = opt.align_free && num_tokens == 1 && bm == 16;

  cudaError_t err = cudaSuccess;
  if (!align_free) {
    err = pdl::launch(moe_align_kernel, 1, kAlignThreads, 0, opt.pdl, stream, topk_ids, static_cast<int>(pairs),
                      static_cast<int>(s.num_experts), bm, ws);
    if (err != cudaSuccess) return err;
  }

  GemmArgs up;
  up.a = x;
  up.sorted_pairs = ws.sorted_pairs;
  up.top_k = static_cast<int>(s.top_k);
  up.experts = experts;
  up.expert_offsets = ws.expert_offsets;
  up.tile_expert = ws.tile_expert;
  up.tile_row0 = ws.tile_row0;
  up.num_tiles = ws.num_tiles;
  up.c = ws.h;
  up.k = static_cast<int>(s.hidden);
  up.n = static_cast<int>(s.inter);
  up.n_tiles = static_cast<int>(s.inter / 64);  // every UP tile holds 64 gate + 64 up rows
  up.num_experts = static_cast<int>(s.num_experts);
  up.pdl = opt.pdl;
  if (align_free) {
    up.pair_experts = topk_ids;
    up.num_pairs = static_cast<int>(pairs);
    up.sorted_pairs = up.expert_offsets = up.tile_expert = up.tile_row0 = up.num_tiles = nullptr;
  }
  int splits = opt.up_splits > 0 ? opt.up_splits
                                 : moe_grouped_up_splits(num_tokens, s, bm, current_device_sms(), !gate_up_fp8);
  // Forced counts stay within the workspace's partial rows and leave every split a k-tile.
  splits = static_cast<int>(std::clamp<int64_t>(splits, 1, std::min<int64_t>(kMoeUpMaxSplits, s.hidden / 128)));
  while (splits > 1 && pairs * splits > kMoeUpSplitRows) --splits;
  if (splits > 1) {
    up.k_splits = splits;
    up.partial = ws.up_partial;
    up.partial_rows = static_cast<int>(pairs);
  }
  // The deep ring (16-row bf16 tiles), per GEMM: by the rule, or forced.
  auto deep_ring = [&](int64_t ctas, int64_t k_tiles) {
    if (bm != 16 || opt.deep_ring == 0) return false;
    return opt.deep_ring > 0 || moe_grouped_deep_ring(ctas, k_tiles, current_device_sms());
  };
  up.deep_ring = !gate_up_fp8 && deep_ring(max_tiles * up.n_tiles * splits, s.hidden / 64 / splits);
  const bool up_stream = moe_grouped_up_stream(num_tokens, s, bm, gate_up_fp8, opt);
  const bool wgmma = moe_grouped_wgmma(s, bm, opt);
  const bool w8a8 = moe_grouped_w8a8(s, bm, gate_up_fp8, down_fp8, opt) && ws.x_fp8 != nullptr;
  if (up_stream) {
    splits = 1;
    up.k_splits = 1;
    up.partial = nullptr;
    err = moe_grouped::launch_up_stream(up, stream);
  } else if (w8a8 && splits == 1) {
    err = launch_fp8_act_quant(x, s.hidden, num_tokens, s.hidden, ws.x_fp8, s.hidden, ws.x_scale, s.hidden / 128, 1,
                               stream);
    if (err != cudaSuccess) return err;
    up.a_fp8 = ws.x_fp8;
    up.a_scale = ws.x_scale;
    err = moe_grouped::launch_grouped_wgmma_w8a8(true, up, max_tiles, stream);
  } else if (wgmma && splits == 1) {
    err = moe_grouped::launch_grouped_wgmma(gate_up_fp8, true, up, max_tiles, stream);
  } else {
    err = launch_gemm<true>(bm, gate_up_fp8, opt.fp8_register_dequant, up, max_tiles * splits, stream);
  }
  if (err != cudaSuccess) return err;
  if (splits > 1) {
    const int64_t threads = pairs * (s.inter / 2);
    err = pdl::launch(moe_up_finish_kernel, cuda_common::ceil_div(threads, 256), 256, 0, opt.pdl, stream,
                      ws.up_partial, splits, static_cast<int>(pairs), static_cast<int>(s.inter),
                      align_free ? nullptr : ws.expert_offsets, static_cast<int>(s.num_experts), ws.h);
    if (err != cudaSuccess) return err;
  }

  GemmArgs down = up;
  down.k_splits = 1;
  down.partial = nullptr;
  down.a = ws.h;
  down.sorted_pairs = nullptr;
  down.c = ws.y;
  down.k = static_cast<int>(s.inter);
  down.n = static_cast<int>(s.hidden);
  down.n_tiles = static_cast<int>(s.hidden / down_bn(bm));
  down.deep_ring = !down_fp8 && deep_ring(max_tiles * down.n_tiles, s.inter / 64);
  if (w8a8 && splits == 1) {
    // h (bf16, sorted rows) quantized per 1 x 128 block for DOWN.
    err = launch_fp8_act_quant(ws.h, s.inter, pairs, s.inter, ws.h_fp8, s.inter, ws.h_scale, (s.inter + 127) / 128, 1,
                               stream);
    if (err != cudaSuccess) return err;
    down.a_fp8 = ws.h_fp8;
    down.a_scale = ws.h_scale;
    err = moe_grouped::launch_grouped_wgmma_w8a8(false, down, max_tiles, stream);
  } else {
    err = wgmma ? moe_grouped::launch_grouped_wgmma(down_fp8, false, down, max_tiles, stream)
                : launch_gemm<false>(bm, down_fp8, opt.fp8_register_dequant, down, max_tiles, stream);
  }
  if (err != cudaSuccess) return err;

  const int32_t* pair_pos = align_free ? nullptr : ws.pair_pos;
  if (norm.residual && s.top_k <= kCombineNormMaxPairs) {
    const bool fill = norm.zero_fill != nullptr && norm.zero_fill_count > 0;
    const unsigned grid = static_cast<unsigned>(num_tokens + (fill ? norm.fill_blocks : 0));
    return pdl::launch(moe_combine_add_rmsnorm_kernel, grid, add_norm_row::kThreads, 0, opt.pdl, stream, ws.y,
                       pair_pos, topk_ids, static_cast<int>(s.num_experts), topk_weights, num_tokens,
                       static_cast<int>(s.hidden), static_cast<int>(s.top_k), out, norm);
  }
  const int64_t threads = num_tokens * (s.hidden / 8);
  err = pdl::launch(opt.combine_prefetch ? moe_combine_kernel<true> : moe_combine_kernel<false>,
                     cuda_common::ceil_div(threads, 256), 256, 0, opt.pdl, stream, ws.y, pair_pos, topk_ids,
                     static_cast<int>(s.num_experts), topk_weights, num_tokens, static_cast<int>(s.hidden),
                     static_cast<int>(s.top_k), out);
  if (err != cudaSuccess || !norm.residual) return err;
  // More pairs than the fused kernel keeps: the add + norm kernel after the combine.
  AddRmsNormParams p;
  p.residual = norm.residual;
  p.delta = out;
  p.w = norm.w;
  p.rows = num_tokens;
  p.width = s.hidden;
  p.eps = norm.eps;
  p.out = norm.normed;
  p.zero_fill = norm.zero_fill;
  p.zero_fill_count = norm.zero_fill_count;
  p.fill_blocks = norm.fill_blocks;
  p.pdl = opt.pdl;
  return launch_add_rmsnorm(p, stream);
}

}  // namespace nucleus::kernels
