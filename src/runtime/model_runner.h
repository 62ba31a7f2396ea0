// ModelRunner: turns a scheduled step into the model's StepInputs (token ids,
// positions, slot mapping, block tables, query and context lengths, logit
// rows), runs the forward and returns the logits of the sampling rows.
#pragma once

#include <memory>

#include "runtime/model_executor.h"
#include "runtime/device_sampler.h"
#include "runtime/grammar_mask.h"
#include "runtime/sampler.h"
#include "runtime/scheduler.h"

namespace nucleus {

// Packs `out` (block size `block_size`). Logit rows are the last row of each
// scheduled sequence with samples == true (with drafts: its last
// 1 + num_draft_tokens rows, in position order), in scheduled order, then the
// rows of prompt_logprob_rows(out), in its order. Query rows past a
// sequence's tokens are its drafts (Sequence::token_or_draft_at).
StepInputs pack_step_inputs(const SchedulerOutput& out, int64_t block_size);

// A step's rows whose logits score prompt tokens (sequences with
// params.prompt_logprobs): the position of each, by scheduled sequence then
// position, with the sequence whose prompt_logprobs entry it fills.
struct PromptLogprobRow {
  Sequence* seq = nullptr;
  int64_t position = 0;  // the row scores prompt token position + 1
  int32_t row = 0;       // the step's row (index into its tokens)
};
std::vector<PromptLogprobRow> prompt_logprob_rows(const SchedulerOutput& out);

// The limits a runner is sized for: the engine's scheduling limits and the
// KV pool's memory.
struct RunnerLimits {
  int64_t block_size = 64;
  int64_t num_kv_blocks = 0;  // 0: derived from memory (see ModelRunner::create)
  double gpu_memory_utilization = 0.9;
  int64_t max_num_batched_tokens = 8192;
  int64_t max_num_seqs = 256;
  int64_t max_model_len = 0;  // > 0
  // Bytes a token takes in caches beside the model's (the MTP module's), so
  // the pool is sized for both (ModelRunner::create).
  int64_t extra_kv_bytes_per_token = 0;
  // Speculative decoding's drafts a sequence may verify in a step: each
  // takes a logit row (the step buffers are reserved for them).
  int64_t num_speculative_tokens = 0;
};

class ModelRunner {
 public:
  // The start-up sequence, run once in this order:
  //   1. step buffers, metadata uploads and op workspaces reserved for the
  //      limits (CUDA), so their memory is taken before the pool is sized;
  //   2. the decode and token graphs captured against a one-block cache to
  //      measure their memory, then dropped (CUDA, graphs on);
  //   3. the pool size: limits.num_kv_blocks, or on CUDA what
  //      gpu_memory_utilization leaves after weights, buffers, graphs and a
  //      margin for scratch allocated on first use (cuBLASLt, expanded
  //      attention); on the CPU 16 sequences of max_model_len, capped at half
  //      the available host memory;
  //   4. the pool allocated;
  //   5. the graphs captured against the pool (whose addresses they keep).
  // Errors: a pool of no block (kResourceExhausted, naming the memory), a
  // CPU pool larger than the host memory, an op failing in a warm-up step or
  // a capture.
  static StatusOr<std::unique_ptr<ModelRunner>> create(ModelExecutor* model, const RunnerLimits& limits);
  ModelRunner(ModelExecutor* model, KvCache kv_cache) : model_(model), kv_cache_(std::move(kv_cache)) {}

  // Runs the step; returns logits [num sampling sequences, vocab] f32 (host).
  StatusOr<Tensor> execute(const SchedulerOutput& out);
  // Runs the step and samples one token for every scheduled sequence with
  // samples == true, in scheduled order: on the device (one sync) on CUDA,
  // with the CPU sampler otherwise. Appends the prompt logprobs the step
  // computed to their sequences' prompt_logprobs (on the host: the rows are
  // copied back, at most SchedulerConfig::max_prompt_logprob_rows a step).
  // Rows whose params adjust the logits (penalties, logit_bias, min_tokens,
  // min_p) get their sparse adjustment lists from the sequences' histories.
  StatusOr<std::vector<SampleResult>> execute_and_sample(const SchedulerOutput& out);
  // Speculative decoding: runs the step and, for every scheduled sequence
  // with samples == true, samples each of its 1 + num_draft_tokens rows as
  // sample_token would at that output index (the penalties and min_tokens
  // of row j see drafts 1..j as generated; on CUDA the device sampler, else
  // the host) and accepts draft j while row j's sample equals it: the
  // rejection rule for a one-token drafter (exact for greedy and sampling;
  // a seeded request's tokens are those it gets without drafts). Returns,
  // per such sequence in scheduled order, the accepted drafts then the
  // target's own token: the first rejected draft's replacement, or the
  // bonus token from the last row when all were accepted (1 ..
  // num_draft_tokens + 1 tokens). Prompt logprobs as execute_and_sample.
  // Structured output is refused earlier (add_request).
  StatusOr<std::vector<std::vector<SampleResult>>> execute_and_verify(const SchedulerOutput& out);
  // The model's EOS ids, masked under min_tokens (with each request's stop_token_ids).
  void set_eos_token_ids(std::vector<int32_t> ids) { eos_token_ids_ = std::move(ids); }

  // Host wall time of execute_and_sample's phases, summed over its calls.
  struct HostTimes {
    double inputs_s = 0;   // the step's inputs packed on the host (pack_step_inputs)
    double forward_s = 0;  // forward_logits: inputs uploaded, the step's ops or graph launched (on
                           // CUDA the call returns once the work is queued, before it has run)
    double sample_s = 0;   // prompt logprobs, logit processors and sampling; on CUDA it includes
                           // the wait for the step's kernels (the sampler's result copy syncs)
  };
  const HostTimes& host_times() const { return host_times_; }

  KvCache& kv_cache() { return kv_cache_; }
  // While set, every step records what it touched into *stats (slower: syncs).
  void set_stats(StepStats* stats) { stats_ = stats; }
  ModelExecutor& model() { return *model_; }

 private:
  ModelExecutor* model_;
  KvCache kv_cache_;
  StepStats* stats_ = nullptr;
  std::unique_ptr<DeviceSampler> device_sampler_;
  std::vector<int32_t> eos_token_ids_;
  std::unique_ptr<TokenAdjustmentBuilder> adjust_builder_;  // created on the first row that needs it
  std::vector<TokenAdjustment> adjustments_;                // this step's lists, rows back to back
  GrammarMasker grammar_masker_;  // structured output: masks rows before sampling
  HostTimes host_times_;
};

}  // namespace nucleus
