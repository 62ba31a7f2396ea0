// Device helpers the MLA decode kernels share (kernels/mla/mla_decode.cu and
// mla_decode_heads.cu): which query row a call's row i is, how many keys it
// sees, and how its keys are split over the grid's KV splits. Only for .cu
// files.
#pragma once

#include <cstdint>

#include "kernels/common/cuda_common.cuh"
#include "kernels/mla/mla_decode.cuh"

namespace nucleus::kernels::mla_decode_detail {

constexpr int kTileKeys = kMlaDecodeTileKeys;  // keys of one attention tile

// Keys per split of a row with num_keys keys when the grid has num_splits
// splits and the call num_rows rows: a multiple of the launch's key tile
// (`tile`: 32, or 64 for the 64-key attention kernel).
//  - min_keys > 0 (the launch's min_split_keys, a multiple of the tile): the
//    even share of the grid's splits, at least min_keys;
//  - min_keys == 0 (kMlaDecodeSplitsAuto): the split count s that balances a
//    split's serial tiles against the merge of rows * s partials,
//    s = round(sqrt(kMlaDecodeSplitCost * num_keys / num_rows)) within
//    [1, num_splits] (docs/perf.md "MLA decode: the split plan on the device").
// Every kernel of a call computes it from the same arguments.
__device__ __forceinline__ int row_chunk(int num_keys, int num_splits, int min_keys, int64_t num_rows, int tile) {
  int c;
  if (min_keys > 0) {
    c = (num_keys + num_splits - 1) / num_splits;
    c = c < min_keys ? min_keys : c;
  } else {
    const float want = sqrtf(kMlaDecodeSplitCost * static_cast<float>(num_keys) / static_cast<float>(num_rows));
    const int s = min(num_splits, max(1, __float2int_rn(want)));
    c = (num_keys + s - 1) / s;
  }
  return (c + tile - 1) / tile * tile;
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
  const int chunk = row_chunk(num_keys, num_splits, min_keys, num_rows, tile);
  return (num_keys + chunk - 1) / chunk;
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

}  // namespace nucleus::kernels::mla_decode_detail
