#include "runtime/sampling_params.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace nucleus {

Status SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || std::isinf(temperature))
    return invalid_argument("temperature must be a finite number >= 0, got " + std::to_string(temperature));
  if (!(top_p > 0.0f && top_p <= 1.0f))
    return invalid_argument("top_p must be in (0, 1], got " + std::to_string(top_p));
  if (max_tokens < 1) return invalid_argument("max_tokens must be >= 1, got " + std::to_string(max_tokens));
  if (top_k < -1) return invalid_argument("top_k must be -1 or 0 (all tokens) or positive, got " + std::to_string(top_k));
  if (logprobs < 0 || logprobs > 20)
    return invalid_argument("logprobs must be in [0, 20], got " + std::to_string(logprobs));
  if (prompt_logprobs && (*prompt_logprobs < 0 || *prompt_logprobs > 20))
    return invalid_argument("prompt_logprobs must be in [0, 20], got " + std::to_string(*prompt_logprobs));
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    return invalid_argument("presence_penalty must be in [-2, 2], got " + std::to_string(presence_penalty));
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
    return invalid_argument("frequency_penalty must be in [-2, 2], got " + std::to_string(frequency_penalty));
  // vLLM takes any value > 0; past [1e-4, 1e4] a penalised logit overflows
  // f32 (l / rp or l * rp becomes +-inf) and the row cannot be sampled.
  if (!(repetition_penalty >= 1e-4f && repetition_penalty <= 1e4f))
    return invalid_argument(fmt::format("repetition_penalty must be in [1e-4, 1e4], got {}", repetition_penalty));
  if (!(min_p >= 0.0f && min_p <= 1.0f))
    return invalid_argument("min_p must be in [0, 1], got " + std::to_string(min_p));
  if (min_tokens < 0) return invalid_argument("min_tokens must be >= 0, got " + std::to_string(min_tokens));
  if (min_tokens > max_tokens)
    return invalid_argument("min_tokens (" + std::to_string(min_tokens) + ") must be <= max_tokens (" +
                            std::to_string(max_tokens) + ")");
  std::vector<int32_t> ids;
  ids.reserve(logit_bias.size());
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0) return invalid_argument("logit_bias token id " + std::to_string(id) + " is negative");
    if (!(bias >= -100.0f && bias <= 100.0f))
      return invalid_argument("logit_bias for token id " + std::to_string(id) + " must be in [-100, 100], got " +
                              std::to_string(bias));
    ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  if (auto it = std::adjacent_find(ids.begin(), ids.end()); it != ids.end())
    return invalid_argument("logit_bias lists token id " + std::to_string(*it) + " twice");
  return ok_status();
}

bool SamplingParams::adjusts_logits(int64_t output_index) const {
  return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f || !logit_bias.empty() ||
         output_index < min_tokens || (min_p > 0.0f && temperature != 0.0f);
}

}  // namespace nucleus
