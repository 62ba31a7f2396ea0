// Skinny FP8 block-scaled GEMM for decode (interface and scheme:
// skinny_fp8_gemm.cuh).
//
// Work split. A CTA is W warps (W = 8, or 16 when S = 16) = (W / S) row
// groups x S K slices; warp w owns weight rows [row0, row0 + 8) with
// row0 = (blockIdx.x * W / S + w / S) * 8 and the k blocks
// [s * bps, (s + 1) * bps) of slice s = w % S. Rows past n read row n - 1 and
// token rows past m read row m - 1 (valid memory, no predicated loads); their
// sums are never stored.
//
// MMA operands of one 64-byte chunk c of the warp's rows (4 MMAs, t = 0..3).
// Lane (g, q) holds bytes [16q, 16q + 16) of the chunk of weight row g; word t
// of them (k = 64c + 16q + 4t + {0, 1, 2, 3}) feeds MMA t: its bytes {0, 1}
// are the B fragment's k slots {2q, 2q + 1}, bytes {2, 3} slots
// {2q + 8, 2q + 9}. The A fragment (x) uses the same permutation: slots
// {2q, 2q + 1} of token g are x[g, 64c + 16q + 4t + {0, 1}] (word 2t of the
// lane's 32 bytes of x), slots {2q + 8, 2q + 9} word 2t + 1; a[1], a[3] are
// token g + 8. The permutation is the same on both sides, so each MMA adds
// exactly the products of its 16 k. Accumulator: lane (g, q) ends with
// tokens g (d[0], d[1]) and g + 8 (d[2], d[3]) of weight rows 2q, 2q + 1.
#include <algorithm>
#include <cstdint>

#include "kernels/common/device_sms.h"
#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/gemm/skinny_epilogue.cuh"
#include "kernels/gemm/skinny_fp8_gemm.cuh"
#include "kernels/gemm/skinny_fp8_stream.cuh"
#include "kernels/gemm/skinny_gemm.cuh"

