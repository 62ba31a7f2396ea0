// CPU reference embedding lookup.
#pragma once

#include <cstdint>

namespace nucleus::kernels {

// out[t, :] = table[ids[t], :]
//   table: [vocab_size, hidden_size] f32; ids: [num_tokens] int32, each in
//   [0, vocab_size) (validated by the caller); out: [num_tokens, hidden_size].
void embedding_ref(const float* table, int64_t vocab_size, int64_t hidden_size, const int32_t* ids,
                   int64_t num_tokens, float* out);


// Vocabulary-parallel lookup (tensor parallelism): this rank holds rows
// [vocab_start, vocab_start + shard_rows) of the table.
//   out[t, :] = table[ids[t] - vocab_start, :] for ids[t] in that range, else 0.
//   table: [shard_rows, hidden_size] f32; out: [num_tokens, hidden_size] f32.
void embedding_shard_ref(const float* table, int64_t vocab_start, int64_t shard_rows, int64_t hidden_size,
                         const int32_t* ids, int64_t num_tokens, float* out);

}  // namespace nucleus::kernels
