// Split-K bf16 GEMM for decode shapes (interface and scheme: splitk_gemm.cuh).
//
// Fragment layout. The weights are the MMA's A operand (16 weight rows x 16
// k), the tokens its B operand (16 k x 8 tokens). Lane (g = lane / 4,
// q = lane % 4) loads 16 bytes (8 k) of weight rows g and g + 8 of a tile and
// of token g's x row, at k = chunk + 8q. Those 8 k feed two MMAs: MMA t uses
// elements 4t .. 4t+3, placed in the MMA's k slots {2q, 2q+1} (word 2t) and
// {2q+8, 2q+9} (word 2t+1). A and B use the same placement, so each MMA sums
// the same products as the natural order; the four lanes of a group cover the
// chunk's 32 k between them.
#include <algorithm>
#include <atomic>

#include "kernels/common/device_sms.h"
#include "kernels/common/ptx.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/gemm/splitk_gemm.cuh"

namespace nucleus::kernels {

namespace {

using fp8_detail::ld_stream_v4;
using fp8_detail::word_of;

constexpr int kWarps = kSplitKBlockK / 32;  // 4: a split's K is dealt to the warps 32 at a time
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 32;                // K per warp chunk (4 lanes x 8 bf16)
constexpr int kRowTiles = kSplitKRowsPerCta / 16;

struct Params {
  const __nv_bfloat16* x;
  int64_t x_stride;
  const __nv_bfloat16* w;
  float* out;
  int64_t out_stride;
  int m, n, k;
  int k_per_split;  // a multiple of kSplitKBlockK
  int splits;
  bool zero_init;
  bool deterministic;
  float* partial;  // [splits, m, n] (deterministic, splits > 1)
  int* counters;   // [gridDim.x]
};

// Chunks each warp keeps in flight: 16 bytes x 4 rows x U per lane.
template <int NT>
constexpr int unroll_for() {
  return NT <= 2 ? 4 : 2;
}

// NT: 8-token tiles (m <= 8 NT).
template <int NT>
__global__ void __launch_bounds__(kThreads) splitk_gemm_kernel(const Params p) {
  constexpr int U = unroll_for<NT>();
  constexpr int kTok = NT * 8;
  constexpr int kRedStride = kTok + 1;  // odd: conflict-free column reads
  __shared__ float red[kWarps][kSplitKRowsPerCta][kRedStride];
  __shared__ int s_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int row0 = blockIdx.x * kSplitKRowsPerCta;
  const int k_begin = blockIdx.y * p.k_per_split;
  const int k_end = min(k_begin + p.k_per_split, p.k);

  const __nv_bfloat16* wrow[kRowTiles][2];
  bool rvalid[kRowTiles][2];
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + rt * 16 + h * 8 + g;
      rvalid[rt][h] = r < p.n;
      wrow[rt][h] = p.w + static_cast<int64_t>(rvalid[rt][h] ? r : 0) * p.k;
    }
  const __nv_bfloat16* xrow[NT];
  bool tvalid[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int t = j * 8 + g;
    tvalid[j] = t < p.m;
    xrow[j] = p.x + static_cast<int64_t>(tvalid[j] ? t : 0) * p.x_stride;
  }

  float acc[kRowTiles][NT][4];
  fp8_detail::zero_acc(acc);

  constexpr int kStep = kWarps * kChunk;  // consecutive chunks of one warp are this far apart
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int c = k_begin + warp * kChunk; c < k_end; c += U * kStep) {
    // All of this round's weight bytes first (loads in flight), then the math.
    uint4 wv[U][kRowTiles][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = c + u * kStep + 8 * q;
      const bool kv = kk < k_end;  // k % 8 == 0: 8 elements all in or all out
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][rt][h] = kv && rvalid[rt][h] ? ld_stream_v4(wrow[rt][h] + kk) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c + u * kStep >= k_end) break;  // warp-uniform
      const int kk = c + u * kStep + 8 * q;
      const bool kv = kk < k_end;
      uint4 xv[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j)
        xv[j] = kv && tvalid[j] ? __ldg(reinterpret_cast<const uint4*>(xrow[j] + kk)) : zero;
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int rt = 0; rt < kRowTiles; ++rt) {
          const uint32_t a[4] = {word_of(wv[u][rt][0], 2 * t), word_of(wv[u][rt][1], 2 * t),
                                 word_of(wv[u][rt][0], 2 * t + 1), word_of(wv[u][rt][1], 2 * t + 1)};
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint32_t b[2] = {word_of(xv[j], 2 * t), word_of(xv[j], 2 * t + 1)};
            ptx::mma_m16n8k16_bf16(acc[rt][j], a, b[0], b[1]);
          }
        }
    }
  }

  // Lane (g, q) holds weight rows rt*16 + g (+8 for i >= 2), tokens 8j + 2q (+1 for odd i).
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][rt * 16 + g + (i >= 2 ? 8 : 0)][j * 8 + 2 * q + (i & 1)] = acc[rt][j][i];
  __syncthreads();

  // Consecutive threads take consecutive output columns of one token: the
  // stores and atomics of a warp cover 128 contiguous bytes.
  const int tokens = min(p.m, kTok);
  const int64_t split_stride = static_cast<int64_t>(p.m) * p.n;
  float* part = p.deterministic ? p.partial + blockIdx.y * split_stride : nullptr;
  for (int e = threadIdx.x; e < tokens * kSplitKRowsPerCta; e += kThreads) {
    const int r = e % kSplitKRowsPerCta, t = e / kSplitKRowsPerCta;
    const int col = row0 + r;
    if (col >= p.n) continue;
    const float v = ((red[0][r][t] + red[1][r][t]) + red[2][r][t]) + red[3][r][t];
    float* o = p.out + static_cast<int64_t>(t) * p.out_stride + col;
    if (p.splits == 1) *o = p.zero_init ? v : *o + v;
    else if (!p.deterministic) atomicAdd(o, v);
    else part[static_cast<int64_t>(t) * p.n + col] = v;
  }
  if (p.splits == 1 || !p.deterministic) return;

  __threadfence();  // partials visible device-wide before the ticket
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&p.counters[blockIdx.x], 1) == p.splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // The last CTA of this row tile adds the splits in split order.
  for (int e = threadIdx.x; e < tokens * kSplitKRowsPerCta; e += kThreads) {
    const int r = e % kSplitKRowsPerCta, t = e / kSplitKRowsPerCta;
    const int col = row0 + r;
    if (col >= p.n) continue;
    float* o = p.out + static_cast<int64_t>(t) * p.out_stride + col;
    const float* src = p.partial + static_cast<int64_t>(t) * p.n + col;
    float v = p.zero_init ? 0.0f : *o;
    for (int s = 0; s < p.splits; ++s) v += __ldcg(src + s * split_stride);
    *o = v;
  }
  if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;  // ready for the next launch
}