namespace nucleus::kernels {

namespace {

using fp8_detail::e4m3x4_to_bf16x4;
using fp8_detail::ld_stream_v4;
using fp8_detail::store_out;
using fp8_detail::word_of;

constexpr int kRW = kSkinnyFp8RowsPerWarp;
constexpr int kChunk = 64;                   // k (bytes) of a row per warp load instruction
constexpr int kChunksPerBlock = kSkinnyFp8Block / kChunk;  // 2
constexpr int kBaseWarps = 8;                // warps per CTA for S <= 8
constexpr int kMaxWarps = kSkinnyFp8MaxSlices;  // warps per CTA for S = 16
constexpr int kU = 8;                        // chunks per step (a lane's loads in flight)
static_assert(kU % kChunksPerBlock == 0, "a step is whole k blocks");

struct Params {
  const __nv_bfloat16* x;
  int64_t x_stride;
  const uint8_t* w;
  const float* scale_inv;
  void* out;
  int64_t out_stride;
  int m, n, k;
  int kb_count;          // k / 128
  int slices;            // S
  int warps;             // W
  int blocks_per_slice;  // k blocks per slice
  bool accumulate;
  bool out_f32;
};

__device__ __forceinline__ void store(const Params& p, int row, int tok, float v) {
  const int64_t at = static_cast<int64_t>(tok) * p.out_stride + row;
  if (p.out_f32)
    store_out(static_cast<float*>(p.out) + at, v, p.accumulate);
  else
    store_out(static_cast<__nv_bfloat16*>(p.out) + at, v, p.accumulate);
}

// MT: 16-token halves of the MMA that hold tokens (1: m <= 8, 2: m <= 16).
// kPipe: the next step's weight and scale loads are issued before this
// step's math (two steps in flight a lane; SkinnyFp8GemmArgs::pipelined).
template <int MT, bool kPipe>
__global__ void __launch_bounds__(kMaxWarps * 32) skinny_fp8_gemm_kernel(const Params p) {
  constexpr int kOuts = 2 * MT;  // sums a lane produces
  __shared__ float red[kMaxWarps][kOuts][32];
  pdl::launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int S = p.slices;
  const int groups_per_cta = p.warps / S;
  const int group = warp / S, slice = warp % S;
  const int row0 = (blockIdx.x * groups_per_cta + group) * kRW;
  const int kb_begin = slice * p.blocks_per_slice;
  const int kb_end = min(p.kb_count, kb_begin + p.blocks_per_slice);
  const int c_begin = kb_begin * kChunksPerBlock, c_end = kb_end * kChunksPerBlock;

  const int wr = min(row0 + g, p.n - 1);
  const uint8_t* wrow = p.w + static_cast<int64_t>(wr) * p.k + 16 * q;
  // The warp's 8 rows share one scale row (8 divides 128).
  const float* srow = p.scale_inv + static_cast<int64_t>(min(row0, p.n - 1) / kSkinnyFp8Block) * p.kb_count;
  const __nv_bfloat16* xrow[MT];
#pragma unroll
  for (int h = 0; h < MT; ++h) xrow[h] = p.x + static_cast<int64_t>(min(g + 8 * h, p.m - 1)) * p.x_stride + 16 * q;

  float acc[kOuts];
#pragma unroll
  for (int i = 0; i < kOuts; ++i) acc[i] = 0.0f;

  // Every weight and scale load of a step (U chunks from c0).
  auto load_step = [&](int c0, uint4 (&wv)[kU], float (&sc)[kU / kChunksPerBlock]) {
#pragma unroll
    for (int u = 0; u < kU; ++u)
      wv[u] = c0 + u < c_end ? ld_stream_v4(wrow + static_cast<int64_t>(c0 + u) * kChunk) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int b = 0; b < kU / kChunksPerBlock; ++b) {
      const int kb = c0 / kChunksPerBlock + b;
      sc[b] = kb < kb_end ? __ldg(srow + kb) : 0.0f;
    }
  };
  uint4 wv[kU];
  float sc[kU / kChunksPerBlock];
  if constexpr (kPipe)
    if (c_begin < c_end) load_step(c_begin, wv, sc);

  bool waited = false;
  for (int c0 = c_begin; c0 < c_end; c0 += kU) {  // warp-uniform bounds: the MMAs run converged
    // Every weight and scale load of the step first (pipelined: of the next
    // step, this one's are in flight since the last), then the math.
    uint4 wn[kU];
    float sn[kU / kChunksPerBlock];
    if constexpr (kPipe) {
      if (c0 + kU < c_end) load_step(c0 + kU, wn, sn);
    } else {
      load_step(c0, wv, sc);
    }
    // The weights do not depend on the previous kernel; x does (PDL: the
    // first weight loads are in flight while it finishes).
    if (!waited) {
      pdl::wait_for_inputs();
      waited = true;
    }
#pragma unroll
    for (int b = 0; b < kU / kChunksPerBlock; ++b) {
      if (c0 + b * kChunksPerBlock >= c_end) break;
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int h = 0; h < kChunksPerBlock; ++h) {
        const int u = b * kChunksPerBlock + h;
        const int64_t xo = static_cast<int64_t>(c0 + u) * kChunk;
        uint4 xv[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          xv[mt][0] = __ldg(reinterpret_cast<const uint4*>(xrow[mt] + xo));
          xv[mt][1] = __ldg(reinterpret_cast<const uint4*>(xrow[mt] + xo + 8));
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          uint32_t b0, b1;
          e4m3x4_to_bf16x4(word_of(wv[u], t), b0, b1);
          uint32_t a[4];
          a[0] = word_of(xv[0][t >> 1], (2 * t) & 3);
          a[2] = word_of(xv[0][t >> 1], (2 * t + 1) & 3);
          if constexpr (MT == 2) {
            a[1] = word_of(xv[1][t >> 1], (2 * t) & 3);
            a[3] = word_of(xv[1][t >> 1], (2 * t + 1) & 3);
          } else {
            a[1] = a[3] = 0u;
          }
          ptx::mma_m16n8k16_bf16_unordered(part, a, b0, b1);
        }
      }
#pragma unroll
      for (int i = 0; i < kOuts; ++i) acc[i] = fmaf(part[i], sc[b], acc[i]);
    }
    if constexpr (kPipe) {
#pragma unroll
      for (int u = 0; u < kU; ++u) wv[u] = wn[u];
#pragma unroll
      for (int b = 0; b < kU / kChunksPerBlock; ++b) sc[b] = sn[b];
    }
  }

