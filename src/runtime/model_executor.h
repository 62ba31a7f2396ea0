// ModelExecutor: the runnable model the engine drives. It holds the ranks of
// the model (one, or a tensor-parallel group), each a DeepseekModel (weights
// and graph builder, model/deepseek/deepseek_model.h) with the StepExecutor
// that runs its graphs (graph/step_executor.h), and fans every call out to
// the ranks.
//
// Tensor parallelism (docs/tp.md): a group's ranks each hold their shard of
// the weights, their own step graphs and their own KV cache, and are driven
// by one thread per rank (one GPU each on CUDA); each step runs on every rank
// at once, with the same padding (their collectives must match).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/tp_group.h"
#include "core/status.h"
#include "graph/step_executor.h"
#include "model/deepseek/deepseek_model.h"

namespace nucleus {

class ModelExecutor {
 public:
  // One rank of the executor: its model and the executor of its graphs
  // (declared in this order: the graphs point into the model's weights and
  // are destroyed first).
  struct Rank {
    std::unique_ptr<DeepseekModel> model;
    std::unique_ptr<StepExecutor> executor;
  };

  ~ModelExecutor();
  // A single model (no group): builds its graphs and their executor; with
  // `mtp`, the MTP module's too (a model of one layer whose weights carry
  // mtp_front; every step eager). Errors: a graph that cannot be built
  // (DeepseekModel::build_graph), a malformed NUCLEUS_FAULT_INJECT.
  static StatusOr<std::unique_ptr<ModelExecutor>> create(std::unique_ptr<DeepseekModel> model,
                                                         std::unique_ptr<DeepseekModel> mtp = nullptr);
  // The rank `model` of a group as a Rank (graphs built and executor made).
  // Call on the rank's thread. Errors: as create().
  // `mtp`: the model is the MTP module (its executor's decode graphs read
  // StepInputs::mtp_hidden from a buffer of their own).
  static StatusOr<Rank> make_rank(std::unique_ptr<DeepseekModel> model, bool mtp = false);
  // A tensor-parallel executor over `ranks` (rank r at r), driven on
  // `group`'s threads; `options` are the group's (tensor_parallel_size > 1);
  // `mtp`: empty, or rank r's shard of the MTP module at r (made by
  // make_rank on the rank's thread, its model built with the rank's
  // communicator and signal buffers).
  static std::unique_ptr<ModelExecutor> create_group(const ModelOptions& options, std::unique_ptr<TpGroup> group,
                                                     std::vector<Rank> ranks, std::vector<Rank> mtp = {});

  const ModelConfig& config() const { return ranks_[0].model->config(); }
  const ModelOptions& options() const { return options_; }
  int tensor_parallel_size() const { return static_cast<int>(ranks_.size()); }
  // Rank r's executor (its graphs, replay counters) and model.
  StepExecutor& rank(int r) { return *ranks_.at(r).executor; }
  const DeepseekModel& rank_model(int r) const { return *ranks_.at(r).model; }
  // Rank 0's step graph of `kind`.
  StepGraph& graph(StepKind kind) { return rank(0).graph(kind); }

  // Runs one step on every rank: writes the step's latent rows into
  // `kv_cache` (slots from inputs.slot_mapping; a group's cache holds one
  // cache per rank in KvCache::ranks) and returns logits [num_logits,
  // vocab_size] f32 on the host, one row per inputs.logit_indices entry.
  // Errors: what an op reported (OpContext::fail: a scratch allocation, a
  // communicator, a plan refusal, an injected fault), naming the node; the
  // step's KV rows are then partly written. Call health() after a failure.
  StatusOr<Tensor> forward(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats = nullptr);
  // The same, leaving the logits where they were computed: on CUDA a view of
  // rank 0's step buffers (valid until the next step), on the CPU a host
  // tensor. A group's ranks record stats of their own; rank 0's are
  // reported (routing is the same on every rank).
  StatusOr<Tensor> forward_logits(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats = nullptr);

