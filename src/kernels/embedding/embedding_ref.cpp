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

}  // namespace nucleus::kernels
