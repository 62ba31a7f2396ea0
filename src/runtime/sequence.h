// Sequence: one request's state in the engine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "runtime/sampler.h"
#include "runtime/sampling_params.h"

namespace nucleus {

class GrammarMatcher;  // runtime/structured_output.h

enum class SeqStatus { kWaiting, kRunning, kFinished };
enum class FinishReason { kNone, kStop, kLength, kAbort, kError };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort", "error", ""

struct Sequence {
  int64_t seq_id = 0;
  std::string request_id;
  std::vector<int32_t> prompt_token_ids;
  std::vector<int32_t> output_token_ids;
  std::vector<SampleResult> output_samples;  // parallel to output_token_ids (logprobs)
  SamplingParams params;
  uint64_t seed = 0;  // params.seed, or one drawn at arrival
  SeqStatus status = SeqStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;

  // KV cache: blocks holding the sequence's rows, in position order.
  std::vector<int32_t> block_table;
  // Tokens whose KV rows are in the cache (prefix-cache hits included).
  int64_t num_computed_tokens = 0;
  // Chained prefix-cache hashes of the sequence's full blocks computed so far.
  std::vector<uint64_t> block_hashes;
  int64_t num_cached_prompt_tokens = 0;  // prefix-cache hit at the last admission
  int64_t num_preemptions = 0;
  double arrival_time = 0.0;  // seconds, steady clock
  double first_token_time = 0.0;
  // With params.grammar: where the output stands in it (masks the logits of
  // each step, advanced by each sampled token).
  std::shared_ptr<GrammarMatcher> grammar_matcher;

  int64_t num_prompt_tokens() const { return static_cast<int64_t>(prompt_token_ids.size()); }
  int64_t num_output_tokens() const { return static_cast<int64_t>(output_token_ids.size()); }
  int64_t num_tokens() const { return num_prompt_tokens() + num_output_tokens(); }
  int32_t token_at(int64_t i) const {
    return i < num_prompt_tokens() ? prompt_token_ids[i] : output_token_ids[i - num_prompt_tokens()];
  }
  bool finished() const { return status == SeqStatus::kFinished; }
};

}  // namespace nucleus
