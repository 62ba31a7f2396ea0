// Scheduler: scripted timelines, in the style of TensorRT-LLM's capacity
// scheduler tests. A harness drives the scheduler step by step without a
// model — schedule(), on_step_done(), then for every scheduled sequence that
// samples append a fixed token and finish it (kLength) at max_tokens, as
// LLMEngine::step does — and each step's batch ((seq id, new tokens) in
// order), KV blocks in use after schedule() and preempted sequences are
// compared with the expected timeline.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/model_runner.h"
#include "runtime/scheduler.h"

namespace nucleus {
namespace {

struct Config {
  int64_t block_size = 4;
  int64_t num_blocks = 64;
  int64_t max_num_batched_tokens = 64;
  int64_t max_num_seqs = 8;
  bool prefix_caching = true;
  int64_t max_prompt_logprob_rows = kMaxPromptLogprobRows;
};

// Request i (0-based) gets seq id i + 1.
struct Request {
  int64_t prompt_len = 0;
  int64_t max_tokens = 1;
  int64_t arrival_step = 1;  // added before schedule() of this step (steps count from 1)
  int64_t prompt_key = 0;    // requests with the same key share prompt tokens; 0: the seq id
  int64_t abort_step = 0;    // Scheduler::finish(kAbort) before schedule() of this step; 0: never
  bool prompt_logprobs = false;  // params.prompt_logprobs = 0
};

struct Step {
  std::vector<std::pair<int64_t, int64_t>> batch;  // (seq id, num_new_tokens), scheduled order
  int64_t blocks_used = 0;                         // right after schedule()
  std::vector<int64_t> preempted = {};             // seq ids, in preemption order
};

std::string to_string(const Step& s) {
  std::ostringstream o;
  o << "batch [";
  for (size_t i = 0; i < s.batch.size(); ++i) o << (i ? " " : "") << s.batch[i].first << ":" << s.batch[i].second;
  o << "] blocks " << s.blocks_used << " preempted [";
  for (size_t i = 0; i < s.preempted.size(); ++i) o << (i ? " " : "") << s.preempted[i];
  o << "]";
  return o.str();
}

constexpr int32_t kSampledToken = 7;

class Timeline {
 public:
  Timeline(const Config& c, std::vector<Request> requests)
      : blocks_(c.num_blocks, c.block_size, c.prefix_caching),
        sched_({c.max_num_batched_tokens, c.max_num_seqs, c.max_prompt_logprob_rows}, &blocks_),
        max_prompt_rows_(c.max_prompt_logprob_rows),
        budget_(c.max_num_batched_tokens),
        max_seqs_(c.max_num_seqs),
        requests_(std::move(requests)) {
    for (size_t i = 0; i < requests_.size(); ++i) {
      const Request& r = requests_[i];
      auto s = std::make_unique<Sequence>();
      s->seq_id = static_cast<int64_t>(i) + 1;
      const int64_t key = r.prompt_key ? r.prompt_key : s->seq_id;
      for (int64_t t = 0; t < r.prompt_len; ++t) s->prompt_token_ids.push_back(static_cast<int32_t>(key * 1000 + t));
      s->params.max_tokens = static_cast<int32_t>(r.max_tokens);
      if (r.prompt_logprobs) s->params.prompt_logprobs = 0;
      // LLMEngine::add_request refuses what cannot fit the pool.
      EXPECT_LE(blocks_.blocks_for(r.prompt_len + r.max_tokens), blocks_.num_blocks()) << "request " << s->seq_id;
      seqs_.push_back(std::move(s));
    }
  }

