#include "runtime/llm_engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>

#include "core/check.h"
#include "core/device.h"
#include "core/logging.h"
#include "core/op_cuda_error.h"
#include "runtime/grammar_mask.h"
#include "runtime/structured_output.h"

namespace nucleus {

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Status EngineConfig::validate() const {
  if (block_size < 1) return invalid_argument("--block-size must be >= 1, got " + std::to_string(block_size));
  if (num_kv_blocks < 0) return invalid_argument("--num-kv-blocks must be >= 0");
  if (max_num_batched_tokens < 1) return invalid_argument("--max-num-batched-tokens must be >= 1");
  if (max_num_seqs < 1) return invalid_argument("--max-num-seqs must be >= 1");
  if (max_model_len < 0) return invalid_argument("--max-model-len must be >= 0");
  if (!(gpu_memory_utilization > 0.0 && gpu_memory_utilization <= 1.0))
    return invalid_argument("--gpu-memory-utilization must be in (0, 1]");
  return ok_status();
}

StatusOr<std::unique_ptr<LLMEngine>> LLMEngine::create(std::unique_ptr<ModelExecutor> model, EngineConfig config) {
  NUCLEUS_RETURN_IF_ERROR(config.validate());
  const ModelConfig& mc = model->config();
  if (config.max_model_len == 0) config.max_model_len = mc.max_position_embeddings;
  if (config.max_model_len > mc.max_position_embeddings)
    return invalid_argument("--max-model-len " + std::to_string(config.max_model_len) +
                            " exceeds the model's max_position_embeddings " +
                            std::to_string(mc.max_position_embeddings));
  if (config.eos_token_ids.empty())
    for (int64_t e : mc.eos_token_ids) config.eos_token_ids.push_back(static_cast<int32_t>(e));
  RunnerLimits limits;
  limits.block_size = config.block_size;
  limits.num_kv_blocks = config.num_kv_blocks;
  limits.gpu_memory_utilization = config.gpu_memory_utilization;
  limits.max_num_batched_tokens = config.max_num_batched_tokens;
  limits.max_num_seqs = config.max_num_seqs;
  limits.max_model_len = config.max_model_len;
  const bool spec = config.speculative.enabled();
  if (spec) {
    if (config.speculative.method != "deepseek_mtp")
      return unsupported("speculative method '" + config.speculative.method + "' is not supported (supported: deepseek_mtp)");
    if (config.speculative.num_speculative_tokens > kMaxSpeculativeTokens)
      return unsupported("num_speculative_tokens " + std::to_string(config.speculative.num_speculative_tokens) +
                         " is not supported (supported: 1 to " + std::to_string(kMaxSpeculativeTokens) + ")");
    if (!model->has_mtp())
      return failed_precondition("speculative decoding (deepseek_mtp) needs the model loaded with its MTP module "
                                 "(ModelOptions::load_mtp)");
    limits.extra_kv_bytes_per_token = model->mtp_kv_bytes_per_token();
    limits.num_speculative_tokens = config.speculative.num_speculative_tokens;
  }
  NUCLEUS_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner, ModelRunner::create(model.get(), limits));
  config.num_kv_blocks = runner->kv_cache().num_blocks;
  const int64_t block_bytes = (model->kv_bytes_per_token() + limits.extra_kv_bytes_per_token) * config.block_size;
  std::unique_ptr<LLMEngine> e(new LLMEngine());
  e->config_ = config;
  e->model_ = std::move(model);
  e->blocks_ = std::make_unique<BlockManager>(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                              /*drop_last_hit_block=*/spec);
  if (spec) {
    e->proposer_ = std::make_unique<MtpProposer>(
        e->model_.get(), e->model_->make_mtp_kv_cache(config.num_kv_blocks, config.block_size),
        config.speculative.num_speculative_tokens);
    e->spec_stats_.accepted_per_pos.assign(static_cast<size_t>(config.speculative.num_speculative_tokens), 0);
    if (e->model_->options().device == Device::kCuda && !e->model_->options().cuda_graph_sizes.empty())
      NUCLEUS_RETURN_IF_ERROR(e->model_->capture_mtp_graphs(e->proposer_->cache()).with_context("the MTP layer's decode graphs"));
    NUCLEUS_LOG_INFO("speculative decoding: deepseek_mtp, {} draft token(s) a step; the MTP layer's own cache "
                     "shares the pool's blocks ({} B/token counted in it); verify and MTP steps run {}",
                     config.speculative.num_speculative_tokens, limits.extra_kv_bytes_per_token,
                     e->model_->options().device == Device::kCuda
                         ? (e->model_->options().multi_token_decode
                                ? "as decode rows (the decode graphs, up to k + 1 rows a sequence, of the model "
                                  "and of the MTP layer), sampling on the host"
                                : "on the prefill path (NUCLEUS_MULTI_TOKEN_DECODE=0), sampling on the host")
                         : "on the CPU reference");
  }
  SchedulerConfig sc;
  sc.max_num_batched_tokens = config.max_num_batched_tokens;
  sc.max_num_seqs = config.max_num_seqs;
  e->scheduler_ = std::make_unique<Scheduler>(sc, e->blocks_.get());
  e->runner_ = std::move(runner);
  e->runner_->set_eos_token_ids(config.eos_token_ids);
  NUCLEUS_LOG_INFO("engine: {} KV blocks of {} tokens ({} tokens, {:.2f} GiB, {} cache, {} B/token), "
                   "max_num_batched_tokens {}, max_num_seqs {}, prefix caching {}",
                   config.num_kv_blocks, config.block_size, config.num_kv_blocks * config.block_size,
                   config.num_kv_blocks * block_bytes / double(1ull << 30),
                   kv_cache_dtype_name(e->model_->kv_cache_dtype()), e->model_->kv_bytes_per_token(),
                   config.max_num_batched_tokens, config.max_num_seqs, config.enable_prefix_caching ? "on" : "off");
  return e;
}

