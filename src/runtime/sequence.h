// Sequence: one request's state in the engine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/status.h"
#include "runtime/prompt_logprobs.h"
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
  // With params.prompt_logprobs: entry p scores prompt token p + 1 (from the
  // logits of position p); filled as prefill computes them, kept across
  // preemption.
  std::vector<TokenLogprobs> prompt_logprobs;
  // The penalties' history, kept as tokens are appended (append_output), not
  // recounted per step: occurrences of each generated id, and the prompt's
  // distinct ids (filled at admission when repetition_penalty != 1; empty:
  // the sampler reads prompt_token_ids).
  std::unordered_map<int32_t, int32_t> output_token_counts;
  std::vector<int32_t> distinct_prompt_ids;
  SamplingParams params;
  uint64_t seed = 0;  // params.seed, or one drawn at arrival
  SeqStatus status = SeqStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;

  // Speculative decoding: draft tokens proposed for positions num_tokens(),
  // num_tokens() + 1, ... (runtime/spec_decode.h); the next step verifies
  // them. Cleared when verified and on preemption.
  std::vector<int32_t> draft_token_ids;

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
  // Token i, or draft i - num_tokens() past the end (a step's query rows).
  int32_t token_or_draft_at(int64_t i) const {
    return i < num_tokens() ? token_at(i) : draft_token_ids[static_cast<size_t>(i - num_tokens())];
  }
  bool finished() const { return status == SeqStatus::kFinished; }
  // The positions in [begin, begin + num_new) whose logits score a prompt
  // token not yet in prompt_logprobs, as [first, last); empty (first ==
  // last) unless params.prompt_logprobs is set.
  std::pair<int64_t, int64_t> prompt_logprob_positions(int64_t begin, int64_t num_new) const {
    if (!params.prompt_logprobs) return {begin, begin};
    const int64_t first = std::max<int64_t>(begin, static_cast<int64_t>(prompt_logprobs.size()));
    const int64_t last = std::min(begin + num_new, num_prompt_tokens() - 1);
    return first < last ? std::pair<int64_t, int64_t>{first, last} : std::pair<int64_t, int64_t>{begin, begin};
  }
  // Prompt logprobs are asked for and not all computed yet.
  bool needs_prompt_logprobs() const {
    return params.prompt_logprobs && static_cast<int64_t>(prompt_logprobs.size()) < num_prompt_tokens() - 1;
  }

  // Appends a sampled token (with its logprobs) and counts it.
  void append_output(SampleResult r) {
    output_token_ids.push_back(r.token);
    ++output_token_counts[r.token];
    output_samples.push_back(std::move(r));
  }
  // The history the sampler's penalties and min_tokens read.
  SampleHistory sample_history(std::span<const int32_t> eos_ids) const {
    SampleHistory h;
    h.prompt_ids = distinct_prompt_ids.empty() ? std::span<const int32_t>(prompt_token_ids)
                                               : std::span<const int32_t>(distinct_prompt_ids);
    h.output_counts = &output_token_counts;
    h.eos_ids = eos_ids;
    return h;
  }
};

}  // namespace nucleus