  // Runs until every request arrived and finished.
  std::vector<Step> run() {
    std::vector<Step> steps;
    for (int64_t step = 1; step <= 1000; ++step) {
      bool pending = false;
      for (size_t i = 0; i < requests_.size(); ++i) {
        Sequence* s = seqs_[i].get();
        if (requests_[i].arrival_step == step) sched_.add(s);
        if (requests_[i].abort_step == step) {
          sched_.finish(s, FinishReason::kAbort);
          EXPECT_TRUE(s->block_table.empty());
          EXPECT_TRUE(blocks_.check_invariants(live())) << "step " << step;
        }
        pending |= requests_[i].arrival_step > step;
      }
      if (!pending && !sched_.has_unfinished()) break;

      SchedulerOutput out = sched_.schedule();
      Step st;
      st.blocks_used = blocks_.num_used_blocks();
      for (const auto& s : out.scheduled) {
        st.batch.push_back({s.seq->seq_id, s.num_new_tokens});
        EXPECT_EQ(s.seq->status, SeqStatus::kRunning);
        EXPECT_EQ(s.samples, s.seq->num_computed_tokens + s.num_new_tokens == s.seq->num_tokens());
        EXPECT_GE(blocks_.block_size() * static_cast<int64_t>(s.seq->block_table.size()),
                  s.seq->num_computed_tokens + s.num_new_tokens)
            << "step " << step << " seq " << s.seq->seq_id << " has no room for its tokens";
      }
      for (Sequence* p : out.preempted) {
        st.preempted.push_back(p->seq_id);
        EXPECT_EQ(p->status, SeqStatus::kWaiting);
        EXPECT_TRUE(p->block_table.empty());
      }
      for (const Sequence* w : sched_.waiting())
        EXPECT_TRUE(w->block_table.empty()) << "step " << step << ": waiting seq " << w->seq_id << " holds blocks";
      int64_t tokens = 0;
      for (const auto& s : out.scheduled) tokens += s.num_new_tokens;
      EXPECT_EQ(out.num_batched_tokens, tokens);
      EXPECT_LE(tokens, budget_);
      EXPECT_LE(static_cast<int64_t>(sched_.running().size()), max_seqs_);
      EXPECT_TRUE(blocks_.check_invariants(live())) << "step " << step;
      steps.push_back(st);

      // The rows the model runner scores, in position order per sequence (it
      // checks that each continues its sequence's entries).
      const std::vector<PromptLogprobRow> rows = prompt_logprob_rows(out);
      EXPECT_LE(static_cast<int64_t>(rows.size()), max_prompt_rows_) << "step " << step;
      for (const auto& r : rows) {
        EXPECT_EQ(static_cast<int64_t>(r.seq->prompt_logprobs.size()), r.position) << "step " << step;
        r.seq->prompt_logprobs.push_back({});
      }
      sched_.on_step_done(out);
      for (const auto& s : out.scheduled) {
        if (!s.samples) continue;
        s.seq->output_token_ids.push_back(kSampledToken);
        if (s.seq->num_output_tokens() >= s.seq->params.max_tokens) sched_.finish(s.seq, FinishReason::kLength);
      }
      EXPECT_TRUE(blocks_.check_invariants(live())) << "step " << step;
    }
    EXPECT_FALSE(sched_.has_unfinished());
    // Nothing leaked: every block is back in the free list.
    EXPECT_EQ(blocks_.num_free_blocks(), blocks_.num_blocks());
    for (size_t i = 0; i < requests_.size(); ++i) {
      const Sequence& s = *seqs_[i];
      EXPECT_TRUE(s.finished()) << "seq " << s.seq_id;
      if (requests_[i].abort_step) {
        EXPECT_EQ(s.finish_reason, FinishReason::kAbort) << "seq " << s.seq_id;
      } else {
        EXPECT_EQ(s.finish_reason, FinishReason::kLength) << "seq " << s.seq_id;
        EXPECT_EQ(s.num_output_tokens(), requests_[i].max_tokens) << "seq " << s.seq_id;
      }
      if (requests_[i].prompt_logprobs && !requests_[i].abort_step) {
        EXPECT_EQ(static_cast<int64_t>(s.prompt_logprobs.size()), requests_[i].prompt_len - 1) << "seq " << s.seq_id;
      }
    }
    return steps;
  }

  const Sequence& seq(int64_t id) const { return *seqs_[static_cast<size_t>(id - 1)]; }
  const BlockManager& blocks() const { return blocks_; }

 private:
  std::vector<const Sequence*> live() const {
    std::vector<const Sequence*> v;
    for (const auto& s : seqs_)
      if (!s->finished()) v.push_back(s.get());
    return v;
  }