Status LLMEngine::add_request(const std::string& request_id, std::vector<int32_t> prompt,
                              const SamplingParams& params) {
  if (!failure_.ok()) return failure_;
  if (requests_.count(request_id)) return invalid_argument("request id '" + request_id + "' is already in use");
  if (prompt.empty()) return invalid_argument("the prompt is empty");
  const int64_t vocab = model_->config().vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= vocab)
      return invalid_argument("prompt token " + std::to_string(prompt[i]) + " at index " + std::to_string(i) +
                              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  NUCLEUS_RETURN_IF_ERROR(params.validate());
  if (params.grammar && proposer_)
    return unsupported("structured output (response_format / structured_outputs) with speculative decoding "
                       "(--speculative-config) is not supported yet");
  for (const auto& [id, bias] : params.logit_bias)
    if (id >= vocab)
      return invalid_argument("logit_bias token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                              std::to_string(vocab) + ")");
  const int64_t total = static_cast<int64_t>(prompt.size()) + params.max_tokens;
  if (total > config_.max_model_len)
    return invalid_argument("prompt (" + std::to_string(prompt.size()) + " tokens) + max_tokens (" +
                            std::to_string(params.max_tokens) + ") = " + std::to_string(total) +
                            " exceeds the maximum context length " + std::to_string(config_.max_model_len));
  if (blocks_->blocks_for(total) > blocks_->num_blocks())
    return resource_exhausted("prompt + max_tokens needs " + std::to_string(blocks_->blocks_for(total)) +
                              " KV blocks but the pool has only " + std::to_string(blocks_->num_blocks()) +
                              " (raise --num-kv-blocks or lower max_tokens)");
  auto seq = std::make_unique<Sequence>();
  seq->seq_id = next_seq_id_++;
  seq->request_id = request_id;
  seq->prompt_token_ids = std::move(prompt);
  seq->params = params;
  if (params.repetition_penalty != 1.0f) {  // once, not per step
    seq->distinct_prompt_ids = seq->prompt_token_ids;
    std::sort(seq->distinct_prompt_ids.begin(), seq->distinct_prompt_ids.end());
    seq->distinct_prompt_ids.erase(std::unique(seq->distinct_prompt_ids.begin(), seq->distinct_prompt_ids.end()),
                                   seq->distinct_prompt_ids.end());
  }
  if (params.grammar) seq->grammar_matcher = std::make_shared<GrammarMatcher>(params.grammar);
  seq->seed = params.seed ? *params.seed : std::random_device{}();
  seq->arrival_time = now_seconds();
  scheduler_->add(seq.get());
  requests_[request_id] = std::move(seq);
  return ok_status();
}

