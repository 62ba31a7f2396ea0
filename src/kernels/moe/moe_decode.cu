// Fused routed-expert MoE decode (interface and scheme: moe_decode.cuh).
//
// Up kernel work split. grid.x = U * tiles, U = min(pairs, num_experts):
// CTA b takes the (b / tiles)-th activated expert (in increasing id; CTAs
// past the step's count exit) and column tile b % tiles. A CTA is 8 warps =
// (8 / S) column groups x S K slices; group g owns the intermediate columns
// j0 = (tile * 8 / S + g) * 2 and j0 + 1, i.e. gate_up rows j0, j0 + 1,
// inter + j0, inter + j0 + 1 (rows past inter read row inter - 1; never
// stored). The expert's pairs run MR at a time (MR >= the step's tokens, so
// one pass unless an expert is chosen twice by one token).
//
// Down kernel work split. grid.x = min(ceil(hidden / 16), SMs) CTAs of 8
// warps (one CTA per SM at its register count); warp w of CTA b owns the
// column pairs ("tasks") b + w * grid, then + 8 * grid, ...: columns
// n0 = 2 * task and n0 + 1 for every token; lane r * 16 + t holds the running
// sum of (column n0 + r, token t).
//
// In both, lane l takes the 16-byte chunks begin + l, begin + l + 32, ...:
// each load instruction of a warp reads 512 contiguous bytes of one row.
#include <algorithm>
#include <cstdint>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/device_sms.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/gemm/skinny_gemm.cuh"
#include "kernels/moe/moe_decode.cuh"

namespace nucleus::kernels {

namespace {

using cuda_common::bf16x8_to_f32;
using fp8_detail::ld_stream_v4;

constexpr int kThreads = 256;                  // routing sort: one thread per pair
constexpr int kUpWarps = kThreads / 32;        // 8
constexpr int kDownWarps = kThreads / 32;      // 8
constexpr int kDownCols = 2;                   // output columns per down warp
constexpr int kMaxT = static_cast<int>(kMoeDecodeMaxTokens);
constexpr int kMaxPairs = static_cast<int>(kMoeDecodeMaxPairs);
static_assert(kDownCols * kMaxT == 32, "down: one lane per (column, token)");
static_assert(kMaxPairs <= kThreads, "routing sort: one thread per pair");

struct Params {
  const __nv_bfloat16* x;
  const int32_t* ids;
  const float* weights;
  const ExpertView* experts;
  float* h;
  __nv_bfloat16* out;
  int T, top_k, pairs, E, hidden, inter;
  int slices;            // up: S
  int tiles;             // up: column tiles per expert
  int chunks_per_slice;  // up: 16-byte chunks of a gate_up row per slice, a multiple of 32
  int down_ctas;         // down: CTAs (at most one per SM; each warp takes column pairs in turn)
};

// The step's routing, sorted by expert: the activated experts in increasing id
// (slot u holds expert[u]) and the pairs of slot u at sorted[offset[u] ..
// offset[u + 1]) in increasing pair index.
struct Routing {
  int32_t ids[kMaxPairs];        // valid id or -1
  uint32_t bits[kMoeDecodeMaxExperts / 32];
  int32_t word_prefix[kMoeDecodeMaxExperts / 32];
  int32_t expert[kMaxPairs];
  int32_t count[kMaxPairs];
  int32_t offset[kMaxPairs + 1];
  int32_t sorted[kMaxPairs];
  int32_t num_experts;  // activated
};

// Fills `r` from topk_ids (read through L2: in the down kernel it is read
// before griddepcontrol.wait). Every thread of the CTA (kThreads) calls it.
__device__ void sort_routing(Routing& r, const Params& p) {
  const int tid = threadIdx.x;
  constexpr int kWords = kMoeDecodeMaxExperts / 32;
  if (tid < kWords) r.bits[tid] = 0;
  r.count[tid] = 0;
  int id = -1;
  if (tid < p.pairs) {
    id = __ldcg(p.ids + tid);
    if (id < 0 || id >= p.E) id = -1;
  }
  r.ids[tid] = id;
  __syncthreads();
  if (id >= 0) atomicOr(&r.bits[id >> 5], 1u << (id & 31));
  __syncthreads();
  if (tid < 32) {  // kWords == 32: one word a lane; inclusive scan of the popcounts
    const int c = __popc(r.bits[tid]);
    int inc = c;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inc, off);
      if (tid >= off) inc += v;
    }
    r.word_prefix[tid] = inc - c;
    if (tid == 31) r.num_experts = inc;
  }
  __syncthreads();
  int slot = -1;
  if (id >= 0) {
    slot = r.word_prefix[id >> 5] + __popc(r.bits[id >> 5] & ((1u << (id & 31)) - 1u));
    r.expert[slot] = id;  // same value from every pair of the expert
    atomicAdd(&r.count[slot], 1);
  }
  __syncthreads();
  if (tid < 32) {  // exclusive scan of the 256 counts, 8 a lane
    constexpr int kPer = kMaxPairs / 32;
    int local[kPer], sum = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      local[i] = sum;
      sum += r.count[tid * kPer + i];
    }
    int inc = sum;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inc, off);
      if (tid >= off) inc += v;
    }
    const int base = inc - sum;
