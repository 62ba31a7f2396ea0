#include "runtime/model_runner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include "core/check.h"
#include "core/device.h"
#include "core/logging.h"

namespace nucleus {

std::vector<PromptLogprobRow> prompt_logprob_rows(const SchedulerOutput& out) {
  std::vector<PromptLogprobRow> rows;
  int32_t start = 0;  // the sequence's first row in the step
  for (const auto& s : out.scheduled) {
    const int64_t begin = s.seq->num_computed_tokens;
    const auto [first, last] = s.seq->prompt_logprob_positions(begin, s.num_new_tokens);
    for (int64_t p = first; p < last; ++p) rows.push_back({s.seq, p, static_cast<int32_t>(start + p - begin)});
    start += static_cast<int32_t>(s.num_new_tokens);
  }
  return rows;
}

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
      in.token_ids.push_back(seq.token_or_draft_at(pos));
      in.positions.push_back(static_cast<int32_t>(pos));
      in.slot_mapping.push_back(static_cast<int64_t>(seq.block_table[pos / block_size]) * block_size +
                                pos % block_size);
    }
    in.query_start.push_back(static_cast<int32_t>(in.token_ids.size()));
    in.context_lens.push_back(static_cast<int32_t>(begin));
    for (int32_t b = 0; b < max_blocks; ++b)
      in.block_tables.push_back(b < static_cast<int32_t>(seq.block_table.size()) ? seq.block_table[b] : -1);
    if (s.samples)  // the last token's row and each draft's (speculative decoding)
      for (int64_t d = s.num_draft_tokens; d >= 0; --d) in.logit_indices.push_back(in.query_start.back() - 1 - d);
  }
  for (const auto& r : prompt_logprob_rows(out)) in.logit_indices.push_back(r.row);
  return in;
}

namespace {
// Fills the sequences' prompt_logprobs from logits rows [num_samples, ...),
// the rows of prompt_logprob_rows(out).
Status score_prompt_rows(const SchedulerOutput& out, const Tensor& logits, int64_t num_samples, int64_t vocab) {
  const std::vector<PromptLogprobRow> rows = prompt_logprob_rows(out);
  if (rows.empty()) return ok_status();
  Tensor scored = logits.rows(num_samples, static_cast<int64_t>(rows.size()));
  if (scored.device() == Device::kCuda) scored = to_host(scored);
  for (size_t i = 0; i < rows.size(); ++i) {
    Sequence& seq = *rows[i].seq;
    NUCLEUS_CHECK(static_cast<int64_t>(seq.prompt_logprobs.size()) == rows[i].position,
                  "sequence {} scores position {} with {} prompt logprobs", seq.seq_id, rows[i].position,
                  seq.prompt_logprobs.size());
    seq.prompt_logprobs.push_back(token_logprobs(scored.data<float>() + static_cast<int64_t>(i) * vocab, vocab,
                                                 seq.prompt_token_ids[rows[i].position + 1],
                                                 *seq.params.prompt_logprobs));
  }
  return ok_status();
}
}  // namespace

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(bytes) / double(1ull << 30));
  return buf;
}
}  // namespace

StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::create(ModelExecutor* model, const RunnerLimits& limits) {
  RunnerLimits l = limits;
  const int64_t block_bytes = (model->kv_bytes_per_token() + l.extra_kv_bytes_per_token) * l.block_size;
  const bool cuda = model->options().device == Device::kCuda;
  const bool graphs = cuda && !model->options().cuda_graph_sizes.empty();
  size_t graph_bytes = 0;
  if (cuda) {
    // 1. Step buffers and uploads. A prefill step's logit rows: one per
    // sequence and the prompt-logprob rows.
    model->set_max_blocks_per_seq((l.max_model_len + l.block_size - 1) / l.block_size);
    model->reserve_step_buffers(
        l.max_num_batched_tokens, l.max_num_seqs,
        std::min(l.max_num_batched_tokens, l.max_num_seqs * (1 + l.num_speculative_tokens) + kMaxPromptLogprobRows));
    // 2. What the graphs take, against a one-block cache.
    if (graphs) {
      KvCache probe = model->make_kv_cache(1, l.block_size);
      NUCLEUS_ASSIGN_OR_RETURN(graph_bytes, model->capture_decode_graphs(probe));
      model->drop_graphs();
    }
    // 3. The pool takes what gpu_memory_utilization leaves.
    if (l.num_kv_blocks == 0) {
      constexpr size_t kScratchMargin = 1ull << 30;
      size_t free_bytes = 0, total_bytes = 0;
      device_memory_info(&free_bytes, &total_bytes);
      const double budget = l.gpu_memory_utilization * static_cast<double>(total_bytes) -
                            static_cast<double>(total_bytes - free_bytes) - static_cast<double>(kScratchMargin) -
                            static_cast<double>(graph_bytes);
      l.num_kv_blocks = static_cast<int64_t>(budget / static_cast<double>(block_bytes));
      if (l.num_kv_blocks < 1)
        return resource_exhausted("--gpu-memory-utilization " + std::to_string(l.gpu_memory_utilization) +
                                  " leaves no room for the KV cache after the weights and activations");
    }
  } else {
    // 3. The CPU pool lives in host memory: a default of 16 full-length
    // sequences, capped at half of the memory available now; a pool that
    // does not fit is refused here rather than failing the allocation.
    const int64_t available = host_memory_available_bytes();
    if (l.num_kv_blocks == 0) {
      const int64_t blocks = 16 * ((l.max_model_len + l.block_size - 1) / l.block_size);
      l.num_kv_blocks = available > 0 ? std::min(blocks, available / 2 / block_bytes) : blocks;
      if (l.num_kv_blocks < 1)
        return resource_exhausted("a KV-cache block of " + std::to_string(l.block_size) + " tokens takes " +
                                  gib(block_bytes) + " GiB; half of the host's available memory (" +
                                  gib(available) + " GiB) holds none: lower --block-size");
    } else if (available > 0 && l.num_kv_blocks > available / block_bytes) {
      return resource_exhausted("--num-kv-blocks " + std::to_string(l.num_kv_blocks) + " of " +
                                std::to_string(l.block_size) + " tokens needs " +
                                gib(l.num_kv_blocks * block_bytes) + " GiB of host memory; " + gib(available) +
                                " GiB is available");
    }
  }
  // 4. The pool.
  auto runner = std::make_unique<ModelRunner>(model, model->make_kv_cache(l.num_kv_blocks, l.block_size));
  // 5. The graphs, against the pool.
  if (graphs) {
    const double t0 = now_seconds();
    NUCLEUS_ASSIGN_OR_RETURN(graph_bytes, model->capture_decode_graphs(runner->kv_cache()));
    NUCLEUS_LOG_INFO("cuda graphs: captured {} decode sizes (1..{}) in {:.2f} s, {:.1f} MiB",
                     model->options().cuda_graph_sizes.size(), model->options().cuda_graph_sizes.back(),
                     now_seconds() - t0, graph_bytes / double(1 << 20));
  }
  return runner;
}

StatusOr<Tensor> ModelRunner::execute(const SchedulerOutput& out) {
  StepInputs in = pack_step_inputs(out, kv_cache_.block_size);
  return model_->forward(in, kv_cache_, stats_);
}

