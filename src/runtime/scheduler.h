// Scheduler: continuous batching with chunked prefill and preemption by
// recompute.
//
// Each step gets a token budget (max_num_batched_tokens) and a sequence cap
// (max_num_seqs). Prefill and decode share a step (as in vLLM's v1
// scheduler): running sequences are served first, in arrival order — each
// decode takes one token, an unfinished prefill takes its next chunk —
// then waiting sequences are admitted in arrival order while budget and cap
// allow, their prompt chunked to what budget is left. A sequence computing
// prompt logprobs is also chunked to the step's prompt-logprob rows left
// (max_prompt_logprob_rows), and skipped for the step when none are left. Why share: a decode
// never waits behind a long prompt (TPOT stays flat under load), and a
// prompt longer than the budget still progresses every step. The cost is
// that a mixed step is not a pure-decode step (decode CUDA graphs apply only
// to pure-decode steps; mixed steps use the prefill path).
//
// Speculative decoding (vLLM's spec tokens): a running sequence's draft
// tokens (Sequence::draft_token_ids) are scheduled after its last token, in
// the token budget and with KV slots allocated, so a decode takes 1 + k
// rows; a budget that cuts them drops the drafts past it.
//
// When a running sequence needs a block and none is free, the most recently
// admitted running sequence is preempted: its blocks are freed, its progress
// reset, and it goes back to the front of the waiting queue; on readmission
// it recomputes prompt + generated tokens (reusing cached prefix blocks) and
// continues where it stopped. No sequence is admitted in a step that
// preempted. A sequence whose prompt + max_tokens cannot fit the whole pool
// is refused when added (LLMEngine::add_request), so nothing waits forever.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "runtime/block_manager.h"
#include "runtime/sequence.h"

namespace nucleus {

// Logit rows a step may compute for prompt logprobs (besides one sampling
// row per sequence): a prompt that asks for them is chunked to fit, which
// bounds the step's logits buffer ([rows, vocab] f32; 256 rows of
// DeepSeek-V3's 129,280 are 132 MB).
inline constexpr int64_t kMaxPromptLogprobRows = 256;

struct SchedulerConfig {
  int64_t max_num_batched_tokens = 8192;
  int64_t max_num_seqs = 256;
  int64_t max_prompt_logprob_rows = kMaxPromptLogprobRows;
};

struct ScheduledSeq {
  Sequence* seq = nullptr;
  int64_t num_new_tokens = 0;  // rows this step computes for the sequence
  // True when the step reaches the sequence's last token, so it yields logits
  // and samples a token.
  bool samples = false;
  // Speculative decoding: draft tokens among the num_new_tokens rows (the
  // last ones; each gives logits too), and how many of them the step
  // rejected (set by the engine before on_step_done: their KV rows are not
  // counted as computed and are overwritten later).
  int64_t num_draft_tokens = 0;
  int64_t num_rejected = 0;
};

struct SchedulerOutput {
  std::vector<ScheduledSeq> scheduled;  // running order
  std::vector<Sequence*> preempted;     // this step
  int64_t num_batched_tokens = 0;
  bool empty() const { return scheduled.empty(); }
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, BlockManager* blocks) : config_(config), blocks_(blocks) {}

  void add(Sequence* seq);
  // Plans the next step and allocates its KV slots.
  SchedulerOutput schedule();
  // After the step ran: advances every scheduled sequence's computed tokens
  // (num_new_tokens - num_rejected) and enters newly full blocks into the
  // prefix cache. Sampling and stop
  // checks are the engine's.
  void on_step_done(const SchedulerOutput& out);
  // Finishes a sequence (any state): frees its blocks, drops it from the queues.
  void finish(Sequence* seq, FinishReason reason);

  const std::deque<Sequence*>& waiting() const { return waiting_; }
  const std::vector<Sequence*>& running() const { return running_; }
  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }

 private:
  void preempt(Sequence* seq);

  SchedulerConfig config_;
  BlockManager* blocks_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;
};

}  // namespace nucleus
