#include "runtime/model_runner.h"

#include <algorithm>

#include "core/device.h"

#include "core/check.h"

namespace nucleus {

StepInputs pack_step_inputs(const SchedulerOutput& out, int64_t block_size) {
  StepInputs in;
  int32_t max_blocks = 0;
  for (const auto& s : out.scheduled) max_blocks = std::max<int32_t>(max_blocks, s.seq->block_table.size());
  in.max_blocks_per_seq = max_blocks;
  in.query_start.push_back(0);
  for (const auto& s : out.scheduled) {
    const Sequence& seq = *s.seq;
    const int64_t begin = seq.num_computed_tokens;
    NUCLEUS_CHECK(static_cast<int64_t>(seq.block_table.size()) * block_size >= begin + s.num_new_tokens,
                  "sequence {} has {} blocks for {} tokens", seq.seq_id, seq.block_table.size(),
                  begin + s.num_new_tokens);
    for (int64_t i = 0; i < s.num_new_tokens; ++i) {
      const int64_t pos = begin + i;
      in.token_ids.push_back(seq.token_at(pos));
      in.positions.push_back(static_cast<int32_t>(pos));
      in.slot_mapping.push_back(static_cast<int64_t>(seq.block_table[pos / block_size]) * block_size +
                                pos % block_size);
    }
    in.query_start.push_back(static_cast<int32_t>(in.token_ids.size()));
    in.context_lens.push_back(static_cast<int32_t>(begin));
    for (int32_t b = 0; b < max_blocks; ++b)
      in.block_tables.push_back(b < static_cast<int32_t>(seq.block_table.size()) ? seq.block_table[b] : -1);
    if (s.samples) in.logit_indices.push_back(in.query_start.back() - 1);
  }
  return in;
}

StatusOr<Tensor> ModelRunner::execute(const SchedulerOutput& out) {
  StepInputs in = pack_step_inputs(out, kv_cache_.block_size);
  return model_->forward(in, kv_cache_, stats_);
}

StatusOr<std::vector<SampleResult>> ModelRunner::execute_and_sample(const SchedulerOutput& out) {
  StepInputs in = pack_step_inputs(out, kv_cache_.block_size);
  NUCLEUS_ASSIGN_OR_RETURN(Tensor logits, model_->forward_logits(in, kv_cache_, stats_));
  const int64_t vocab = model_->config().vocab_size;
  std::vector<const Sequence*> rows;
  for (const auto& s : out.scheduled)
    if (s.samples) rows.push_back(s.seq);
  grammar_masker_.apply(rows, logits.data<float>(), vocab, logits.device());
  std::vector<SampleResult> results;
  if (logits.device() == Device::kCuda) {
    if (!device_sampler_ || device_sampler_->max_rows() < static_cast<int64_t>(rows.size())) {
      NUCLEUS_ASSIGN_OR_RETURN(device_sampler_,
                               DeviceSampler::create(std::max<int64_t>(256, static_cast<int64_t>(rows.size())), vocab));
    }
    std::vector<DeviceSampleRequest> requests;
    for (const Sequence* seq : rows)
      requests.push_back(make_device_sample_request(seq->params, seq->seed, seq->num_output_tokens()));
    return device_sampler_->sample(logits.data<float>(), requests);
  }
  for (size_t i = 0; i < rows.size(); ++i)
    results.push_back(sample_token(logits.data<float>() + static_cast<int64_t>(i) * vocab, vocab, rows[i]->params,
                                   rows[i]->seed, rows[i]->num_output_tokens()));
  return results;
}

}  // namespace nucleus