StatusOr<std::vector<std::vector<SampleResult>>> ModelRunner::execute_and_verify(const SchedulerOutput& out) {
  StepInputs in = pack_step_inputs(out, kv_cache_.block_size);
  NUCLEUS_ASSIGN_OR_RETURN(Tensor logits, model_->forward_logits(in, kv_cache_, stats_));
  const int64_t vocab = model_->config().vocab_size;
  int64_t num_rows = 0;
  for (const auto& s : out.scheduled)
    if (s.samples) num_rows += 1 + s.num_draft_tokens;
  NUCLEUS_RETURN_IF_ERROR(score_prompt_rows(out, logits, num_rows, vocab));
  // 1. Every row's own sample, as sample_token draws it at its output index:
  // row j of a sequence with n output tokens is index n + j, with drafts
  // d_1 .. d_j in its history (the penalties and min_tokens see them as
  // generated). Each row's adjustment list is [begin, end) of adjustments_.
  adjustments_.clear();
  std::vector<std::pair<size_t, size_t>> spans;
  std::vector<std::pair<const Sequence*, int64_t>> row_of;  // (sequence, output index)
  for (const auto& s : out.scheduled) {
    if (!s.samples) continue;
    const Sequence& seq = *s.seq;
    NUCLEUS_CHECK(!seq.grammar_matcher, "sequence {}: structured output with speculative decoding", seq.seq_id);
    const int64_t n = seq.num_output_tokens();
    std::unordered_map<int32_t, int32_t> counts;
    const bool adjusts = seq.params.adjusts_logits(n) || seq.params.adjusts_logits(n + s.num_draft_tokens);
    if (adjusts && !adjust_builder_) adjust_builder_ = std::make_unique<TokenAdjustmentBuilder>(vocab);
    if (adjusts && s.num_draft_tokens > 0) counts = seq.output_token_counts;
    for (int64_t j = 0; j <= s.num_draft_tokens; ++j) {
      spans.push_back({adjustments_.size(), adjustments_.size()});
      if (seq.params.adjusts_logits(n + j)) {
        SampleHistory h = seq.sample_history(eos_token_ids_);
        if (s.num_draft_tokens > 0) h.output_counts = &counts;
        adjust_builder_->build(seq.params, h, n + j, &adjustments_);
        spans.back().second = adjustments_.size();
      }
      row_of.push_back({&seq, n + j});
      if (adjusts && j < s.num_draft_tokens) ++counts[seq.draft_token_ids[static_cast<size_t>(j)]];
    }
  }
  auto row_adjustments = [&](size_t i) {
    return std::span<const TokenAdjustment>(adjustments_.data() + spans[i].first, spans[i].second - spans[i].first);
  };
  std::vector<SampleResult> sampled;
  if (logits.device() == Device::kCuda) {
    if (!device_sampler_ || device_sampler_->max_rows() < num_rows) {
      NUCLEUS_ASSIGN_OR_RETURN(device_sampler_, DeviceSampler::create(std::max<int64_t>(256, num_rows), vocab));
    }
    std::vector<DeviceSampleRequest> requests;
    for (size_t i = 0; i < row_of.size(); ++i) {
      requests.push_back(make_device_sample_request(row_of[i].first->params, row_of[i].first->seed, row_of[i].second));
      requests.back().adjustments = row_adjustments(i);
    }
    sampled = device_sampler_->sample(logits.data<float>(), requests);
  } else {
    for (size_t i = 0; i < row_of.size(); ++i)
      sampled.push_back(sample_token(logits.data<float>() + static_cast<int64_t>(i) * vocab, vocab,
                                     row_of[i].first->params, row_of[i].first->seed, row_of[i].second,
                                     row_adjustments(i)));
  }
  // 2. Acceptance: draft d_j stands while row j's sample equals it; the first
  // row whose sample differs gives the target's own token, and with every
  // draft accepted the last row gives the bonus token. For a drafter that
  // proposes one token (q = one-hot, the MTP's argmax) this is the rejection
  // rule exactly (Leviathan et al. 2023): the draft is kept with probability
  // p(d_j) = min(1, p / q), and a rejected row's sample is distributed as p
  // with d_j's mass removed, renormalised. The tokens are the very draws
  // sample_token makes without drafts (same seed, same output index), so a
  // seeded request gives the same output with speculative decoding on or off.
  std::vector<std::vector<SampleResult>> results;
  size_t row = 0;
  for (const auto& s : out.scheduled) {
    if (!s.samples) continue;
    std::vector<SampleResult>& accepted = results.emplace_back();
    for (int64_t j = 0; j <= s.num_draft_tokens; ++j) {
      accepted.push_back(std::move(sampled[row + static_cast<size_t>(j)]));
      if (j == s.num_draft_tokens || accepted.back().token != s.seq->draft_token_ids[static_cast<size_t>(j)]) break;
    }
    row += static_cast<size_t>(1 + s.num_draft_tokens);
  }
  return results;
}

