// When the fused all-reduce + residual add + RMSNorm kernel serves a step
// instead of NCCL's all-reduce followed by the add+norm kernel. Device-
// independent (the CPU tests check the rule); the CUDA backend
// (ops/collective_ops_cuda.cpp) applies it per step. The choice depends on
// the step's shape only, so every rank makes the same one.
#pragma once

#include <cstdint>

namespace nucleus {

// Whether the fused kernel takes a step of `rows` rows of a `width`-wide
// delta of `delta_bytes` per rank (rows * width * 2, or * 4 for the f32
// delta of a split-K GEMM) on `world_size` ranks. `max_bytes_override` >= 0
// (NUCLEUS_FUSED_ALLREDUCE_MAX_BYTES) replaces the rule by a byte limit alone.
//
// At 2 ranks, measured on two H200 with NVLink (allreduce_norm_bench,
// docs/perf.md "Tensor parallelism on 2 GPUs"): at hidden 2048 the fused
// kernel is 1.07-1.16x faster up to 16 tokens and even up to 128; at hidden
// 7168 it is 0.77-0.90x up to 32 tokens (one CTA per row waits on remote
// 7168-wide rows) and 1.03-1.29x at 64 and 128. So: widths up to 4096 up to
// 1 MiB; wider ones from 64 rows, up to 4 MiB. At 3 to 8 ranks (not
// measured): vLLM's one-shot limits, 512 KiB at 3-4, 256 KiB at 5-8.
inline bool fused_allreduce_chosen(int world_size, int64_t rows, int64_t width, int64_t delta_bytes,
                                   int64_t max_bytes_override = -1) {
  if (max_bytes_override >= 0) return delta_bytes <= max_bytes_override;
  if (world_size <= 2) {
    if (width <= 4096) return delta_bytes <= (int64_t{1} << 20);
    return rows >= 64 && delta_bytes <= (int64_t{4} << 20);
  }
  return delta_bytes <= (world_size <= 4 ? int64_t{512} << 10 : int64_t{256} << 10);
}

}  // namespace nucleus