RequestOutput LLMEngine::make_output(const Sequence& seq) const {
  RequestOutput o;
  o.request_id = seq.request_id;
  o.finished = seq.finished();
  o.finish_reason = seq.finish_reason;
  o.error = seq.error;
  o.num_prompt_tokens = seq.num_prompt_tokens();
  o.num_output_tokens = seq.num_output_tokens();
  o.num_cached_tokens = seq.num_cached_prompt_tokens;
  return o;
}

std::vector<RequestOutput> LLMEngine::step() {
  std::vector<RequestOutput> outputs;
  const double t0 = now_seconds();
  SchedulerOutput plan = scheduler_->schedule();
  preemptions_ += static_cast<int64_t>(plan.preempted.size());
  if (plan.empty()) return outputs;
  ++steps_;
  if (proposer_) return step_speculative(plan);
  const double t1 = now_seconds();
  StatusOr<std::vector<SampleResult>> samples = internal_error("no step ran");
  try {
    samples = runner_->execute_and_sample(plan);
  } catch (const OpCudaError& e) {  // a failed CUDA call around the ops (uploads, graph replay, sampling)
    samples = internal_error(e.what());
  }
  const double t2 = now_seconds();
  ++host_profile_.steps;
  host_profile_.schedule_s += t1 - t0;
  struct FinishTimer {  // the rest of the step, on every return path
    double start;
    double* sum;
    ~FinishTimer() { *sum += now_seconds() - start; }
  } finish_timer{t2, &host_profile_.finish_s};
  if (!samples.ok()) return fail_step(plan, samples.status());
  scheduler_->on_step_done(plan);
  size_t row = 0;
  std::vector<Sequence*> done;
  for (const auto& s : plan.scheduled) {
    if (!s.samples) continue;
    Sequence& seq = *s.seq;
    SampleResult r = std::move((*samples)[row++]);
    if (seq.output_token_ids.empty()) seq.first_token_time = now_seconds();
    seq.append_output(r);
    RequestOutput o = make_output(seq);
    o.new_token_ids.push_back(r.token);
    o.new_samples.push_back(std::move(r));
    if (seq.params.prompt_logprobs && seq.num_output_tokens() == 1) o.prompt_logprobs = seq.prompt_logprobs;
    const FinishReason reason = finish_reason_after(seq, o.new_token_ids.back(), o);
    if (reason != FinishReason::kNone) {
      scheduler_->finish(&seq, reason);
      o.finished = true;
      o.finish_reason = reason;
      done.push_back(&seq);
    }
    outputs.push_back(std::move(o));
  }
  for (Sequence* seq : done) requests_.erase(seq->request_id);
  return outputs;
}

