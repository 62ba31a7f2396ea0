// The absorption GEMMs of MLA decode at decode row counts (see
// mla_decode.cuh, launch_mla_decode_absorb_small / _output_small).
//
// At a few rows the two per-head GEMMs are pure weight streams (W_UK and
// W_UV: 2 MB each at 16 heads in bf16, 16 MB at 128), and cuBLASLt's batched
// GEMM costs ~5-6 us whatever their size, plus a gather kernel before and a
// combine kernel before the second. Here each is one kernel, 4 CTAs a head:
//   absorb: CTA (h, column quarter cb) holds its 128 x 128 slice of W_UK[h]
//           in registers (128 threads: 16 column chunks of 8 x 8 row groups
//           of 16 rows), reads q_nope of every row straight from q (the
//           gather), adds the 8 row groups' partial sums in shared memory,
//           and writes q_full[:, h, 128 cb + :128]; quarter 0 copies q_pe.
//   output: CTA (h, output quarter db) holds W_UV[h] rows [32 db, +32) (8
//           warps x 4 rows, each lane 2 chunks of 8 columns), merges the
//           attention's split partials of head h into o_lat in shared memory
//           (warp i weighs row i's splits, every thread merges 4-column
//           groups: the combine kernel's arithmetic, in its order, rounded
//           to bf16 as it rounds), then each warp reduces its 4 weight rows'
//           dot products with every row.
// Both issue their weight loads first and wait for the kernel before them
// (PDL) only then, so the weight stream overlaps the previous kernel's tail.
// FP8 kv_b_proj is read as e4m3 with its 128 x 128 block scales: a W_UK
// quarter is one block (one scale on the sums), a W_UV lane chunk lies in one
// column block (one scale a chunk).
#include <cuda_bf16.h>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/mla/mla_decode.cuh"
#include "kernels/mla/mla_decode_rows.cuh"

