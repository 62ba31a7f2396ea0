// Tensor-parallel sharding of checkpoint tensors at load (design.md, "Tensor
// parallelism"; docs/tp.md). With n ranks, rank r holds:
//
//   tensor                                   split   rank r's part
//   embed_tokens, lm_head      [V, H]        rows    vocabulary rows [r V/n, (r+1) V/n)
//   q_b_proj (q_proj)          [nh*192, *]   rows    its nh/n heads (column-parallel)
//   kv_b_proj                  [nh*256, 512] rows    its nh/n heads (column-parallel)
//   o_proj                     [H, nh*128]   cols    its heads' inputs (row-parallel)
//   gate_proj, up_proj         [I, H]        rows    intermediate slice [r I/n, (r+1) I/n)
//   down_proj                  [H, I]        cols    the same slice (row-parallel)
//     (the dense MLP, every routed expert and the shared experts alike)
//   q_a_proj, kv_a_proj_with_mqa, every norm, the router and its
//   e_score_correction_bias: replicated (MLA's latent is shared by all heads,
//   so every rank keeps the whole latent KV cache).
//
// An FP8 weight's weight_scale_inv [ceil(N/128), ceil(K/128)] is sliced with
// it: the blocks that cover the rank's rows or columns. A shard boundary
// inside a 128-block is an error: that block's one scale would straddle two
// ranks, and the kernels find a row's scale as local_row / 128.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "core/status.h"
#include "core/tensor.h"
#include "io/hf_config.h"

namespace nucleus {

// Which rank of how many a model (or a load) is for.
struct TpShard {
  int rank = 0;
  int world_size = 1;
};

// How a 2-D tensor is split across the ranks.
enum class ShardSplit {
  kReplicated,  // every rank holds all of it
  kRows,        // dim 0 (out features of a linear; the vocabulary of a table)
  kCols,        // dim 1 (in features of a linear)
};

// Rank shard.rank's part [begin, end) of a dimension of `size` cut into
// shard.world_size equal parts. Error (naming `what`): size not divisible.
StatusOr<std::pair<int64_t, int64_t>> shard_range(int64_t size, const TpShard& shard, const std::string& what);

// A contiguous host copy of rows (kRows) or columns (kCols) [begin, end) of
// the 2-D host tensor `t` (any dtype); kReplicated returns `t` itself.
Tensor slice_host(const Tensor& t, ShardSplit split, int64_t begin, int64_t end);

// The blocks of an FP8 block scale ([ceil(N / block), ceil(K / block)] along
// the split dimension) that cover weight rows (kRows) or columns (kCols)
// [begin, end) of a dimension of `size`. Errors (naming `name`, the boundary,
// the block and the tensor-parallel sizes whose shards are whole blocks):
// begin, or end before `size`, not a multiple of `block`.
StatusOr<Tensor> slice_block_scale(const Tensor& scale, ShardSplit split, int64_t begin, int64_t end, int64_t size,
                                   int64_t block, int world_size, const std::string& name);

// Whether `config` can be split `world_size` ways: attention heads,
// intermediate_size, moe_intermediate_size (and the shared experts' width)
// and vocab_size divisible by it. Errors name the field and the sizes that
// divide every split dimension.
Status check_tp_config(const ModelConfig& config, int world_size);

}  // namespace nucleus