  // The final-normed hidden states of the last forward's rows ([num_tokens,
  // hidden] in the activation dtype, on the model's device; valid until the
  // next forward): h_i, what the MTP module reads.
  StatusOr<Tensor> hidden_states();

  // The MTP module (speculative decoding): whether it is loaded, its forward
  // (writes its own one-layer cache `mtp_cache`, returns logits [num_logits,
  // vocab] f32 on the host), the pre-norm output of its last forward's rows
  // ([num_tokens, hidden] f32, rank 0's: the h a chained draft step reads),
  // its cache and the bytes a token takes in it (one rank's).
  // inputs.mtp_hidden: [num_tokens, hidden] f32 on the host (on CUDA each
  // rank uploads it to its own GPU) or, at tensor-parallel size 1, on the
  // model's device. Under tensor parallelism every rank runs its shard of the
  // module (its own cache in mtp_cache.ranks, its collectives in the group)
  // on the same rows; the logits are rank 0's (design.md "Speculative
  // decoding (MTP)").
  // Errors: as forward(); mtp_forward without a loaded module (kFailedPrecondition).
  bool has_mtp() const { return !mtp_.empty(); }
  StatusOr<Tensor> mtp_forward(const StepInputs& inputs, KvCache& mtp_cache);
  // mtp_forward's logits where the step left them: on CUDA rank 0's device
  // buffer [num_logits, vocab] f32 (valid until its next MTP step), on the
  // CPU a host tensor.
  StatusOr<Tensor> mtp_forward_logits(const StepInputs& inputs, KvCache& mtp_cache);
  StatusOr<Tensor> mtp_hidden_states();
  // Rows `rows` of `source` ([R, hidden] bf16 or f32: hidden_states() or
  // mtp_hidden_states(), valid until the next forward) as [rows.size(),
  // hidden] f32: the MTP module's StepInputs::mtp_hidden. On CUDA without a
  // tensor-parallel group (NUCLEUS_MTP_DEVICE_HIDDEN, auto = on) an index
  // upload and one gather kernel on the engine stream
  // (kernels::launch_gather_rows_f32): nothing comes back to the host and
  // the host does not wait for the device. Up to 512 rows land in a buffer
  // of this executor's (valid until the next call); more in a tensor of
  // their own. Otherwise, and with the switch at 0, the source is copied to
  // the host and the rows widened there (a group's ranks each upload them).
  // Errors: a row outside [0, R), a source that is not [R, hidden] bf16 or
  // f32 (kInvalidArgument); a CUDA error (kInternal).
  StatusOr<Tensor> gather_hidden_rows(const Tensor& source, const std::vector<int32_t>& rows);
  KvCache make_mtp_kv_cache(int64_t num_blocks, int64_t block_size);
  int64_t mtp_kv_bytes_per_token() const { return has_mtp() ? mtp_[0].model->kv_bytes_per_token() : 0; }

  // Whether the model can run further steps: OK, or why not (a fatal
  // injected fault, a tensor-parallel group whose communicators were
  // aborted by a failed step, a sticky CUDA error on the device: kAborted).
  // Synchronises the device on CUDA. Call after a failed forward.
  Status health();

  // A zeroed cache on every rank's device (DeepseekModel::make_kv_cache); a
  // group's holds each rank's whole cache in KvCache::ranks.
  KvCache make_kv_cache(int64_t num_blocks, int64_t block_size);
  KvCacheDtype kv_cache_dtype() const { return ranks_[0].model->kv_cache_dtype(); }
  const std::vector<float>& kv_k_scales() const { return ranks_[0].model->kv_k_scales(); }
  int64_t kv_bytes_per_token() const { return ranks_[0].model->kv_bytes_per_token(); }
  // One rank's (one GPU's) share of the weights.
  DeepseekModel::WeightBytes weight_bytes() const { return ranks_[0].model->weight_bytes(); }