StatusOr<std::vector<SampleResult>> ModelRunner::execute_and_sample(const SchedulerOutput& out) {
  const double t0 = now_seconds();
  StepInputs in = pack_step_inputs(out, kv_cache_.block_size);
  const double t1 = now_seconds();
  NUCLEUS_ASSIGN_OR_RETURN(Tensor logits, model_->forward_logits(in, kv_cache_, stats_));
  const double t2 = now_seconds();
  host_times_.inputs_s += t1 - t0;
  host_times_.forward_s += t2 - t1;
  // The rest (sampling) is timed on every return path.
  struct SampleTimer {
    double start;
    double* sum;
    ~SampleTimer() { *sum += now_seconds() - start; }
  } sample_timer{t2, &host_times_.sample_s};
  const int64_t vocab = model_->config().vocab_size;
  std::vector<const Sequence*> rows;
  for (const auto& s : out.scheduled)
    if (s.samples) rows.push_back(s.seq);
  NUCLEUS_RETURN_IF_ERROR(score_prompt_rows(out, logits, static_cast<int64_t>(rows.size()), vocab));
  grammar_masker_.apply(rows, logits.data<float>(), vocab, logits.device());
  // Each row's adjustment list: [begin, end) of adjustments_.
  adjustments_.clear();
  std::vector<std::pair<size_t, size_t>> spans(rows.size(), {0, 0});
  for (size_t i = 0; i < rows.size(); ++i) {
    const Sequence& seq = *rows[i];
    if (!seq.params.adjusts_logits(seq.num_output_tokens())) continue;
    if (!adjust_builder_) adjust_builder_ = std::make_unique<TokenAdjustmentBuilder>(vocab);
    spans[i].first = adjustments_.size();
    adjust_builder_->build(seq.params, seq.sample_history(eos_token_ids_), seq.num_output_tokens(), &adjustments_);
    spans[i].second = adjustments_.size();
  }
  auto row_adjustments = [&](size_t i) {
    return std::span<const TokenAdjustment>(adjustments_.data() + spans[i].first, spans[i].second - spans[i].first);
  };
  std::vector<SampleResult> results;
  if (logits.device() == Device::kCuda) {
    if (!device_sampler_ || device_sampler_->max_rows() < static_cast<int64_t>(rows.size())) {
      NUCLEUS_ASSIGN_OR_RETURN(device_sampler_,
                               DeviceSampler::create(std::max<int64_t>(256, static_cast<int64_t>(rows.size())), vocab));
    }
    std::vector<DeviceSampleRequest> requests;
    for (size_t i = 0; i < rows.size(); ++i) {
      const Sequence* seq = rows[i];
      requests.push_back(make_device_sample_request(seq->params, seq->seed, seq->num_output_tokens()));
      requests.back().adjustments = row_adjustments(i);
    }
    return device_sampler_->sample(logits.data<float>(), requests);
  }
  for (size_t i = 0; i < rows.size(); ++i)
    results.push_back(sample_token(logits.data<float>() + static_cast<int64_t>(i) * vocab, vocab, rows[i]->params,
                                   rows[i]->seed, rows[i]->num_output_tokens(), row_adjustments(i)));
  return results;
}

}  // namespace nucleus