int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <int NT>
cudaError_t launch_nt(const Params& p, cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>(ceil_div64(p.n, kSplitKRowsPerCta)), static_cast<unsigned>(p.splits));
  splitk_gemm_kernel<NT><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t splitk_check(const SplitKGemmArgs& a) {
  const bool ok = a.m >= 1 && a.m <= kSplitKMaxRows && a.n >= 1 && a.k >= 8 && a.k % 8 == 0 &&
                  a.x_stride % 8 == 0 && a.x_stride >= a.k && a.out_stride >= a.n &&
                  reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.w) % 16 == 0 &&
                  a.out != nullptr && a.n < (int64_t{1} << 31) && a.k < (int64_t{1} << 31) && a.splits >= 0;
  return ok ? cudaSuccess : cudaErrorInvalidValue;
}

int splitk_default_splits(int64_t m, int64_t n, int64_t k, int num_sms) {
  const int64_t row_tiles = std::max<int64_t>(1, ceil_div64(n, kSplitKRowsPerCta));
  const int64_t k_blocks = std::max<int64_t>(1, ceil_div64(k, kSplitKBlockK));
  const int64_t m8 = ceil_div64(std::max<int64_t>(m, 1), 8) * 8;
  const int64_t min_blocks = ceil_div64(std::max<int64_t>(kSplitKBlockK, 4 * m8), kSplitKBlockK);
  // CTAs resident per SM: 3 (2 for m > 32, whose 64-token tiles take ~210 registers a thread).
  const int64_t ctas_per_sm = m > 32 ? 2 : 3;
  int64_t s = ceil_div64(ctas_per_sm * num_sms, row_tiles);
  s = std::min(s, std::max<int64_t>(1, k_blocks / min_blocks));
  s = std::min<int64_t>(s, kSplitKMaxSplits);
  return static_cast<int>(std::max<int64_t>(s, 1));
}

int splitk_effective_splits(const SplitKGemmArgs& a, const SplitKWorkspace& ws) {
  const int64_t k_blocks = std::max<int64_t>(1, ceil_div64(a.k, kSplitKBlockK));
  int64_t s = a.splits > 0 ? a.splits : splitk_default_splits(a.m, a.n, a.k, current_device_sms());
  s = std::clamp<int64_t>(s, 1, k_blocks);
  if (s > 1 && a.mode == SplitKMode::kDeterministic) {
    if (ws.partial == nullptr || ws.counters == nullptr || ceil_div64(a.n, kSplitKRowsPerCta) > ws.num_counters)
      s = 1;
    else
      s = std::max<int64_t>(1, std::min<int64_t>(s, ws.partial_floats / std::max<int64_t>(1, a.m * a.n)));
  }
  const int64_t blocks_per_split = ceil_div64(k_blocks, s);
  return static_cast<int>(ceil_div64(k_blocks, blocks_per_split));
}

cudaError_t launch_splitk_gemm(const SplitKGemmArgs& a, const SplitKWorkspace& ws, cudaStream_t stream) {
  if (cudaError_t e = splitk_check(a); e != cudaSuccess) return e;
  Params p{};
  fp8_detail::copy_gemm_operands(p, a);
  p.splits = splitk_effective_splits(a, ws);
  const int64_t k_blocks = ceil_div64(a.k, kSplitKBlockK);
  p.k_per_split = static_cast<int>(ceil_div64(k_blocks, p.splits) * kSplitKBlockK);
  p.zero_init = a.zero_init;
  p.deterministic = a.mode == SplitKMode::kDeterministic;
  p.partial = ws.partial;
  p.counters = ws.counters;
  if (p.splits > 1 && !p.deterministic && a.zero_init) {
    // The atomics add onto out: clear its [m, n] block first.
    const cudaError_t e = a.out_stride == a.n
                              ? cudaMemsetAsync(a.out, 0, static_cast<size_t>(a.m * a.n) * sizeof(float), stream)
                              : cudaMemset2DAsync(a.out, static_cast<size_t>(a.out_stride) * sizeof(float), 0,
                                                  static_cast<size_t>(a.n) * sizeof(float),
                                                  static_cast<size_t>(a.m), stream);
    if (e != cudaSuccess) return e;
  }
  if (a.m <= 8) return launch_nt<1>(p, stream);
  if (a.m <= 16) return launch_nt<2>(p, stream);
  if (a.m <= 32) return launch_nt<4>(p, stream);
  return launch_nt<8>(p, stream);
}

}  // namespace nucleus::kernels
