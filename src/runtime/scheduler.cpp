#include "runtime/scheduler.h"

#include <algorithm>

#include "core/check.h"

namespace nucleus {

namespace {
// num_new cut so that the sequence's prompt-logprob rows fit `rows_left`,
// which it then takes from.
int64_t fit_prompt_logprob_rows(const Sequence& seq, int64_t num_new, int64_t& rows_left) {
  const int64_t begin = seq.num_computed_tokens;
  auto [first, last] = seq.prompt_logprob_positions(begin, num_new);
  if (last - first > rows_left) {
    last = first + rows_left;
    num_new = last - begin;
  }
  rows_left -= last - first;
  return num_new;
}
}  // namespace

void Scheduler::add(Sequence* seq) {
  seq->status = SeqStatus::kWaiting;
  waiting_.push_back(seq);
}

void Scheduler::preempt(Sequence* seq) {
  blocks_->free(*seq);
  seq->draft_token_ids.clear();
  seq->status = SeqStatus::kWaiting;
  ++seq->num_preemptions;
  waiting_.push_front(seq);
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int64_t budget = config_.max_num_batched_tokens;
  int64_t prompt_rows = config_.max_prompt_logprob_rows;

  // 1. Running sequences, oldest first; preempt from the back when blocks run out.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence* seq = running_[i];
    NUCLEUS_CHECK(seq->num_tokens() > seq->num_computed_tokens, "running sequence {} has nothing to compute",
                  seq->seq_id);
    const int64_t num_drafts = static_cast<int64_t>(seq->draft_token_ids.size());
    const int64_t num_new = fit_prompt_logprob_rows(
        *seq, std::min(seq->num_tokens() + num_drafts - seq->num_computed_tokens, budget), prompt_rows);
    if (num_new == 0) {  // no prompt-logprob rows left this step
      ++i;
      continue;
    }
    bool self_preempted = false;
    while (!blocks_->allocate_slots(*seq, seq->num_computed_tokens + num_new)) {
      Sequence* victim = running_.back();
      running_.pop_back();
      preempt(victim);
      out.preempted.push_back(victim);
      if (victim == seq) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    const int64_t end = seq->num_computed_tokens + num_new;
    out.scheduled.push_back({seq, num_new, end >= seq->num_tokens(), std::max<int64_t>(0, end - seq->num_tokens())});
    budget -= num_new;
    ++i;
  }

  // 2. Waiting sequences, in order, unless this step had to preempt.
  while (out.preempted.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
    Sequence* seq = waiting_.front();
    blocks_->acquire_cached_prefix(*seq);
    int64_t rows_left = prompt_rows;
    const int64_t num_new =
        fit_prompt_logprob_rows(*seq, std::min(seq->num_tokens() - seq->num_computed_tokens, budget), rows_left);
    if (num_new == 0 || !blocks_->allocate_slots(*seq, seq->num_computed_tokens + num_new)) {
      blocks_->free(*seq);  // give the prefix hits back; try again next step
      break;
    }
    waiting_.pop_front();
    prompt_rows = rows_left;
    // Prompt tokens served from the cache (a readmitted sequence's hits may
    // also cover generated tokens: those are not prompt tokens).
    seq->num_cached_prompt_tokens = std::min(seq->num_computed_tokens, seq->num_prompt_tokens());
    blocks_->record_prefix_lookup(seq->num_tokens(), seq->num_computed_tokens);
    seq->status = SeqStatus::kRunning;
    running_.push_back(seq);
    out.scheduled.push_back({seq, num_new, seq->num_computed_tokens + num_new == seq->num_tokens()});
    budget -= num_new;
  }
  out.num_batched_tokens = config_.max_num_batched_tokens - budget;
  return out;
}

void Scheduler::on_step_done(const SchedulerOutput& out) {
  for (const auto& s : out.scheduled) {
    s.seq->num_computed_tokens += s.num_new_tokens - s.num_rejected;
    blocks_->cache_full_blocks(*s.seq);
  }
}

void Scheduler::finish(Sequence* seq, FinishReason reason) {
  if (seq->finished()) return;
  auto r = std::find(running_.begin(), running_.end(), seq);
  if (r != running_.end()) running_.erase(r);
  auto w = std::find(waiting_.begin(), waiting_.end(), seq);
  if (w != waiting_.end()) waiting_.erase(w);
  blocks_->free(*seq);
  seq->status = SeqStatus::kFinished;
  seq->finish_reason = reason;
}

}  // namespace nucleus