#pragma unroll
    for (int i = 0; i < kPer; ++i) r.offset[tid * kPer + i] = base + local[i];
    if (tid == 31) r.offset[kMaxPairs] = inc;
  }
  __syncthreads();
  if (id >= 0) {
    int before = 0;
    for (int j = 0; j < tid; ++j) before += r.ids[j] == id;
    r.sorted[r.offset[slot] + before] = tid;
  }
  __syncthreads();
}

__device__ __forceinline__ void bf16x8_to_f32_at(const uint4& v, float* f) {
  float (&a)[8] = *reinterpret_cast<float(*)[8]>(f);
  bf16x8_to_f32(v, a);
}

// One 16-byte weight chunk -> f32: 8 bf16, or 16 e4m3 (unscaled; exact, through
// bf16: fp8_detail::e4m3x4_to_bf16x4).
template <bool kFp8>
__device__ __forceinline__ void chunk_to_f32(const uint4& v, float* f) {
  if constexpr (kFp8) {
    uint4 a, b;
    fp8_detail::e4m3x4_to_bf16x4(v.x, a.x, a.y);
    fp8_detail::e4m3x4_to_bf16x4(v.y, a.z, a.w);
    fp8_detail::e4m3x4_to_bf16x4(v.z, b.x, b.y);
    fp8_detail::e4m3x4_to_bf16x4(v.w, b.z, b.w);
    bf16x8_to_f32_at(a, f);
    bf16x8_to_f32_at(b, f + 8);
  } else {
    bf16x8_to_f32_at(v, f);
  }
}