namespace nucleus::kernels {

namespace {

using mla_decode_detail::row_keys;
using mla_decode_detail::row_of;
using mla_decode_detail::row_splits;

constexpr int kR = kMlaDecodeSmallRows;
constexpr int kHeadRows = kMlaDecodeNope + kMlaDecodeVHead;  // 256 kv_b rows a head
constexpr int kQWidth = kMlaDecodeNope + kMlaDecodeRope;       // 192 q values a head
constexpr int kBlock = 128;                                    // FP8 block (rows and columns)
constexpr int kColBlocks = kMlaDecodeLora / kBlock;            // 4

// 8 weights of one 16-byte bf16 chunk, or of one 8-byte e4m3 chunk, as f32.
template <bool kFp8>
struct Chunk;
template <>
struct Chunk<false> {
  uint4 v;
  __device__ __forceinline__ void load(const void* base, int64_t elem) {
    v = fp8_detail::ld_stream_v4(static_cast<const __nv_bfloat16*>(base) + elem);
  }
  __device__ __forceinline__ void to_f32(float (&f)[8]) const {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      f[2 * e] = __uint_as_float(w[e] << 16);
      f[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
    }
  }
};
template <>
struct Chunk<true> {
  uint2 v;
  __device__ __forceinline__ void load(const void* base, int64_t elem) {
    const auto* p = static_cast<const unsigned char*>(base) + elem;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  }
  __device__ __forceinline__ void to_f32(float (&f)[8]) const {
    const uint32_t w[2] = {v.x, v.y};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      uint32_t lo, hi;
      fp8_detail::e4m3x4_to_bf16x4(w[e], lo, hi);  // exact
      f[4 * e] = __uint_as_float(lo << 16);
      f[4 * e + 1] = __uint_as_float(lo & 0xffff0000u);
      f[4 * e + 2] = __uint_as_float(hi << 16);
      f[4 * e + 3] = __uint_as_float(hi & 0xffff0000u);
    }
  }
};

__device__ __forceinline__ float bf16_bits_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_bits_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

constexpr int kAbsorbThreads = 128;
constexpr int kAbsorbRowGroups = kAbsorbThreads / 16;              // 8
constexpr int kAbsorbRowsPerThread = kMlaDecodeNope / kAbsorbRowGroups;  // 16

template <bool kFp8>
__global__ void __launch_bounds__(kAbsorbThreads) mla_decode_absorb_small_kernel(const MlaDecodeSmallParams p) {
  __shared__ __align__(16) float qs[kR][kMlaDecodeNope];
  __shared__ __align__(16) float red[kAbsorbRowGroups][kR][kBlock];
  const int H = p.num_heads, h = blockIdx.x / kColBlocks, cb = blockIdx.x % kColBlocks;
  const int t = threadIdx.x, cc = t % 16, rg = t / 16;
  const int col = cb * kBlock + cc * 8;
  const int64_t w_row0 = static_cast<int64_t>(h) * kHeadRows;
  Chunk<kFp8> w[kAbsorbRowsPerThread];
#pragma unroll
  for (int j = 0; j < kAbsorbRowsPerThread; ++j)
    w[j].load(p.kv_b, (w_row0 + rg + kAbsorbRowGroups * j) * kMlaDecodeLora + col);
  const float scale = kFp8 ? p.kv_b_scale[(w_row0 / kBlock) * kColBlocks + cb] : 1.0f;
  pdl::wait_for_inputs();
  pdl::launch_dependents();

  const int n = static_cast<int>(p.r.num_rows);
  for (int idx = t; idx < n * (kMlaDecodeNope / 8); idx += kAbsorbThreads) {
    const int i = idx / (kMlaDecodeNope / 8), k = idx % (kMlaDecodeNope / 8);
    const uint4 v = *reinterpret_cast<const uint4*>(p.q + row_of(p.r, i) * p.q_stride + h * kQWidth + k * 8);
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      qs[i][k * 8 + 2 * e] = bf16_bits_lo(u[e]);
      qs[i][k * 8 + 2 * e + 1] = bf16_bits_hi(u[e]);
    }
  }
  if (cb == 0) {  // q_pe -> q_full[i, h, 512:576]
    for (int idx = t; idx < n * (kMlaDecodeRope / 8); idx += kAbsorbThreads) {
      const int i = idx / (kMlaDecodeRope / 8), k = idx % (kMlaDecodeRope / 8);
      *reinterpret_cast<uint4*>(p.q_full + (static_cast<int64_t>(i) * H + h) * kMlaDecodeLatent + kMlaDecodeLora +
                                k * 8) =
          *reinterpret_cast<const uint4*>(p.q + row_of(p.r, i) * p.q_stride + h * kQWidth + kMlaDecodeNope + k * 8);
    }
  }
  __syncthreads();

