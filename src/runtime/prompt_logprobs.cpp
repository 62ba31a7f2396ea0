#include "runtime/prompt_logprobs.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

namespace nucleus {

TokenLogprobs token_logprobs(const float* logits, int64_t vocab, int32_t token, int32_t top_n) {
  NUCLEUS_CHECK(token >= 0 && token < vocab && top_n >= 0, "token {} of vocabulary {}, top {}", token, vocab, top_n);
  const float mx = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(logits[i] - mx);
  const double log_z = mx + std::log(sum);
  TokenLogprobs r;
  r.token = token;
  r.logprob = static_cast<float>(logits[token] - log_z);
  r.rank = 1;
  for (int64_t i = 0; i < vocab; ++i) r.rank += logits[i] > logits[token];
  const int64_t n = std::min<int64_t>(top_n, vocab);
  if (n > 0) {
    std::vector<int32_t> idx(vocab);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int64_t i = 0; i < n; ++i) r.top.emplace_back(idx[i], static_cast<float>(logits[idx[i]] - log_z));
  }
  return r;
}

}  // namespace nucleus