// Where row `row` of an FP8 weight keeps its block scales (k blocks along the row).
__device__ __forceinline__ const float* scale_row(const WeightView& w, int row) {
  const int k_blocks = static_cast<int>((w.k + w.block_k - 1) / w.block_k);
  return w.scale_inv + static_cast<int64_t>(row / w.block_n) * k_blocks;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// kFp8: gate_up is e4m3 with block scales; MR: pairs of an expert per pass
// (>= T); U: load steps in flight per lane.
template <bool kFp8, int MR, int U>
__global__ void __launch_bounds__(kThreads) moe_decode_up_kernel(const Params p) {
  constexpr int kRows = 4;              // gate j0, gate j0 + 1, up j0, up j0 + 1
  constexpr int kE = kFp8 ? 16 : 8;     // weight elements per 16-byte chunk
  __shared__ Routing rt;
  __shared__ float red[kUpWarps][kRows * MR];
  pdl::wait_for_inputs();    // x and topk_ids come from the kernels before
  pdl::launch_dependents();  // the down kernel may now read topk_ids
  sort_routing(rt, p);
  const int u = blockIdx.x / p.tiles, tile = blockIdx.x % p.tiles;
  if (u >= rt.num_experts) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = p.slices, groups = kUpWarps / S;
  const int group = warp / S, slice = warp % S;
  const int j0 = (tile * groups + group) * 2;
  const int first = rt.offset[u], count = rt.offset[u + 1] - first;
  const WeightView& view = p.experts[rt.expert[u]].gate_up;
  const auto* w = static_cast<const uint8_t*>(view.data);
  const uint8_t* wrow[kRows];
  const float* srow[kRows];
  int block_k = 1;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = (r >= 2 ? p.inter : 0) + min(j0 + (r & 1), p.inter - 1);
    wrow[r] = w + static_cast<int64_t>(row) * p.hidden * (kFp8 ? 1 : 2);
    if constexpr (kFp8) srow[r] = scale_row(view, row);
  }
  if constexpr (kFp8) block_k = view.block_k;
  const int c_begin = slice * p.chunks_per_slice;
  const int c_end = min(p.hidden / kE, c_begin + p.chunks_per_slice);

  for (int g0 = 0; g0 < count; g0 += MR) {
    const int m = min(MR, count - g0);
    int xoff[MR];
#pragma unroll
    for (int mi = 0; mi < MR; ++mi) xoff[mi] = rt.sorted[first + g0 + min(mi, m - 1)] / p.top_k * p.hidden;
    float acc[kRows][MR];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int mi = 0; mi < MR; ++mi) acc[r][mi] = 0.0f;

    for (int c0 = c_begin + lane; c0 < c_end; c0 += 32 * U) {
      uint4 wv[U][kRows];
#pragma unroll
      for (int s = 0; s < U; ++s) {
        const int c = c0 + 32 * s;
#pragma unroll
        for (int r = 0; r < kRows; ++r) wv[s][r] = c < c_end ? ld_stream_v4(wrow[r] + c * 16) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int s = 0; s < U; ++s) {
        const int c = c0 + 32 * s;
        if (c >= c_end) break;
        float wf[kRows][kE], sc[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          chunk_to_f32<kFp8>(wv[s][r], wf[r]);
          if constexpr (kFp8) sc[r] = __ldg(srow[r] + c * kE / block_k);
        }
#pragma unroll
        for (int mi = 0; mi < MR; ++mi) {
          if (mi >= m) break;
          float xf[kE];
#pragma unroll
          for (int q = 0; q < kE / 8; ++q)
            bf16x8_to_f32_at(__ldg(reinterpret_cast<const uint4*>(p.x + xoff[mi] + c * kE + q * 8)), xf + q * 8);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if constexpr (kFp8) {  // the chunk lies in one scale block: scale its dot product
              float d = 0.0f;
#pragma unroll
              for (int e = 0; e < kE; ++e) d = fmaf(wf[r][e], xf[e], d);
              acc[r][mi] = fmaf(d, sc[r], acc[r][mi]);
            } else {
#pragma unroll
              for (int e = 0; e < kE; ++e) acc[r][mi] = fmaf(wf[r][e], xf[e], acc[r][mi]);
            }
          }
        }
      }
    }

#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int mi = 0; mi < MR; ++mi) {
        const float v = warp_sum(acc[r][mi]);
        if (lane == 0) red[warp][r * MR + mi] = v;
      }
    __syncthreads();
    // Slices of a group added in slice order; then h = silu(gate) * up.
    const int t = threadIdx.x;
    if (t < groups * 2 * MR) {
      const int g = t / (2 * MR), col = (t / MR) % 2, mi = t % MR;
      float gate = 0.0f, up = 0.0f;
      for (int s = 0; s < S; ++s) {
        gate += red[g * S + s][col * MR + mi];
        up += red[g * S + s][(2 + col) * MR + mi];
      }
      const int j = (tile * groups + g) * 2 + col;
      if (j < p.inter && mi < m) {
        const int pair = rt.sorted[first + g0 + mi];
        p.h[static_cast<int64_t>(pair) * p.inter + j] = gate / (1.0f + expf(-gate)) * up;
      }
    }
    __syncthreads();  // red is reused by the next pass
  }
}

