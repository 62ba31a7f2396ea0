// LLMEngine: the C++ serving API. Requests are added with their sampling
// parameters; each step() schedules a batch (continuous batching, chunked
// prefill, prefix caching, preemption), runs the model once, samples, and
// reports what every request produced.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/model_executor.h"
#include "runtime/block_manager.h"
#include "runtime/model_runner.h"
#include "runtime/scheduler.h"
#include "runtime/sequence.h"
#include "runtime/spec_decode.h"

namespace nucleus {

struct EngineConfig {
  // Tokens per KV block. 64: the block granularity Hopper MLA decode kernels
  // read best (FlashMLA requires 64; one block of a bf16 latent cache is
  // 64 x 576 x 2 B = 72 KiB, large enough for full-bandwidth bulk copies),
  // while prefix-cache reuse stays fine-grained next to typical prompt
  // lengths. Tests use smaller blocks to exercise block boundaries.
  int64_t block_size = 64;
  // Blocks in the pool; 0: derived (GPU: from gpu_memory_utilization; CPU:
  // room for 16 sequences of max_model_len).
  int64_t num_kv_blocks = 0;
  double gpu_memory_utilization = 0.9;
  bool enable_prefix_caching = true;
  int64_t max_num_batched_tokens = 8192;
  int64_t max_num_seqs = 256;
  int64_t max_model_len = 0;            // 0: the model's max_position_embeddings
  std::vector<int32_t> eos_token_ids;  // finish with "stop" on these unless ignore_eos
  // Speculative decoding with the checkpoint's MTP module (--speculative-config;
  // runtime/spec_decode.h); off unless num_speculative_tokens > 0.
  SpeculativeConfig speculative;

  Status validate() const;
};

struct RequestOutput {
  std::string request_id;
  // Tokens this step produced: 0 or 1, or with speculative decoding up to
  // num_speculative_tokens + 1 (accepted drafts and the target's token).
  std::vector<int32_t> new_token_ids;
  std::vector<SampleResult> new_samples;  // with their logprobs
  // params.prompt_logprobs: entry p scores prompt token p + 1; given once,
  // with the request's first token.
  std::vector<TokenLogprobs> prompt_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;  // set when finish_reason == kError
  int64_t num_prompt_tokens = 0;
  int64_t num_output_tokens = 0;
  int64_t num_cached_tokens = 0;  // prompt tokens served from the prefix cache
};

// Host wall time of the engine's steps without speculative decoding, by
// phase, summed since the engine started (seconds; always measured: a few
// clock reads a step). `bench latency --host-profile` prints it per decode
// step. schedule + inputs + forward + sample + finish is the step's wall time.
struct StepHostProfile {
  int64_t steps = 0;
  double schedule_s = 0;  // Scheduler::schedule
  double inputs_s = 0;    // ModelRunner::HostTimes (inputs, forward, sample)
  double forward_s = 0;
  double sample_s = 0;
  double finish_s = 0;    // tokens appended, stop checks, outputs built
};

struct EngineStats {
  int64_t num_waiting = 0;
  int64_t num_running = 0;
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_used = 0;
  int64_t num_preemptions = 0;
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t steps = 0;
  SpecDecodeStats spec;  // speculative decoding's counters (zero when off)
  StepHostProfile host;  // host time of the non-speculative steps by phase
};

class LLMEngine {
 public:
  static StatusOr<std::unique_ptr<LLMEngine>> create(std::unique_ptr<ModelExecutor> model, EngineConfig config);

  // Queues a request. Errors (kInvalidArgument): a duplicate id, an empty
  // prompt, a token id outside the vocabulary, bad sampling parameters,
  // structured output with speculative decoding (kUnsupported),
  // prompt + max_tokens past max_model_len, or more KV blocks than the
  // whole pool holds (kResourceExhausted); an engine that failed (failure(),
  // kAborted).
  Status add_request(const std::string& request_id, std::vector<int32_t> prompt_token_ids,
                     const SamplingParams& params);

  // Runs one step; returns an entry for every request that produced a token
  // or finished in it. Returns nothing when idle.
  //
  // A step whose forward or sampling fails finishes each request of that
  // step with FinishReason::kError (RequestOutput::error says why, naming
  // the op), frees their KV blocks, and leaves the other requests running:
  // the next step goes on. When the model cannot run more steps after the
  // failure (ModelExecutor::health: a sticky CUDA error, an aborted
  // tensor-parallel group), the engine fails instead: every request
  // finishes with kError and failure() is set.
  std::vector<RequestOutput> step();
  // OK, or why the engine failed (kAborted): it then refuses every request.
  const Status& failure() const { return failure_; }

  // Finishes a request with reason "abort"; false if it is unknown or done.
  bool abort(const std::string& request_id);

  bool has_unfinished() const { return scheduler_->has_unfinished(); }
  EngineStats stats() const;
  const EngineConfig& config() const { return config_; }
  ModelExecutor& model() { return runner_->model(); }
  // Tests of speculative decoding: after each MTP pass, `hook` may rewrite a
  // sequence's proposed drafts (the same number or fewer), to exercise
  // acceptance paths an untrained MTP layer never takes. Null: none.
  using DraftHook = std::function<void(const Sequence& seq, std::vector<int32_t>& drafts)>;
  void set_draft_hook(DraftHook hook) { draft_hook_ = std::move(hook); }
  // While set, steps record what they touched (benchmarks; slower).
  void set_step_stats(StepStats* stats) { runner_->set_stats(stats); }

 private:
  LLMEngine() = default;
  RequestOutput make_output(const Sequence& seq) const;
  // The step of a speculative engine: verify, append, then the MTP pass.
  std::vector<RequestOutput> step_speculative(SchedulerOutput& plan);
  // Why `seq` finishes after appending `tok`, or kNone (EOS, stop ids,
  // max_tokens; the grammar's verdict comes first).
  FinishReason finish_reason_after(Sequence& seq, int32_t tok, RequestOutput& o);
  // A failed step: finishes its requests with `error` (or fails the engine
  // when the model is no longer usable); returns their outputs.
  std::vector<RequestOutput> fail_step(const SchedulerOutput& plan, const Status& error);
  // Finishes every request with kError and `why`; sets failure_.
  std::vector<RequestOutput> fail_engine(const Status& why);

  EngineConfig config_;
  std::unique_ptr<ModelExecutor> model_;
  std::unique_ptr<BlockManager> blocks_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<MtpProposer> proposer_;  // speculative decoding; null when off
  SpecDecodeStats spec_stats_;
  StepHostProfile host_profile_;  // schedule and finish time of step() (EngineStats::host)
  DraftHook draft_hook_;
  std::map<std::string, std::unique_ptr<Sequence>> requests_;
  int64_t next_seq_id_ = 0;
  int64_t steps_ = 0;
  int64_t preemptions_ = 0;
  Status failure_;
};

}  // namespace nucleus