  pdl::wait_for_inputs();  // before any output access (a warp with no k blocks has not waited)

  const int r_lane = 2 * q;  // + (i & 1): the lane's weight rows; token g + 8 (i >> 1)
  if (S == 1) {
#pragma unroll
    for (int i = 0; i < kOuts; ++i) {
      const int row = row0 + r_lane + (i & 1), tok = g + 8 * (i >> 1);
      if (row < p.n && tok < p.m) store(p, row, tok, acc[i]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kOuts; ++i) red[warp][i][lane] = acc[i];
  __syncthreads();
  // The slices of a group are added in slice order.
  const int total = groups_per_cta * kOuts * 32;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    const int gi = e / (kOuts * 32), i = (e / 32) % kOuts, l = e % 32;
    const int row = (blockIdx.x * groups_per_cta + gi) * kRW + 2 * (l & 3) + (i & 1);
    const int tok = (l >> 2) + 8 * (i >> 1);
    if (row >= p.n || tok >= p.m) continue;
    float v = 0.0f;
    for (int s = 0; s < S; ++s) v += red[gi * S + s][i][l];
    store(p, row, tok, v);
  }
}

int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <int MT>
cudaError_t launch_mt(const Params& p, bool pdl_on, bool pipelined, cudaStream_t stream) {
  const int64_t groups = ceil_div64(p.n, kRW);
  const int64_t grid = ceil_div64(groups, p.warps / p.slices);
  return pipelined ? pdl::launch(skinny_fp8_gemm_kernel<MT, true>, grid, p.warps * 32, 0, pdl_on, stream, p)
                   : pdl::launch(skinny_fp8_gemm_kernel<MT, false>, grid, p.warps * 32, 0, pdl_on, stream, p);
}

// ---- stream (SkinnyFp8GemmArgs::stream): the bf16 skinny kernel's scheme ----
// A CTA is 8 warps = (8 / S) row groups x S K slices; warp w owns weight rows
// [row0, row0 + 4) and the 16-byte chunks (16 k) [s * cps, (s + 1) * cps) of
// slice s = w % S, cps a multiple of 32. The loop and its arithmetic:
// skinny_fp8_stream.cuh.
constexpr int kStreamRows = fp8_stream::kRows;
constexpr int kStreamWarps = fp8_stream::kWarps;
constexpr int kStreamSteps = fp8_stream::kSteps;

struct StreamParams {
  const __nv_bfloat16* x;
  int64_t x_stride;
  const uint8_t* w;
  const float* scale_inv;
  void* out;
  int64_t out_stride;
  int m, n, k;
  int kb_count;
  int slices;
  int chunks_per_slice;  // a multiple of 32
  bool accumulate;
  bool out_f32;
};

template <int M, int U>
__global__ void __launch_bounds__(kStreamWarps * 32, 2) skinny_fp8_stream_kernel(const StreamParams p) {
  constexpr int kOuts = kStreamRows * M;
  __shared__ float red[kStreamWarps][kOuts];
  pdl::launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = p.slices;
  const int groups_per_cta = kStreamWarps / S;
  const int group = warp / S, slice = warp % S;
  const int row0 = (blockIdx.x * groups_per_cta + group) * kStreamRows;
  const int c_begin = slice * p.chunks_per_slice;
  const int c_end = min(p.k >> 4, c_begin + p.chunks_per_slice);

  const uint8_t* wrow[kStreamRows];
#pragma unroll
  for (int r = 0; r < kStreamRows; ++r) wrow[r] = p.w + static_cast<int64_t>(min(row0 + r, p.n - 1)) * p.k;
  // The warp's 4 rows share one scale row (4 divides 128).
  const float* srow[1] = {p.scale_inv + static_cast<int64_t>(min(row0, p.n - 1) / kSkinnyFp8Block) * p.kb_count};
  const __nv_bfloat16* xrow[M];
#pragma unroll
  for (int mi = 0; mi < M; ++mi) xrow[mi] = p.x + static_cast<int64_t>(min(mi, p.m - 1)) * p.x_stride;

  float acc[kStreamRows][M];
#pragma unroll
  for (int r = 0; r < kStreamRows; ++r)
#pragma unroll
    for (int mi = 0; mi < M; ++mi) acc[r][mi] = 0.0f;
  fp8_stream::accumulate_rows<M, U, 1>(wrow, srow, xrow, c_begin, c_end, lane, false, acc);

  pdl::wait_for_inputs();  // before any output access (a lane with no chunks has not waited)

  const float mine = skinny_epilogue::warp_sums(acc, lane);
  auto put = [&](int row, int mi, float v) {
    const int64_t at = static_cast<int64_t>(mi) * p.out_stride + row;
    if (p.out_f32)
      store_out(static_cast<float*>(p.out) + at, v * fp8_stream::kUnscale, p.accumulate);
    else
      store_out(static_cast<__nv_bfloat16*>(p.out) + at, v * fp8_stream::kUnscale, p.accumulate);
  };
  skinny_epilogue::store_sums<kStreamRows, M, kStreamWarps>(mine, S, p.n, p.m,
                                                            blockIdx.x * groups_per_cta * kStreamRows, red, put);
}

cudaError_t launch_stream(const SkinnyFp8GemmArgs& a, cudaStream_t stream) {
  StreamParams p{};
  fp8_detail::copy_gemm_operands(p, a);
  p.scale_inv = a.scale_inv;
  p.kb_count = static_cast<int>(a.k / kSkinnyFp8Block);
  p.slices = a.slices > 0 ? a.slices : skinny_fp8_stream_slices(a.n, a.k, current_device_sms());
  const int64_t chunks = a.k / 16;
  p.chunks_per_slice = static_cast<int>((chunks + p.slices - 1) / p.slices + 31) / 32 * 32;
  p.accumulate = a.accumulate;
  p.out_f32 = a.out_f32;
  const int64_t groups = (a.n + kStreamRows - 1) / kStreamRows;
  const int64_t grid = (groups + kStreamWarps / p.slices - 1) / (kStreamWarps / p.slices);
  if (a.m == 1)
    return pdl::launch(skinny_fp8_stream_kernel<1, kStreamSteps>, grid, kStreamWarps * 32, 0, a.pdl, stream, p);
  return pdl::launch(skinny_fp8_stream_kernel<2, kStreamSteps>, grid, kStreamWarps * 32, 0, a.pdl, stream, p);
}

}  // namespace