  float acc[kR][8];
#pragma unroll
  for (int i = 0; i < kR; ++i)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[i][e] = 0.0f;
#pragma unroll
  for (int j = 0; j < kAbsorbRowsPerThread; ++j) {
    float f[8];
    w[j].to_f32(f);
    const int r = rg + kAbsorbRowGroups * j;
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      if (i < n) {
        const float qv = qs[i][r];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] = fmaf(qv, f[e], acc[i][e]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    if (i < n) {
      float4* dst = reinterpret_cast<float4*>(&red[rg][i][cc * 8]);
      dst[0] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      dst[1] = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
    }
  }
  __syncthreads();
  // Thread t: column t of the quarter, every row.
  for (int i = 0; i < n; ++i) {
    float v = 0.0f;
#pragma unroll
    for (int g = 0; g < kAbsorbRowGroups; ++g) v += red[g][i][t];
    p.q_full[(static_cast<int64_t>(i) * H + h) * kMlaDecodeLatent + cb * kBlock + t] = __float2bfloat16_rn(v * scale);
  }
}

constexpr int kOutThreads = 256;
constexpr int kOutWarps = kOutThreads / 32;
constexpr int kOutRowsPerWarp = kMlaDecodeVHead / kColBlocks / kOutWarps;  // 4
constexpr int kOutChunks = kMlaDecodeLora / 8 / 32;                       // 2 chunks of 8 columns a lane
static_assert(kOutWarps >= kR, "warp i weighs row i's splits");

template <bool kFp8>
__global__ void __launch_bounds__(kOutThreads) mla_decode_output_small_kernel(const MlaDecodeSmallParams p) {
  __shared__ __align__(16) float ol[kR][kMlaDecodeLora];
  __shared__ float wsplit[kR][kMlaDecodeMaxSplits];
  __shared__ int row_ns[kR];
  const int H = p.num_heads, h = blockIdx.x / kColBlocks, db = blockIdx.x % kColBlocks;
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int d0 = db * (kMlaDecodeVHead / kColBlocks) + warp * kOutRowsPerWarp;
  const int64_t w_row0 = static_cast<int64_t>(h) * kHeadRows + kMlaDecodeNope + d0;
  Chunk<kFp8> w[kOutRowsPerWarp][kOutChunks];
#pragma unroll
  for (int rr = 0; rr < kOutRowsPerWarp; ++rr)
#pragma unroll
    for (int c = 0; c < kOutChunks; ++c) w[rr][c].load(p.kv_b, (w_row0 + rr) * kMlaDecodeLora + (lane + 32 * c) * 8);
  float scale[kOutChunks];
#pragma unroll
  for (int c = 0; c < kOutChunks; ++c)
    scale[c] = kFp8 ? p.kv_b_scale[(w_row0 / kBlock) * kColBlocks + (lane + 32 * c) * 8 / kBlock] : 1.0f;
  pdl::wait_for_inputs();
  pdl::launch_dependents();

  // o_lat of head h for every row, as f32 values of bf16s. Split partials:
  // warp i takes row i's softmax weights of the splits, then every thread
  // merges 4-column groups (row i, group g) in split order (the combine
  // kernel's arithmetic, in its order).
  const int n = static_cast<int>(p.r.num_rows);
  constexpr int kGroups = kMlaDecodeLora / 4;
  if (p.num_splits == 1) {
    for (int e = t; e < n * kMlaDecodeLora; e += kOutThreads) {
      const int i = e / kMlaDecodeLora, c = e % kMlaDecodeLora;
      ol[i][c] = __bfloat162float(p.o_lat[(static_cast<int64_t>(i) * H + h) * kMlaDecodeLora + c]);
    }
  } else {
    if (warp < n) {
      const int i = warp;
      int seq;
      const int ns = row_splits(row_keys(p.r, row_of(p.r, i), &seq), p.num_splits, p.min_split_keys, p.r.num_rows, p.key_tile);
      const int64_t base = static_cast<int64_t>(i) * p.num_splits * H + h;  // + s * H
      mla_decode_detail::split_weights(p.part_lse + base, H, ns, wsplit[i], lane);
      if (lane == 0) row_ns[i] = ns;
    }
    __syncthreads();
    for (int e = t; e < n * kGroups; e += kOutThreads) {
      const int i = e / kGroups, g = e % kGroups;
      const int ns = row_ns[i];
      const float* w = wsplit[i];
      const float* src = p.part_o + (static_cast<int64_t>(i) * p.num_splits * H + h) * kMlaDecodeLora + 4 * g;
      const int64_t split_stride = static_cast<int64_t>(H) * kMlaDecodeLora;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int s = 0; s < ns; ++s) {
        const float ws = w[s];
        const float4 v = *reinterpret_cast<const float4*>(src + s * split_stride);
        acc.x += ws * v.x;
        acc.y += ws * v.y;
        acc.z += ws * v.z;
        acc.w += ws * v.w;
      }
      float* dst = &ol[i][4 * g];
      dst[0] = __bfloat162float(__float2bfloat16_rn(acc.x));
      dst[1] = __bfloat162float(__float2bfloat16_rn(acc.y));
      dst[2] = __bfloat162float(__float2bfloat16_rn(acc.z));
      dst[3] = __bfloat162float(__float2bfloat16_rn(acc.w));
    }
  }
  __syncthreads();

