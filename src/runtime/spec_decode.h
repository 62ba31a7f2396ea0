// Speculative decoding with DeepSeek-V3's multi-token-prediction (MTP) module
// (design.md "Speculative decoding (MTP)"; vLLM's deepseek_mtp method).
//
// After every target step the MTP module runs over the positions the step
// computed (prefill chunks too, so its own paged cache stays complete): row
// i reads the target's final-normed hidden state h_i and the embedding of
// t_{i+1}, sits at rotary position i and in position i's KV slot, and its
// logits predict t_{i+2}. At a running sequence's last computed position
// that is the first draft d_1 (the argmax: drafts are deterministic); the
// module chained on its own pre-norm output gives d_2 .. d_k. The next step
// verifies [t_last, d_1 .. d_k] as k + 1 query rows (Scheduler), accepts
// the longest prefix the target agrees with plus one token of its own
// (ModelRunner::execute_and_verify: exact for greedy and sampling alike), and counts the
// rejected rows as never computed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/device_sampler.h"

#include "core/status.h"
#include "runtime/block_manager.h"
#include "runtime/model_executor.h"
#include "runtime/sequence.h"

namespace nucleus {

// --speculative-config, vLLM's JSON: {"method": "deepseek_mtp",
// "num_speculative_tokens": N}.
struct SpeculativeConfig {
  std::string method;                  // "deepseek_mtp" (vLLM's "mtp" is read as it)
  int64_t num_speculative_tokens = 0;  // k draft tokens a step, 1..kMaxSpeculativeTokens; 0: off
  bool enabled() const { return num_speculative_tokens > 0; }
};
inline constexpr int64_t kMaxSpeculativeTokens = 3;

// Parses --speculative-config's JSON. Errors (kInvalidArgument or
// kUnsupported, naming the field): not a JSON object, a method other than
// deepseek_mtp / mtp, num_speculative_tokens missing or outside 1..3, a key
// nucleus does not serve (vLLM's model, draft_tensor_parallel_size, ...).
StatusOr<SpeculativeConfig> parse_speculative_config(const std::string& json_text);

// Acceptance counters, as vLLM's spec_decode metrics: verify steps of a
// sequence with drafts, drafts proposed, drafts accepted, and accepted
// drafts by position (index j: the (j+1)-th draft of a step).
struct SpecDecodeStats {
  int64_t num_drafts = 0;
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_tokens = 0;
  std::vector<int64_t> accepted_per_pos;  // [num_speculative_tokens]
  // Wall time of the engine's speculative steps, split: the target step
  // (verify rows, its logits on the host, acceptance) and the MTP passes
  // (hidden states gathered, the MTP layer run once per draft position).
  int64_t num_steps = 0;
  double target_seconds = 0;
  double mtp_seconds = 0;
  // Tokens a verify step yields on average: 1 + accepted / drafts.
  double mean_acceptance_length() const {
    return num_drafts > 0 ? 1.0 + static_cast<double>(num_accepted_tokens) / num_drafts : 0.0;
  }
  double acceptance_rate() const {
    return num_draft_tokens > 0 ? static_cast<double>(num_accepted_tokens) / num_draft_tokens : 0.0;
  }
};

// "N drafts, M draft tokens, A accepted (rate r), mean acceptance length L,
// accepted by position a_1/a_2/..." for logs and benchmark output.
std::string spec_decode_summary(const SpecDecodeStats& s);

// One sequence's part of an MTP pass: the positions [first_position,
// first_position + num_rows) the target computed this step, whose hidden
// states are the target step's rows [target_row, target_row + num_rows);
// with `draft`, drafts are proposed after them (up to max_drafts).
struct MtpRows {
  Sequence* seq = nullptr;
  int64_t first_position = 0;
  int64_t num_rows = 0;
  int64_t target_row = 0;
  bool draft = false;
  int64_t max_drafts = 0;
};

// Runs the MTP module after a target step and sets the drafts
// (Sequence::draft_token_ids) of the rows with `draft`.
class MtpProposer {
 public:
  MtpProposer(ModelExecutor* model, KvCache mtp_cache, int64_t num_speculative_tokens)
      : model_(model), cache_(std::move(mtp_cache)), k_(num_speculative_tokens) {}

  // `rows`: every sequence the target step computed rows for (and still
  // running). Chained drafts write the MTP cache at positions past the
  // sequence's last token: their blocks are allocated through `blocks` when
  // free, else the chain stops at the table's end. Errors: what the MTP
  // forward reported (naming the op).
  Status propose(const std::vector<MtpRows>& rows, BlockManager& blocks);

  KvCache& cache() { return cache_; }

 private:
  // The argmax of each of the first n rows of `logits` ([>= n, vocab] f32;
  // the first maximum): on CUDA by the device sampler's greedy rows (only
  // the ids come back), else on the host.
  StatusOr<std::vector<int32_t>> argmax_rows(const Tensor& logits, int64_t n);

  ModelExecutor* model_;
  KvCache cache_;
  int64_t k_;
  std::unique_ptr<DeviceSampler> sampler_;  // CUDA: the drafts' argmaxes
};

}  // namespace nucleus