FinishReason LLMEngine::finish_reason_after(Sequence& seq, int32_t tok, RequestOutput& o) {
  FinishReason reason = seq.grammar_matcher ? advance_grammar(seq, tok) : FinishReason::kNone;
  if (reason != FinishReason::kNone)
    o.error = seq.error;  // the grammar ended the output (kStop), or refused the token (kError)
  else if (!seq.params.ignore_eos &&
           std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(), tok) != config_.eos_token_ids.end())
    reason = FinishReason::kStop;
  else if (std::find(seq.params.stop_token_ids.begin(), seq.params.stop_token_ids.end(), tok) !=
           seq.params.stop_token_ids.end())
    reason = FinishReason::kStop;
  else if (seq.num_output_tokens() >= seq.params.max_tokens)
    reason = FinishReason::kLength;
  return reason;
}

std::vector<RequestOutput> LLMEngine::step_speculative(SchedulerOutput& plan) {
  std::vector<RequestOutput> outputs;
  StatusOr<std::vector<std::vector<SampleResult>>> samples = internal_error("no step ran");
  const double t0 = now_seconds();
  try {
    samples = runner_->execute_and_verify(plan);
  } catch (const OpCudaError& e) {
    samples = internal_error(e.what());
  }
  const double t1 = now_seconds();
  if (!samples.ok()) return fail_step(plan, samples.status());
  // Each sequence's first position this step and its first row in the step
  // (for the MTP pass), taken before on_step_done advances them.
  std::vector<int64_t> begin(plan.scheduled.size()), first_row(plan.scheduled.size());
  int64_t step_row = 0;
  for (size_t i = 0; i < plan.scheduled.size(); ++i) {
    begin[i] = plan.scheduled[i].seq->num_computed_tokens;
    first_row[i] = step_row;
    step_row += plan.scheduled[i].num_new_tokens;
  }
  // 1. Append the accepted tokens, up to the first that finishes the
  // sequence; rows of rejected (or dropped) drafts are not computed.
  size_t row = 0;
  std::vector<std::pair<Sequence*, FinishReason>> done;
  for (auto& s : plan.scheduled) {
    if (!s.samples) continue;
    Sequence& seq = *s.seq;
    const std::vector<SampleResult>& toks = (*samples)[row++];
    const int64_t accepted = static_cast<int64_t>(toks.size()) - 1;
    if (s.num_draft_tokens > 0) {
      ++spec_stats_.num_drafts;
      spec_stats_.num_draft_tokens += s.num_draft_tokens;
      spec_stats_.num_accepted_tokens += accepted;
      for (int64_t j = 0; j < accepted; ++j) ++spec_stats_.accepted_per_pos[static_cast<size_t>(j)];
    }
    seq.draft_token_ids.clear();
    RequestOutput o = make_output(seq);
    FinishReason reason = FinishReason::kNone;
    int64_t appended = 0;
    for (const SampleResult& r : toks) {
      if (seq.output_token_ids.empty()) seq.first_token_time = now_seconds();
      seq.append_output(r);
      ++appended;
      o.new_token_ids.push_back(r.token);
      o.new_samples.push_back(r);
      reason = finish_reason_after(seq, r.token, o);
      if (reason != FinishReason::kNone) break;
    }
    // Draft j's row holds d_j: valid while d_j was appended.
    s.num_rejected = s.num_draft_tokens - std::min(accepted, appended);
    if (seq.params.prompt_logprobs && seq.num_output_tokens() == appended) o.prompt_logprobs = seq.prompt_logprobs;
    o.num_output_tokens = seq.num_output_tokens();
    if (reason != FinishReason::kNone) {
      o.finished = true;
      o.finish_reason = reason;
      done.emplace_back(&seq, reason);
    }
    outputs.push_back(std::move(o));
  }
  scheduler_->on_step_done(plan);
  for (auto& [seq, reason] : done) scheduler_->finish(seq, reason);
  // 2. The MTP pass over what the step computed, drafts for the sequences that go on.
  std::vector<MtpRows> rows;
  for (size_t i = 0; i < plan.scheduled.size(); ++i) {
    const ScheduledSeq& s = plan.scheduled[i];
    Sequence& seq = *s.seq;
    if (seq.finished()) continue;
    MtpRows r;
    r.seq = &seq;
    r.first_position = begin[i];
    r.num_rows = s.num_new_tokens - s.num_rejected;
    r.target_row = first_row[i];
    r.draft = s.samples;
    // Never more drafts than tokens left, nor rows past max_model_len.
    r.max_drafts = std::min(seq.params.max_tokens - seq.num_output_tokens() - 1,
                            config_.max_model_len - seq.num_tokens());
    rows.push_back(r);
  }
  Status s;
  try {
    s = proposer_->propose(rows, *blocks_);
  } catch (const OpCudaError& e) {
    s = internal_error(e.what());
  }
  ++spec_stats_.num_steps;
  spec_stats_.target_seconds += t1 - t0;
  spec_stats_.mtp_seconds += now_seconds() - t1;
  if (!s.ok()) {
    for (auto& r : rows) r.seq->draft_token_ids.clear();
    std::vector<RequestOutput> failed = fail_step(plan, s.with_context("MTP draft step"));
    return failed;
  }
  if (draft_hook_)
    for (auto& r : rows) {
      const size_t before = r.seq->draft_token_ids.size();
      draft_hook_(*r.seq, r.seq->draft_token_ids);
      NUCLEUS_CHECK(r.seq->draft_token_ids.size() <= before, "the draft hook added drafts ({} to {})", before,
                    r.seq->draft_token_ids.size());
    }
  for (auto& [seq, reason] : done) requests_.erase(seq->request_id);
  return outputs;
}