// kFp8: down is e4m3 with block scales; MR: pairs of an expert per pass
// (>= T); U: load steps in flight per lane.
template <bool kFp8, int MR, int U>
__global__ void __launch_bounds__(kThreads, 1) moe_decode_down_kernel(const Params p) {
  constexpr int kE = kFp8 ? 16 : 8;  // weight elements per 16-byte chunk
  __shared__ Routing rt;
  pdl::launch_dependents();
  sort_routing(rt, p);  // topk_ids: complete once the up kernel let this one start
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Column pairs ("tasks") spread over the warps of every CTA in turn, so that
  // each SM gets the same share whatever hidden / 16 is against the SM count.
  const int tasks = (p.hidden + kDownCols - 1) / kDownCols;
  const int task0 = blockIdx.x + warp * gridDim.x, stride = gridDim.x * kDownWarps;
  int n0 = min(task0, tasks - 1) * kDownCols;
  const int chunks = p.inter / kE;
  const int experts = rt.num_experts;
  auto row_of = [&](int slot, int r) {
    const auto* w = static_cast<const uint8_t*>(p.experts[rt.expert[slot]].down.data);
    return w + static_cast<int64_t>(min(n0 + r, p.hidden - 1)) * p.inter * (kFp8 ? 1 : 2);
  };
  auto prefetch_expert = [&](int slot) {
#pragma unroll
    for (int r = 0; r < kDownCols; ++r) {
      const uint8_t* row = row_of(slot, r);
#pragma unroll
      for (int s = 0; s < U; ++s)
        if (lane + 32 * s < chunks) prefetch_l2(row + (lane + 32 * s) * 16);
    }
  };
  if (experts > 0 && task0 < tasks) prefetch_expert(0);
  pdl::wait_for_inputs();  // h comes from the up kernel

  for (int task = task0; task < tasks; task += stride) {
    n0 = task * kDownCols;
    if (task != task0 && experts > 0) prefetch_expert(0);
    float mine = 0.0f;  // column n0 + lane / 16, token lane % 16
    for (int u = 0; u < experts; ++u) {
      if (u + 1 < experts) prefetch_expert(u + 1);
      const uint8_t* wrow[kDownCols];
      const float* srow[kDownCols];
      int block_k = 1;
#pragma unroll
      for (int r = 0; r < kDownCols; ++r) {
        wrow[r] = row_of(u, r);
        if constexpr (kFp8) srow[r] = scale_row(p.experts[rt.expert[u]].down, min(n0 + r, p.hidden - 1));
      }
      if constexpr (kFp8) block_k = p.experts[rt.expert[u]].down.block_k;
      const int first = rt.offset[u], count = rt.offset[u + 1] - first;
      for (int g0 = 0; g0 < count; g0 += MR) {
        const int m = min(MR, count - g0);
        const float* hrow[MR];
#pragma unroll
        for (int mi = 0; mi < MR; ++mi)
          hrow[mi] = p.h + static_cast<int64_t>(rt.sorted[first + g0 + min(mi, m - 1)]) * p.inter;
        float acc[kDownCols][MR];
#pragma unroll
        for (int r = 0; r < kDownCols; ++r)
#pragma unroll
          for (int mi = 0; mi < MR; ++mi) acc[r][mi] = 0.0f;
        for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
          uint4 wv[U][kDownCols];
#pragma unroll
          for (int s = 0; s < U; ++s) {
            const int c = c0 + 32 * s;
#pragma unroll
            for (int r = 0; r < kDownCols; ++r)
              wv[s][r] = c < chunks ? ld_stream_v4(wrow[r] + c * 16) : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int s = 0; s < U; ++s) {
            const int c = c0 + 32 * s;
            if (c >= chunks) break;
            float wf[kDownCols][kE], sc[kDownCols];
#pragma unroll
            for (int r = 0; r < kDownCols; ++r) {
              chunk_to_f32<kFp8>(wv[s][r], wf[r]);
              if constexpr (kFp8) sc[r] = __ldg(srow[r] + c * kE / block_k);
            }
#pragma unroll
            for (int mi = 0; mi < MR; ++mi) {
              if (mi >= m) break;
              float hf[kE];
#pragma unroll
              for (int q = 0; q < kE / 4; ++q) {
                const float4 v = __ldg(reinterpret_cast<const float4*>(hrow[mi] + c * kE + q * 4));
                hf[4 * q] = v.x, hf[4 * q + 1] = v.y, hf[4 * q + 2] = v.z, hf[4 * q + 3] = v.w;
              }
#pragma unroll
              for (int r = 0; r < kDownCols; ++r) {
                if constexpr (kFp8) {
                  float d = 0.0f;
#pragma unroll
                  for (int e = 0; e < kE; ++e) d = fmaf(wf[r][e], hf[e], d);
                  acc[r][mi] = fmaf(d, sc[r], acc[r][mi]);
                } else {
#pragma unroll
                  for (int e = 0; e < kE; ++e) acc[r][mi] = fmaf(wf[r][e], hf[e], acc[r][mi]);
                }
              }
            }
          }
        }
        // y[pair, n] for the pass's pairs; the lane owning (n, token) adds
        // w * y (in pair order: the reference's order within an expert).
#pragma unroll
        for (int mi = 0; mi < MR; ++mi) {
          if (mi >= m) break;
          const int pair = rt.sorted[first + g0 + mi];
          const int token = pair / p.top_k;
          const float wgt = __ldcg(p.weights + pair);
#pragma unroll
          for (int r = 0; r < kDownCols; ++r) {
            const float y = warp_sum(acc[r][mi]);
            if (lane == r * kMaxT + token) mine = fmaf(wgt, y, mine);
          }
        }
      }
    }
    const int n = n0 + lane / kMaxT, token = lane % kMaxT;
    if (n < p.hidden && token < p.T) p.out[static_cast<int64_t>(token) * p.hidden + n] = __float2bfloat16(mine);
  }
}

