// ModelRunner: turns a scheduled step into the model's StepInputs (token ids,
// positions, slot mapping, block tables, query and context lengths, logit
// rows), runs the forward and returns the logits of the sampling rows.
#pragma once

#include <memory>

#include "model/deepseek/deepseek_model.h"
#include "runtime/device_sampler.h"
#include "runtime/grammar_mask.h"
#include "runtime/sampler.h"
#include "runtime/scheduler.h"

namespace nucleus {

// Packs `out` (block size `block_size`). Logit rows are the last row of each
// scheduled sequence with samples == true, in scheduled order, then the rows
// of prompt_logprob_rows(out), in its order.
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

class ModelRunner {
 public:
  ModelRunner(DeepseekModel* model, KvCache kv_cache) : model_(model), kv_cache_(std::move(kv_cache)) {}

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
  // The model's EOS ids, masked under min_tokens (with each request's stop_token_ids).
  void set_eos_token_ids(std::vector<int32_t> ids) { eos_token_ids_ = std::move(ids); }

  KvCache& kv_cache() { return kv_cache_; }
  // While set, every step records what it touched into *stats (slower: syncs).
  void set_stats(StepStats* stats) { stats_ = stats; }
  DeepseekModel& model() { return *model_; }

 private:
  DeepseekModel* model_;
  KvCache kv_cache_;
  StepStats* stats_ = nullptr;
  std::unique_ptr<DeviceSampler> device_sampler_;
  std::vector<int32_t> eos_token_ids_;
  std::unique_ptr<TokenAdjustmentBuilder> adjust_builder_;  // created on the first row that needs it
  std::vector<TokenAdjustment> adjustments_;                // this step's lists, rows back to back
  GrammarMasker grammar_masker_;  // structured output: masks rows before sampling
};

}  // namespace nucleus