std::vector<RequestOutput> LLMEngine::fail_step(const SchedulerOutput& plan, const Status& error) {
  if (Status health = model_->health(); !health.ok())
    return fail_engine(aborted("the engine failed and takes no more requests: step " + std::to_string(steps_) +
                               " failed (" + error.to_string() + ") and the model cannot run further steps (" +
                               health.message() + ")"));
  NUCLEUS_LOG_ERROR("step {} failed; its {} request(s) finish with an error, the others go on: {}", steps_,
                    plan.scheduled.size(), error.to_string());
  std::vector<RequestOutput> outputs;
  for (const auto& s : plan.scheduled) {
    Sequence& seq = *s.seq;
    seq.error = error;
    scheduler_->finish(&seq, FinishReason::kError);  // frees its blocks (their rows of this step were not cached)
    outputs.push_back(make_output(seq));
    requests_.erase(seq.request_id);
  }
  return outputs;
}

std::vector<RequestOutput> LLMEngine::fail_engine(const Status& why) {
  NUCLEUS_LOG_ERROR("{}; finishing all {} request(s) with an error", why.message(), requests_.size());
  failure_ = why;
  std::vector<RequestOutput> outputs;
  for (auto& [id, seq] : requests_) {
    seq->error = why;
    scheduler_->finish(seq.get(), FinishReason::kError);
    outputs.push_back(make_output(*seq));
  }
  requests_.clear();
  return outputs;
}

bool LLMEngine::abort(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  scheduler_->finish(it->second.get(), FinishReason::kAbort);
  requests_.erase(it);
  return true;
}

EngineStats LLMEngine::stats() const {
  EngineStats s;
  s.num_waiting = static_cast<int64_t>(scheduler_->waiting().size());
  s.num_running = static_cast<int64_t>(scheduler_->running().size());
  s.kv_blocks_total = blocks_->num_blocks();
  s.kv_blocks_used = blocks_->num_used_blocks();
  s.num_preemptions = preemptions_;
  s.prefix_query_tokens = blocks_->prefix_query_tokens();
  s.prefix_hit_tokens = blocks_->prefix_hit_tokens();
  s.steps = steps_;
  s.spec = spec_stats_;
  s.host = host_profile_;
  const ModelRunner::HostTimes& r = runner_->host_times();
  s.host.inputs_s = r.inputs_s;
  s.host.forward_s = r.forward_s;
  s.host.sample_s = r.sample_s;
  return s;
}

}  // namespace nucleus
