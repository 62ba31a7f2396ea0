#include "runtime/model_runner.h"

#include <algorithm>

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

}  // namespace nucleus