int skinny_fp8_stream_slices(int64_t n, int64_t k, int num_sms) {
  // The bf16 kernel's rule over the same 4-row groups and 8-warp CTAs: its
  // 8-element chunks of a k / 2 row are this scheme's 16-element chunks of k.
  static_assert(kStreamRows == kSkinnyRowsPerWarp && kStreamWarps == kSkinnyWarps, "the bf16 kernel's work split");
  return skinny_default_slices(1, n, k / 2, num_sms);
}

const char* skinny_fp8_gemm_refusal(const SkinnyFp8GemmArgs& a) {
  if (a.m < 1 || a.m > kSkinnyFp8MaxRows) return "m outside [1, 16]";
  if (a.n < 1 || a.n >= (int64_t{1} << 31)) return "n outside [1, 2^31)";
  if (a.k < kSkinnyFp8Block || a.k % kSkinnyFp8Block != 0 || a.k >= (int64_t{1} << 31))
    return "k not a positive multiple of 128 below 2^31 (whole 128-wide scale blocks)";
  if (a.x_stride < a.k || a.x_stride % 8 != 0) return "x_stride below k or not a multiple of 8 (16-byte x rows)";
  if (a.out_stride < a.n) return "out_stride below n";
  if (a.x == nullptr || reinterpret_cast<uintptr_t>(a.x) % 16 != 0) return "x null or not 16-byte aligned";
  if (a.w == nullptr || reinterpret_cast<uintptr_t>(a.w) % 16 != 0) return "w null or not 16-byte aligned";
  if (a.scale_inv == nullptr) return "no scale_inv";
  if (a.out == nullptr) return "no output";
  if (a.slices != 0 && a.slices != 1 && a.slices != 2 && a.slices != 4 && a.slices != 8 && a.slices != 16)
    return "slices not 0, 1, 2, 4, 8 or 16";
  if (a.stream) {
    if (a.pipelined) return "stream with pipelined (one scheme at a time)";
    if (a.m > kSkinnyFp8StreamMaxRows) return "stream with m above 2";
    if (a.slices > 8) return "stream with slices 16 (its CTAs are 8 warps)";
  }
  return nullptr;
}