int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <bool kUpFp8, bool kDownFp8, int MR>
cudaError_t launch_mr(const Params& p, bool pdl_on, cudaStream_t stream) {
  constexpr int kUpU = MR <= 2 ? 4 : 2;
  constexpr int kDownU = MR <= 4 ? 8 : 4;
  const int64_t activated_max = std::min<int64_t>(p.pairs, p.E);
  cudaError_t e =
      pdl::launch(moe_decode_up_kernel<kUpFp8, MR, kUpU>, activated_max * p.tiles, kThreads, 0, pdl_on, stream, p);
  if (e != cudaSuccess) return e;
  return pdl::launch(moe_decode_down_kernel<kDownFp8, MR, kDownU>, p.down_ctas, kThreads, 0, pdl_on, stream, p);
}

template <bool kUpFp8, bool kDownFp8>
cudaError_t launch_types(const Params& p, bool pdl, cudaStream_t stream) {
  if (p.T == 1) return launch_mr<kUpFp8, kDownFp8, 1>(p, pdl, stream);
  if (p.T == 2) return launch_mr<kUpFp8, kDownFp8, 2>(p, pdl, stream);
  if (p.T <= 4) return launch_mr<kUpFp8, kDownFp8, 4>(p, pdl, stream);
  if (p.T <= 8) return launch_mr<kUpFp8, kDownFp8, 8>(p, pdl, stream);
  return launch_mr<kUpFp8, kDownFp8, 16>(p, pdl, stream);
}

}  // namespace

const char* moe_decode_unsupported(int64_t hidden, int64_t inter, int64_t num_experts, int64_t top_k,
                                   const WeightView& gate_up, const WeightView& down) {
  if (hidden % 8 != 0 || hidden < 8 || hidden >= (int64_t{1} << 24))
    return "hidden_size not a positive multiple of 8 below 2^24 (16-byte rows)";
  if (inter % 8 != 0 || inter < 8 || inter >= (int64_t{1} << 24))
    return "moe_intermediate_size not a positive multiple of 8 below 2^24 (16-byte rows)";
  if (gate_up.fp8() && hidden % 16 != 0) return "FP8 gate_up with hidden_size not a multiple of 16 (16-byte rows)";
  if (down.fp8() && inter % 16 != 0) return "FP8 down with moe_intermediate_size not a multiple of 16 (16-byte rows)";
  for (const WeightView* w : {&gate_up, &down})
    if (w->fp8() && (w->block_n < 1 || w->block_k < 16 || w->block_k % 16 != 0))
      return "FP8 expert weights whose scale blocks are not block_n >= 1 by block_k a multiple of 16";
  if (num_experts < 1 || num_experts > kMoeDecodeMaxExperts) return "more than 1024 routed experts";
  if (top_k < 1 || top_k > 16) return "num_experts_per_tok outside 1..16";
  if (gate_up.n != 2 * inter || gate_up.k != hidden || down.n != hidden || down.k != inter)
    return "expert weight shapes are not gate_up [2 inter, hidden] and down [hidden, inter]";
  if (reinterpret_cast<uintptr_t>(gate_up.data) % 16 != 0 || reinterpret_cast<uintptr_t>(down.data) % 16 != 0)
    return "expert weights not 16-byte aligned";
  return nullptr;
}

