// How the nucleus MLA decode attention (kernels/mla/mla_decode.cuh) splits a
// row's keys over its KV splits, for host and device code alike: the
// attention kernels, the kernels that merge their splits (mla_decode_rows.cuh)
// and the decode programs' merge stage (kernels/mono/mono_program.h) compute
// it from the same arguments, so they agree on every row's split count.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define NUCLEUS_MLA_SPLIT_HD __host__ __device__
#else
#define NUCLEUS_MLA_SPLIT_HD
#endif

namespace nucleus::kernels {

// min_split_keys = kMlaDecodeSplitsAuto: each row's split count is computed
// on the device from its key count and the call's rows,
// s = round(sqrt(kMlaDecodeSplitCost * keys / rows)), within [1, num_splits]:
// the s minimising s-independent work + (keys / (32 s)) serial tiles a CTA *
// t_tile + rows * s partials * t_merge, with t_tile / (32 t_merge) = 0.54
// measured on the H200 (docs/perf.md "MLA decode: the split plan on the
// device": ~1.5 us a 32-key tile of 16 heads, ~0.09 us a partial merged).
constexpr int kMlaDecodeSplitsAuto = 0;
constexpr float kMlaDecodeSplitCost = 0.54f;

// Keys per split of a row with num_keys keys when the grid has num_splits
// splits and the call num_rows rows: a multiple of the launch's key tile
// (`tile`: 32, or 64 for the 64-key attention kernel).
//  - min_keys > 0 (the launch's min_split_keys, a multiple of the tile): the
//    even share of the grid's splits, at least min_keys;
//  - min_keys == 0 (kMlaDecodeSplitsAuto): the rule above.
NUCLEUS_MLA_SPLIT_HD inline int mla_split_chunk(int num_keys, int num_splits, int min_keys, int64_t num_rows,
                                                int tile) {
  int c;
  if (min_keys > 0) {
    c = (num_keys + num_splits - 1) / num_splits;
    c = c < min_keys ? min_keys : c;
  } else {
    const float want = sqrtf(kMlaDecodeSplitCost * static_cast<float>(num_keys) / static_cast<float>(num_rows));
#if defined(__CUDA_ARCH__)
    const int r = __float2int_rn(want);
#else
    const int r = static_cast<int>(std::nearbyint(want));  // round half to even, as __float2int_rn
#endif
    const int s = num_splits < (r > 1 ? r : 1) ? num_splits : (r > 1 ? r : 1);
    c = (num_keys + s - 1) / s;
  }
  return (c + tile - 1) / tile * tile;
}

// Splits a row with num_keys keys uses when the grid has num_splits.
NUCLEUS_MLA_SPLIT_HD inline int mla_split_count(int num_keys, int num_splits, int min_keys, int64_t num_rows,
                                                int tile) {
  const int chunk = mla_split_chunk(num_keys, num_splits, min_keys, num_rows, tile);
  return (num_keys + chunk - 1) / chunk;
}

}  // namespace nucleus::kernels