cudaError_t skinny_fp8_gemm_check(const SkinnyFp8GemmArgs& a) {
  return skinny_fp8_gemm_refusal(a) == nullptr ? cudaSuccess : cudaErrorInvalidValue;
}

int skinny_fp8_default_slices(int64_t n, int64_t k, int num_sms) {
  const int64_t groups = ceil_div64(n, kRW);
  const int64_t blocks = k / kSkinnyFp8Block;
  const int64_t target = int64_t{35} * num_sms / 3;  // ~11.7 warps per SM: 1540 on 132 SMs
  int best = 1;
  int64_t best_gap = INT64_MAX;
  for (int s = 1; s <= kSkinnyFp8MaxSlices && (s == 1 || blocks / s >= 2); s *= 2) {
    const int64_t gap = groups * s > target ? groups * s - target : target - groups * s;
    if (gap <= best_gap) best = s, best_gap = gap;  // ties to the larger count
  }
  return best;
}

bool skinny_fp8_pipelined_fits(int64_t n, int64_t k, int slices, int num_sms) {
  const int s = slices > 0 ? slices : skinny_fp8_default_slices(n, k, num_sms);
  constexpr int64_t kPipelinedWarpsPerSm = 2 * kBaseWarps;
  return ceil_div64(n, kRW) * s <= kPipelinedWarpsPerSm * num_sms;
}

cudaError_t launch_skinny_fp8_gemm(const SkinnyFp8GemmArgs& a, cudaStream_t stream) {
  if (cudaError_t e = skinny_fp8_gemm_check(a); e != cudaSuccess) return e;
  if (a.stream) return launch_stream(a, stream);
  Params p{};
  fp8_detail::copy_gemm_operands(p, a);
  p.scale_inv = a.scale_inv;
  p.kb_count = static_cast<int>(a.k / kSkinnyFp8Block);
  p.slices = a.slices > 0 ? a.slices : skinny_fp8_default_slices(a.n, a.k, current_device_sms());
  p.warps = std::max(kBaseWarps, p.slices);
  p.blocks_per_slice = static_cast<int>(ceil_div64(p.kb_count, p.slices));
  p.accumulate = a.accumulate;
  p.out_f32 = a.out_f32;
  if (a.m <= 8) return launch_mt<1>(p, a.pdl, a.pipelined, stream);
  return launch_mt<2>(p, a.pdl, a.pipelined, stream);
}

}  // namespace nucleus::kernels
