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
// scheduled sequence with samples == true, in scheduled order.
StepInputs pack_step_inputs(const SchedulerOutput& out, int64_t block_size);

class ModelRunner {
 public:
  ModelRunner(DeepseekModel* model, KvCache kv_cache) : model_(model), kv_cache_(std::move(kv_cache)) {}

  // Runs the step; returns logits [num sampling sequences, vocab] f32 (host).
  StatusOr<Tensor> execute(const SchedulerOutput& out);
  // Runs the step and samples one token for every scheduled sequence with
  // samples == true, in scheduled order: on the device (one sync) on CUDA,
  // with the CPU sampler otherwise.
  StatusOr<std::vector<SampleResult>> execute_and_sample(const SchedulerOutput& out);

  KvCache& kv_cache() { return kv_cache_; }
  // While set, every step records what it touched into *stats (slower: syncs).
  void set_stats(StepStats* stats) { stats_ = stats; }
  DeepseekModel& model() { return *model_; }

 private:
  DeepseekModel* model_;
  KvCache kv_cache_;
  StepStats* stats_ = nullptr;
  std::unique_ptr<DeviceSampler> device_sampler_;
  GrammarMasker grammar_masker_;  // structured output: masks rows before sampling
};

}  // namespace nucleus
