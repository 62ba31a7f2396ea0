// Device helpers the MLA decode kernels share (kernels/mla/mla_decode.cu,
// mla_decode_heads.cu and mla_decode_wgmma.cu): which query row a call's row
// i is, how many keys it sees, how its keys are split over the grid's KV
// splits, where a cache row is, and how a split's output is stored. Only for
// .cu files.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/cuda_common.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/mla/mla_decode.cuh"

namespace nucleus::kernels::mla_decode_detail {

constexpr int kTileKeys = kMlaDecodeTileKeys;  // keys of one attention tile

// Keys per split of a row (kernels/mla/mla_split_plan.h): every kernel of a
// call computes it from the same arguments.
__device__ __forceinline__ int row_chunk(int num_keys, int num_splits, int min_keys, int64_t num_rows, int tile) {
  return mla_split_chunk(num_keys, num_splits, min_keys, num_rows, tile);
}

// The step row of a call's row i.
__device__ __forceinline__ int64_t row_of(const MlaDecodeRows& r, int64_t i) {
  return r.rows ? static_cast<int64_t>(r.rows[i]) : r.row_offset + i;
}

// Keys visible to query row `row` (its position + 1) and its sequence.
__device__ __forceinline__ int row_keys(const MlaDecodeRows& r, int64_t row, int* seq) {
  *seq = r.token_seq[row];
  return r.context_lens[*seq] + static_cast<int>(row - r.query_start[*seq]) + 1;
}

// Splits a row with num_keys keys uses when the grid has num_splits.
__device__ __forceinline__ int row_splits(int num_keys, int num_splits, int min_keys, int64_t num_rows, int tile) {
  return mla_split_count(num_keys, num_splits, min_keys, num_rows, tile);
}

// One warp (lane = its lane): w[s] = the softmax weight of split s < ns of a
// row and head, from the splits' log-sum-exps (log2 domain) lse[s * stride]:
// the combine's weights, computed in one order wherever splits are merged.
__device__ __forceinline__ void split_weights(const float* lse, int64_t stride, int ns, float* w, int lane) {
  float mx = -INFINITY;
  for (int s = lane; s < ns; s += 32) mx = fmaxf(mx, lse[s * stride]);
  mx = cuda_common::warp_max(mx);
  float sum = 0.0f;
  for (int s = lane; s < ns; s += 32) {
    const float e = exp2f(lse[s * stride] - mx);
    w[s] = e;
    sum += e;
  }
  sum = cuda_common::warp_sum(sum);
  const float inv = 1.0f / sum;
  __syncwarp();
  for (int s = lane; s < ns; s += 32) w[s] *= inv;
  __syncwarp();
}

using cuda_common::pack_bf16x2;

// Four e4m3 bytes of w -> bf16: bytes 0, 1 into lo (byte 0 in the low half),
// bytes 2, 3 into hi; exact, NaN kept, no branch. The FP8 GEMMs'
// integer-pipe conversion (fp8_detail::e4m3x4_to_bf16x4: an exponent shift
// and one bf16x2 multiply by 2^120) reads e4m3's NaN (magnitude 0x7f) as
// +-480, so each NaN byte's half is then ORed with 0x7fc0 (all-ones exponent,
// a nonzero mantissa: NaN, sign kept): (w & 0x7f7f7f7f) + 0x01010101 sets
// the top bit of exactly the bytes of magnitude 0x7f, and prmt's
// sign-replicating selectors (nibbles 8..b) spread it over the byte's half.
// A cache row is NaN only where the model produced one, and must read so.
__device__ __forceinline__ void e4m3x4_to_bf16x4_nan_kept(uint32_t w, uint32_t& lo, uint32_t& hi) {
  fp8_detail::e4m3x4_to_bf16x4(w, lo, hi);
  const uint32_t top = (w & 0x7f7f7f7fu) + 0x01010101u;
  uint32_t nan_lo, nan_hi;
  asm("prmt.b32 %0, %1, 0, 0x9988;" : "=r"(nan_lo) : "r"(top));
  asm("prmt.b32 %0, %1, 0, 0xbbaa;" : "=r"(nan_hi) : "r"(top));
  lo |= nan_lo & 0x7fc07fc0u;
  hi |= nan_hi & 0x7fc07fc0u;
}

// A CTA's share of call row i: keys [k_begin, k_end) of split `split` in
// tiles of kTile keys, and the row's block-table row. Empty (k_begin >=
// k_end) where the row needs fewer splits than the grid has.
struct SplitKeys {
  int k_begin = 0, k_end = 0, num_tiles = 0;
  const int32_t* table = nullptr;
};
template <int kTile>
__device__ __forceinline__ SplitKeys split_keys(const MlaDecodeAttnParams& p, int64_t i, int split) {
  int seq;
  const int num_keys = row_keys(p.r, row_of(p.r, i), &seq);
  const int chunk = row_chunk(num_keys, p.num_splits, p.min_split_keys, p.r.num_rows, kTile);
  SplitKeys k;
  k.k_begin = split * chunk;
  k.k_end = min(num_keys, k.k_begin + chunk);
  k.num_tiles = k.k_begin < k.k_end ? (k.k_end - k.k_begin + kTile - 1) / kTile : 0;
  k.table = p.r.block_tables + static_cast<int64_t>(seq) * p.r.max_blocks;
  return k;
}

// The bytes of cache row `key` (row_bytes a row) of a sequence with block-table row `table`.
__device__ __forceinline__ const unsigned char* cache_row(const MlaDecodeAttnParams& p, const int32_t* table, int key,
                                                          int row_bytes) {
  const int bs = p.r.block_size;
  const int64_t slot = static_cast<int64_t>(__ldg(table + key / bs)) * bs + key % bs;
  return static_cast<const unsigned char*>(p.cache) + slot * row_bytes;
}

// A warp's o_lat columns col0 + 8 n (n < kN) of heads h_lo and h_hi (rows of
// the mma layout) of call row i, already divided by the row sums: bf16 into
// o_lat when the call is not split, else f32 partials of split `split` and,
// where write_lse, the heads' log-sum-exps (log2 domain).
template <int kN>
__device__ __forceinline__ void store_output(const MlaDecodeAttnParams& p, const float (&o)[kN][4], int64_t i,
                                             int split, int h_lo, int h_hi, int col0, float inv_lo, float inv_hi,
                                             bool write_lse, float lse_lo, float lse_hi) {
  const int H = p.num_heads;
  if (p.num_splits == 1) {
    __nv_bfloat16* ob = p.o_lat + i * H * kMlaDecodeLora;
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      if (h_lo < H)
        *reinterpret_cast<uint32_t*>(ob + h_lo * kMlaDecodeLora + col0 + n * 8) =
            pack_bf16x2(o[n][0] * inv_lo, o[n][1] * inv_lo);
      if (h_hi < H)
        *reinterpret_cast<uint32_t*>(ob + h_hi * kMlaDecodeLora + col0 + n * 8) =
            pack_bf16x2(o[n][2] * inv_hi, o[n][3] * inv_hi);
    }
    return;
  }
  const int64_t base = (i * p.num_splits + split) * H;
  float* ob = p.part_o + base * kMlaDecodeLora;
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    if (h_lo < H)
      *reinterpret_cast<float2*>(ob + h_lo * kMlaDecodeLora + col0 + n * 8) =
          make_float2(o[n][0] * inv_lo, o[n][1] * inv_lo);
    if (h_hi < H)
      *reinterpret_cast<float2*>(ob + h_hi * kMlaDecodeLora + col0 + n * 8) =
          make_float2(o[n][2] * inv_hi, o[n][3] * inv_hi);
  }
  if (write_lse) {
    if (h_lo < H) p.part_lse[base + h_lo] = lse_lo;
    if (h_hi < H) p.part_lse[base + h_hi] = lse_hi;
  }
}

// One launch of the 64-head wgmma attention kernel (mla_decode_wgmma.cu) on
// `grid` (groups of 64 heads, splits, rows) for the slice params p
// (launch_mla_decode_attention checks them).
cudaError_t launch_attention_wgmma_slice(const MlaDecodeAttnParams& p, dim3 grid, cudaStream_t stream);

}  // namespace nucleus::kernels::mla_decode_detail
