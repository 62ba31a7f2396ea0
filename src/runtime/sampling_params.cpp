#include "runtime/sampling_params.h"

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
  return ok_status();
}

}  // namespace nucleus
