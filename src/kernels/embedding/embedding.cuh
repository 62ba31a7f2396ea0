// CUDA embedding lookup into the f32 residual stream.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

// out[t, :] = f32(table[ids[t], :])
//   table: [vocab, hidden] bf16; ids: [num_tokens] int32 in [0, vocab) (the
//   engine validates); out: [num_tokens, hidden] f32. Stream-async, graph-safe.
cudaError_t launch_embedding(const __nv_bfloat16* table, int64_t hidden, const int32_t* ids, int64_t num_tokens,
                             float* out, cudaStream_t stream);


// Vocabulary-parallel lookup (tensor parallelism): this rank holds rows
// [vocab_start, vocab_start + shard_rows) of the table.
//   out[t, :] = f32(table[ids[t] - vocab_start, :]) when ids[t] is in that
//   range, else 0 (the all-reduce over the ranks then gives the full lookup).
//   table: [shard_rows, hidden] bf16; ids: [num_tokens] int32; out:
//   [num_tokens, hidden] f32. Stream-async, graph-safe.
cudaError_t launch_embedding_shard(const __nv_bfloat16* table, int64_t vocab_start, int64_t shard_rows,
                                   int64_t hidden, const int32_t* ids, int64_t num_tokens, float* out,
                                   cudaStream_t stream);

}  // namespace nucleus::kernels