size_t moe_decode_scratch_bytes(int64_t max_tokens, int64_t top_k, int64_t inter) {
  const int64_t t = std::clamp<int64_t>(max_tokens, 0, kMoeDecodeMaxTokens);
  return static_cast<size_t>(t * top_k * inter) * sizeof(float);
}

cudaError_t moe_decode_check(const MoeDecodeArgs& a) {
  const bool slices_ok = a.up_slices == 0 || a.up_slices == 1 || a.up_slices == 2 || a.up_slices == 4 ||
                         a.up_slices == 8;
  const bool ok = a.num_tokens >= 1 && a.num_tokens <= kMoeDecodeMaxTokens && a.top_k >= 1 && a.top_k <= 16 &&
                  a.num_tokens * a.top_k <= kMoeDecodeMaxPairs && a.num_experts >= 1 &&
                  a.num_experts <= kMoeDecodeMaxExperts && a.hidden >= 8 && a.hidden % 8 == 0 &&
                  a.hidden < (int64_t{1} << 24) && a.inter >= 8 && a.inter % 8 == 0 &&
                  a.inter < (int64_t{1} << 24) && a.x && a.topk_ids && a.topk_weights && a.experts && a.h &&
                  a.out && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.h) % 16 == 0 &&
                  (!a.gate_up_fp8 || a.hidden % 16 == 0) && (!a.down_fp8 || a.inter % 16 == 0) && slices_ok;
  return ok ? cudaSuccess : cudaErrorInvalidValue;
}

int moe_decode_up_slices(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter,
                         bool gate_up_fp8, int num_sms) {
  // The up kernel's warps stream 4 rows each, like the skinny GEMM's: the
  // same rule over the rows of every expert the step may activate, with the
  // row's 16-byte chunks (skinny_default_slices counts hidden / 8 of them).
  const int64_t activated_max = std::min(num_tokens * top_k, num_experts);
  return skinny_default_slices(1, activated_max * 2 * inter, gate_up_fp8 ? hidden / 2 : hidden, num_sms);
}

cudaError_t launch_moe_decode(const MoeDecodeArgs& a, cudaStream_t stream) {
  if (cudaError_t e = moe_decode_check(a); e != cudaSuccess) return e;
  Params p{};
  p.x = a.x;
  p.ids = a.topk_ids;
  p.weights = a.topk_weights;
  p.experts = a.experts;
  p.h = a.h;
  p.out = a.out;
  p.T = static_cast<int>(a.num_tokens);
  p.top_k = static_cast<int>(a.top_k);
  p.pairs = static_cast<int>(a.num_tokens * a.top_k);
  p.E = static_cast<int>(a.num_experts);
  p.hidden = static_cast<int>(a.hidden);
  p.inter = static_cast<int>(a.inter);
  p.slices = a.up_slices > 0 ? a.up_slices
                             : moe_decode_up_slices(a.num_tokens, a.top_k, a.num_experts, a.hidden, a.inter,
                                                    a.gate_up_fp8, current_device_sms());
  const int64_t chunks = a.hidden / (a.gate_up_fp8 ? 16 : 8);
  p.chunks_per_slice = static_cast<int>(ceil_div64(ceil_div64(chunks, p.slices), 32) * 32);
  p.tiles = static_cast<int>(ceil_div64(a.inter, 2 * (kUpWarps / p.slices)));
  p.down_ctas = static_cast<int>(std::min<int64_t>(ceil_div64(a.hidden, kDownWarps * kDownCols), current_device_sms()));
  if (a.gate_up_fp8) return a.down_fp8 ? launch_types<true, true>(p, a.pdl, stream)
                                        : launch_types<true, false>(p, a.pdl, stream);
  return a.down_fp8 ? launch_types<false, true>(p, a.pdl, stream) : launch_types<false, false>(p, a.pdl, stream);
}

}  // namespace nucleus::kernels