  // StepExecutor::reserve on every rank.
  void reserve_step_buffers(int64_t max_tokens, int64_t max_logits, int64_t max_prefill_logits = 0);
  // StepExecutor::capture on every rank at once (their warm-up steps run
  // collectives); returns rank 0's bytes.
  StatusOr<size_t> capture_decode_graphs(KvCache& kv_cache);
  // Captures the MTP module's decode graphs (the target's cuda_graph_sizes)
  // against its own cache `mtp_cache`. Errors: no MTP module; a capture error.
  Status capture_mtp_graphs(KvCache& mtp_cache);
  // MTP steps that replayed a decode graph.
  int64_t mtp_graph_replays() const { return has_mtp() ? mtp_[0].executor->graph_replays() : 0; }
  void drop_graphs();
  // The engine's block-table width (ceil(max_model_len / block_size)).
  void set_max_blocks_per_seq(int64_t n);

  // Rank 0's counters and routes (every rank takes the same).
  int64_t graph_replays() const { return ranks_[0].executor->graph_replays(); }
  int64_t token_graph_replays() const { return ranks_[0].executor->token_graph_replays(); }
  // Target steps that ran as decode rows (graph/step_executor.h as_decode_rows).
  int64_t multi_token_decode_steps() const { return ranks_[0].executor->multi_token_decode_steps(); }
  int64_t graph_size_for(int64_t num_seqs) const { return ranks_[0].executor->graph_size_for(num_seqs); }
  int64_t token_bucket_for(int64_t num_tokens) const { return ranks_[0].executor->token_bucket_for(num_tokens); }
  size_t activation_bytes() const { return ranks_[0].executor->activation_bytes(); }
  // Whether the decode graph runs the MLA front end through width builds (rank 0's).
  bool width_builds_active() const { return width_builds() != nullptr; }
  const width::MlaFrontWidthBuilds* width_builds() const { return ranks_[0].model->width_builds(); }

 private:
  explicit ModelExecutor(const ModelOptions& options) : options_(options) {}
  // Runs fn(rank, r) for every rank: inline alone, on the rank threads in a
  // group (a failure aborts every rank's collectives; see TpGroup::run).
  Status on_ranks(const std::function<Status(Rank&, int)>& fn);

  ModelOptions options_;
  std::unique_ptr<TpGroup> group_;  // a group: its ranks' threads and communicators; null alone
  std::vector<Rank> ranks_;
  std::vector<Rank> mtp_;  // the MTP module, one shard a rank (empty: none)
  Status broken_;  // why the group cannot run more steps (a step failed on some rank)
  // gather_hidden_rows on CUDA: the row indices and the gathered rows
  // ([capacity, hidden] f32), grown on demand.
  Tensor gather_index_;
  Tensor gather_rows_;
};

// The executor for `config` and `options`: at tensor_parallel_size 1 a
// single model from make_weights({0, 1}); else a group of that many ranks
// (in-process communicators on the CPU, NCCL over GPUs 0..n-1 on CUDA,
// peer-mapped signal buffers for the fused all-reduce when the GPUs have peer
// access), rank r's weights from make_weights(backend, {r, n}) on its
// thread. With options.load_mtp also the MTP module (make_weights' ModelWeights::mtp),
// at tensor_parallel_size n as n rank shards in the same group. Errors: a
// config that does not split (check_tp_config), too few GPUs, NCCL missing, a
// weight error of any rank, weights without the MTP module when load_mtp
// asks for it, a graph that cannot be built.
StatusOr<std::unique_ptr<ModelExecutor>> build_deepseek_model(const ModelConfig& config, const ModelOptions& options,
                                                              const WeightFactory& make_weights);

// Loads config.json (with `overrides`, "key=value") and the checkpoint in
// `model_dir` for options.device (and options.tensor_parallel_size).
StatusOr<std::unique_ptr<ModelExecutor>> load_deepseek_model(const std::string& model_dir,
                                                             const ModelOptions& options,
                                                             const std::vector<std::string>& overrides = {},
                                                             bool show_progress = true);

}  // namespace nucleus
