#include "kernels/embedding/embedding_ref.h"

#include <cstring>

#include "core/check.h"

namespace nucleus::kernels {

void embedding_ref(const float* table, int64_t vocab_size, int64_t hidden_size, const int32_t* ids,
                   int64_t num_tokens, float* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    NUCLEUS_CHECK(ids[t] >= 0 && ids[t] < vocab_size, "token id {} outside [0, {})", ids[t], vocab_size);
    std::memcpy(out + t * hidden_size, table + static_cast<int64_t>(ids[t]) * hidden_size, hidden_size * 4);
  }
}

void embedding_shard_ref(const float* table, int64_t vocab_start, int64_t shard_rows, int64_t hidden_size,
                         const int32_t* ids, int64_t num_tokens, float* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t local = static_cast<int64_t>(ids[t]) - vocab_start;
    float* o = out + t * hidden_size;
    if (local < 0 || local >= shard_rows) {
      std::memset(o, 0, hidden_size * 4);
      continue;
    }
    std::memcpy(o, table + local * hidden_size, hidden_size * 4);
  }
}

}  // namespace nucleus::kernels