  BlockManager blocks_;
  Scheduler sched_;
  int64_t max_prompt_rows_;
  int64_t budget_;
  int64_t max_seqs_;
  std::vector<Request> requests_;
  std::vector<std::unique_ptr<Sequence>> seqs_;
};

void expect_steps(const std::vector<Step>& actual, const std::vector<Step>& expected) {
  for (size_t i = 0; i < std::max(actual.size(), expected.size()); ++i) {
    const std::string got = i < actual.size() ? to_string(actual[i]) : "(none)";
    const std::string want = i < expected.size() ? to_string(expected[i]) : "(none)";
    EXPECT_EQ(got, want) << "step " << i + 1;
  }
}

// Runs a timeline and compares it; returns the harness for further checks.
std::unique_ptr<Timeline> run_case(const Config& c, const std::vector<Request>& requests,
                                   const std::vector<Step>& expected) {
  auto t = std::make_unique<Timeline>(c, requests);
  expect_steps(t->run(), expected);
  return t;
}

TEST(SchedulerTest, TwoPromptsPrefillTogetherThenDecode) {
  Config c{.block_size = 4, .num_blocks = 16, .max_num_batched_tokens = 64, .max_num_seqs = 8};
  auto t = run_case(c, {{.prompt_len = 7, .max_tokens = 3}, {.prompt_len = 5, .max_tokens = 3}},
                    {
                        {{{1, 7}, {2, 5}}, 4},  // both prefills in one step, 2 blocks each
                        {{{1, 1}, {2, 1}}, 4},  // decode together
                        {{{1, 1}, {2, 1}}, 5},  // seq 1's 9th token opens a third block; both finish
                    });
  EXPECT_EQ(t->seq(1).num_preemptions, 0);
  EXPECT_EQ(t->seq(2).num_preemptions, 0);
}

TEST(SchedulerTest, ChunkedPrefillSplitsLongPrompt) {
  Config c{.block_size = 4, .num_blocks = 16, .max_num_batched_tokens = 8, .max_num_seqs = 8};
  run_case(c, {{.prompt_len = 20, .max_tokens = 2}},
           {
               {{{1, 8}}, 2},
               {{{1, 8}}, 4},
               {{{1, 4}}, 5},  // last chunk samples the first token
               {{{1, 1}}, 6},
           });
}

TEST(SchedulerTest, DecodeSharesStepWithPrefillChunk) {
  Config c{.block_size = 4, .num_blocks = 16, .max_num_batched_tokens = 8, .max_num_seqs = 8};
  run_case(c, {{.prompt_len = 2, .max_tokens = 5, .arrival_step = 1}, {.prompt_len = 20, .max_tokens = 2, .arrival_step = 2}},
           {
               {{{1, 2}}, 1},
               {{{1, 1}, {2, 7}}, 3},  // the running decode first, the chunk gets the rest of the budget
               {{{1, 1}, {2, 7}}, 5},
               {{{1, 1}, {2, 6}}, 7},  // prompt done: seq 2 samples
               {{{1, 1}, {2, 1}}, 8},  // both decode; both finish
           });
}

TEST(SchedulerTest, MaxNumSeqsCapsTheBatch) {
  Config c{.block_size = 4, .num_blocks = 32, .max_num_batched_tokens = 64, .max_num_seqs = 2};
  run_case(c,
           {{.prompt_len = 4, .max_tokens = 2}, {.prompt_len = 4, .max_tokens = 4}, {.prompt_len = 4, .max_tokens = 2}},
           {
               {{{1, 4}, {2, 4}}, 2},  // seq 3 waits: cap reached
               {{{1, 1}, {2, 1}}, 4},  // seq 1 finishes
               {{{2, 1}, {3, 4}}, 3},  // seq 3 takes the freed slot
               {{{2, 1}, {3, 1}}, 4},
           });
}

// A pool of 4 blocks; two sequences need 3 each at the end. Seq 1 grows into
// a third block at step 4: seq 2 (the most recently admitted) is preempted,
// goes back to the front of the waiting queue (ahead of seq 3, which arrived
// before the preemption) and, once seq 1 finished, recomputes its prompt and
// its 3 generated tokens in one step and carries on to exactly max_tokens.
TEST(SchedulerTest, PreemptionByRecompute) {
  Config c{.block_size = 4, .num_blocks = 4, .max_num_batched_tokens = 64, .max_num_seqs = 8,
           .prefix_caching = false};
  auto t = run_case(c,
                    {{.prompt_len = 6, .max_tokens = 6},
                     {.prompt_len = 6, .max_tokens = 6},
                     {.prompt_len = 4, .max_tokens = 1, .arrival_step = 2}},
                    {
                        {{{1, 6}, {2, 6}}, 4},
                        {{{1, 1}, {2, 1}}, 4},   // seq 3 arrived: no free block
                        {{{1, 1}, {2, 1}}, 4},
                        {{{1, 1}}, 3, {2}},      // seq 1 needs a 3rd block: seq 2 preempted, nobody admitted
                        {{{1, 1}}, 3},           // seq 2 (front) needs 3 blocks, 1 free: waits, and so does seq 3
                        {{{1, 1}}, 3},           // seq 1 finishes
                        {{{2, 9}, {3, 4}}, 4},   // seq 2 recomputes 6 prompt + 3 generated tokens, then seq 3
                        {{{2, 1}}, 3},
                        {{{2, 1}}, 3},
                    });
  EXPECT_EQ(t->seq(1).num_preemptions, 0);
  EXPECT_EQ(t->seq(2).num_preemptions, 1);
  EXPECT_EQ(t->seq(2).num_output_tokens(), 6);
  EXPECT_EQ(t->seq(3).num_preemptions, 0);
}

// The same squeeze with the prefix cache on: seq 2's freed blocks go to the
// free list's tail, seq 1 takes (evicts) its block 1, but its block 0 survives
// and is reused on readmission, so only 5 of 9 tokens are recomputed.
TEST(SchedulerTest, PreemptionReusesSurvivingPrefix) {
  Config c{.block_size = 4, .num_blocks = 4, .max_num_batched_tokens = 64, .max_num_seqs = 8};
  auto t = run_case(c, {{.prompt_len = 6, .max_tokens = 6}, {.prompt_len = 6, .max_tokens = 6}},
                    {
                        {{{1, 6}, {2, 6}}, 4},
                        {{{1, 1}, {2, 1}}, 4},
                        {{{1, 1}, {2, 1}}, 4},
                        {{{1, 1}}, 3, {2}},
                        {{{1, 1}}, 3},  // seq 2 hits block 0 but cannot get 2 more blocks: gives it back
                        {{{1, 1}}, 3},
                        {{{2, 5}}, 3},  // 4 tokens from the cache, 5 recomputed
                        {{{2, 1}}, 3},
                        {{{2, 1}}, 3},
                    });
  EXPECT_EQ(t->seq(2).num_preemptions, 1);
  EXPECT_EQ(t->seq(2).num_cached_prompt_tokens, 4);
}

// Two preemptions in one step: seq 1 needs a block and preempts seq 3 (the
// most recently admitted); seq 2 then needs one too and, being the last
// running, preempts itself. Both go to the front of the waiting queue in
// their admission order, so seq 2 is readmitted before seq 3.
TEST(SchedulerTest, PreemptionsInOneStepKeepAdmissionOrder) {
  Config c{.block_size = 4, .num_blocks = 4, .max_num_batched_tokens = 64, .max_num_seqs = 8,
           .prefix_caching = false};
  auto t = run_case(c,
                    {{.prompt_len = 4, .max_tokens = 2}, {.prompt_len = 8, .max_tokens = 2}, {.prompt_len = 3, .max_tokens = 2}},
                    {
                        {{{1, 4}, {2, 8}, {3, 3}}, 4},  // pool full
                        {{{1, 1}}, 2, {3, 2}},          // seq 1 finishes
                        {{{2, 9}, {3, 4}}, 4},          // recompute prompt + 1 generated token each
                    });
  EXPECT_EQ(t->seq(1).num_preemptions, 0);
  EXPECT_EQ(t->seq(2).num_preemptions, 1);
  EXPECT_EQ(t->seq(3).num_preemptions, 1);
}

// No sequence is admitted in a step that preempted, even one whose first
// chunk would fit: at step 6 the victim's 4-token chunk (budget 5 - 1) would
// fit the block seq 1 left free, but it waits for step 7.
TEST(SchedulerTest, PreemptingStepAdmitsNothing) {
  Config c{.block_size = 4, .num_blocks = 4, .max_num_batched_tokens = 5, .max_num_seqs = 8,
           .prefix_caching = false};
  auto t = run_case(c, {{.prompt_len = 4, .max_tokens = 7}, {.prompt_len = 4, .max_tokens = 6, .arrival_step = 2}},
                    {
                        {{{1, 4}}, 1},
                        {{{1, 1}, {2, 4}}, 3},
                        {{{1, 1}, {2, 1}}, 4},
                        {{{1, 1}, {2, 1}}, 4},
                        {{{1, 1}, {2, 1}}, 4},
                        {{{1, 1}}, 3, {2}},     // 1 block free and a 4-token chunk would fit: not readmitted
                        {{{1, 1}, {2, 4}}, 4},  // readmitted, chunked by the budget; seq 1 finishes
                        {{{2, 4}}, 2},          // rest of prompt + 4 generated tokens, samples its 5th
                        {{{2, 1}}, 3},
                    });
  EXPECT_EQ(t->seq(2).num_preemptions, 1);
}

// The second request with the same prompt, arriving after the first
// finished, computes only the uncached tail (2 of 10 tokens).
TEST(SchedulerTest, PrefixCacheHitAfterFinish) {
  Config c{.block_size = 4, .num_blocks = 16, .max_num_batched_tokens = 64, .max_num_seqs = 8};
  auto t = run_case(c,
                    {{.prompt_len = 10, .max_tokens = 2, .arrival_step = 1, .prompt_key = 42},
                     {.prompt_len = 10, .max_tokens = 2, .arrival_step = 3, .prompt_key = 42}},
                    {
                        {{{1, 10}}, 3},
                        {{{1, 1}}, 3},  // seq 1 finishes: blocks 0, 1 stay cached
                        {{{2, 2}}, 3},  // 8 tokens from the cache
                        {{{2, 1}}, 3},
                    });
  EXPECT_EQ(t->seq(1).num_cached_prompt_tokens, 0);
  EXPECT_EQ(t->seq(2).num_cached_prompt_tokens, 8);
  EXPECT_EQ(t->blocks().prefix_hit_tokens(), 8);
}

// A prompt of exactly two full blocks: the last token is always recomputed,
// so only the first block is served from the cache.
TEST(SchedulerTest, PrefixCacheKeepsLastTokenComputed) {
  Config c{.block_size = 4, .num_blocks = 16, .max_num_batched_tokens = 64, .max_num_seqs = 8};
  auto t = run_case(c,
                    {{.prompt_len = 8, .max_tokens = 1, .arrival_step = 1, .prompt_key = 5},
                     {.prompt_len = 8, .max_tokens = 1, .arrival_step = 2, .prompt_key = 5}},
                    {
                        {{{1, 8}}, 2},
                        {{{2, 4}}, 2},
                    });
  EXPECT_EQ(t->seq(2).num_cached_prompt_tokens, 4);
}

// A request with the same prompt admitted while the first still runs shares
// its computed full blocks (4 blocks in use instead of 6).
TEST(SchedulerTest, PrefixCacheSharedWithRunningSequence) {
  Config c{.block_size = 4, .num_blocks = 16, .max_num_batched_tokens = 64, .max_num_seqs = 8};
  auto t = run_case(c,
                    {{.prompt_len = 10, .max_tokens = 3, .arrival_step = 1, .prompt_key = 9},
                     {.prompt_len = 10, .max_tokens = 2, .arrival_step = 2, .prompt_key = 9}},
                    {
                        {{{1, 10}}, 3},
                        {{{1, 1}, {2, 2}}, 4},
                        {{{1, 1}, {2, 1}}, 4},
                    });
  EXPECT_EQ(t->seq(2).num_cached_prompt_tokens, 8);
}

// Abort of a waiting sequence (held back by max_num_seqs) and of a running
// one: both leave the queues and the running one's blocks are freed at once.
TEST(SchedulerTest, AbortWaitingAndRunning) {
  Config c{.block_size = 4, .num_blocks = 16, .max_num_batched_tokens = 64, .max_num_seqs = 1};
  auto t = run_case(c,
                    {{.prompt_len = 8, .max_tokens = 10, .abort_step = 3},
                     {.prompt_len = 4, .max_tokens = 2, .abort_step = 2},
                     {.prompt_len = 4, .max_tokens = 1}},
                    {
                        {{{1, 8}}, 2},  // cap 1: seqs 2, 3 wait
                        {{{1, 1}}, 3},  // seq 2 aborted while waiting
                        {{{3, 4}}, 1},  // seq 1 aborted while running: its 3 blocks are free
                    });
  EXPECT_EQ(t->seq(1).num_output_tokens(), 2);
  EXPECT_EQ(t->seq(2).num_output_tokens(), 0);
}

TEST(SchedulerTest, AbortFreesBlocksImmediately) {
  BlockManager bm(8, 4, true);
  Scheduler sched({64, 8}, &bm);
  Sequence a, b;
  a.seq_id = 1;
  a.prompt_token_ids.assign(10, 1);
  b.seq_id = 2;
  b.prompt_token_ids.assign(30, 2);  // 8 blocks: cannot be admitted next to a
  sched.add(&a);
  sched.add(&b);
  SchedulerOutput out = sched.schedule();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(bm.num_used_blocks(), 3);
  EXPECT_EQ(sched.running().size(), 1u);
  EXPECT_EQ(sched.waiting().size(), 1u);
  EXPECT_TRUE(b.block_table.empty());  // failed admission gave everything back

  sched.finish(&b, FinishReason::kAbort);  // waiting
  EXPECT_TRUE(sched.waiting().empty());
  EXPECT_EQ(b.status, SeqStatus::kFinished);
  EXPECT_EQ(b.finish_reason, FinishReason::kAbort);
  EXPECT_EQ(bm.num_used_blocks(), 3);

  sched.finish(&a, FinishReason::kAbort);  // running, mid-step (before on_step_done)
  EXPECT_TRUE(sched.running().empty());
  EXPECT_EQ(bm.num_used_blocks(), 0);
  EXPECT_TRUE(a.block_table.empty());
  EXPECT_FALSE(sched.has_unfinished());
  EXPECT_TRUE(bm.check_invariants({}));

  sched.finish(&a, FinishReason::kStop);  // finishing twice is a no-op
  EXPECT_EQ(a.finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(sched.schedule().empty());
}

// A prompt asking for prompt logprobs is chunked to the step's rows for
// them (5 here) while a plain prompt beside it prefills whole; the position
// of the last prompt token samples and takes no such row.
TEST(SchedulerTest, PromptLogprobRowsChunkThePrefill) {
  Config c{.block_size = 4, .num_blocks = 16, .max_num_batched_tokens = 64, .max_num_seqs = 8,
           .max_prompt_logprob_rows = 5};
  run_case(c, {{.prompt_len = 13, .max_tokens = 2, .prompt_logprobs = true}, {.prompt_len = 6, .max_tokens = 3}},
           {
               {{{1, 5}, {2, 6}}, 4},  // positions 0-4 of seq 1: 5 rows
               {{{1, 5}, {2, 1}}, 5},  // positions 5-9
               {{{1, 3}, {2, 1}}, 6},  // positions 10-11 (2 rows) and 12, which samples; seq 2 finishes
               {{{1, 1}}, 4},
           });
}

// A request asking for prompt logprobs takes no prefix-cache hit (the hit's
// positions would have no logits); one without, on the same prompt, does.
TEST(SchedulerTest, PromptLogprobsSkipThePrefixCache) {
  Config c{.block_size = 4, .num_blocks = 64, .max_num_batched_tokens = 64, .max_num_seqs = 8};
  auto t = run_case(c,
                    {{.prompt_len = 9, .max_tokens = 1, .arrival_step = 1, .prompt_key = 1},
                     {.prompt_len = 9, .max_tokens = 1, .arrival_step = 2, .prompt_key = 1, .prompt_logprobs = true},
                     {.prompt_len = 9, .max_tokens = 1, .arrival_step = 3, .prompt_key = 1}},
                    {
                        {{{1, 9}}, 3},
                        {{{2, 9}}, 3},  // no hit: all 9 positions computed
                        {{{3, 1}}, 3},  // 8 tokens from the cache
                    });
  EXPECT_EQ(t->seq(2).num_cached_prompt_tokens, 0);
  EXPECT_EQ(t->seq(3).num_cached_prompt_tokens, 8);
}

}  // namespace
}  // namespace nucleus