  float wf[kOutRowsPerWarp][kOutChunks][8];
#pragma unroll
  for (int rr = 0; rr < kOutRowsPerWarp; ++rr)
#pragma unroll
    for (int c = 0; c < kOutChunks; ++c) w[rr][c].to_f32(wf[rr][c]);
  for (int i = 0; i < n; ++i) {
    float x[kOutChunks][8];
#pragma unroll
    for (int c = 0; c < kOutChunks; ++c) {
      const float4* src = reinterpret_cast<const float4*>(&ol[i][(lane + 32 * c) * 8]);
      const float4 a = src[0], b = src[1];
      x[c][0] = a.x, x[c][1] = a.y, x[c][2] = a.z, x[c][3] = a.w;
      x[c][4] = b.x, x[c][5] = b.y, x[c][6] = b.z, x[c][7] = b.w;
    }
    float dot[kOutRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kOutRowsPerWarp; ++rr) {
      dot[rr] = 0.0f;
#pragma unroll
      for (int c = 0; c < kOutChunks; ++c) {
        float part = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) part = fmaf(wf[rr][c][e], x[c][e], part);
        dot[rr] = fmaf(part, scale[c], dot[rr]);
      }
    }
#pragma unroll
    for (int rr = 0; rr < kOutRowsPerWarp; ++rr) dot[rr] = cuda_common::warp_sum(dot[rr]);
    if (lane < kOutRowsPerWarp) {
      float v = dot[0];
#pragma unroll
      for (int rr = 1; rr < kOutRowsPerWarp; ++rr) v = lane == rr ? dot[rr] : v;
      p.out[row_of(p.r, i) * p.out_stride + static_cast<int64_t>(h) * kMlaDecodeVHead + d0 + lane] =
          __float2bfloat16_rn(v);
    }
  }
}

cudaError_t check(const MlaDecodeSmallParams& p) {
  if (p.r.num_rows < 1 || p.r.num_rows > kR || p.num_heads < 1 || p.kv_b == nullptr) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_mla_decode_absorb_small(const MlaDecodeSmallParams& p, cudaStream_t stream) {
  if (p.r.num_rows == 0) return cudaSuccess;
  if (const cudaError_t e = check(p); e != cudaSuccess) return e;
  if (p.q == nullptr || p.q_full == nullptr || p.q_stride < p.num_heads * kQWidth) return cudaErrorInvalidValue;
  const int64_t grid = static_cast<int64_t>(p.num_heads) * kColBlocks;
  return p.kv_b_scale
             ? pdl::launch(mla_decode_absorb_small_kernel<true>, grid, kAbsorbThreads, 0, p.pdl, stream, p)
             : pdl::launch(mla_decode_absorb_small_kernel<false>, grid, kAbsorbThreads, 0, p.pdl, stream, p);
}

cudaError_t launch_mla_decode_output_small(const MlaDecodeSmallParams& p, cudaStream_t stream) {
  if (p.r.num_rows == 0) return cudaSuccess;
  if (const cudaError_t e = check(p); e != cudaSuccess) return e;
  if (p.out == nullptr || p.out_stride < static_cast<int64_t>(p.num_heads) * kMlaDecodeVHead ||
      p.num_splits < 1 || p.num_splits > kMlaDecodeMaxSplits || p.min_split_keys < 0 ||
      p.min_split_keys % kMlaDecodeTileKeys != 0 || (p.key_tile != kMlaDecodeTileKeys && p.key_tile != kMlaDecodeWideTileKeys))
    return cudaErrorInvalidValue;
  if (p.num_splits == 1 ? p.o_lat == nullptr : (p.part_o == nullptr || p.part_lse == nullptr))
    return cudaErrorInvalidValue;
  const int64_t grid = static_cast<int64_t>(p.num_heads) * kColBlocks;
  return p.kv_b_scale
             ? pdl::launch(mla_decode_output_small_kernel<true>, grid, kOutThreads, 0, p.pdl, stream, p)
             : pdl::launch(mla_decode_output_small_kernel<false>, grid, kOutThreads, 0, p.pdl, stream, p);
}

}  // namespace nucleus::kernels
