// The DeepSeek-V2/V3 model (MLA + MoE) as step graphs over its weights.
//
// Per layer l (design.md "The model"):
//   h = x + o_proj(MLA(RMSNorm(x)))
//   y = h + FFN(RMSNorm(h)),  FFN = dense SwiGLU (l < first_k_dense_replace) or MoE
// and at the end logits = lm_head(RMSNorm(y)) for the step's logit rows.
// Residual adds are fused into the following RMSNorm (AddRmsNormOp).
//
// Tensor parallelism (docs/tp.md): a model of tensor_parallel_size > 1 is a
// group of rank models, each with its shard of the weights, its own step
// graphs and its own KV cache, driven by one thread per rank (one GPU each on
// CUDA); each step runs on every rank at once. Partial sums (o_proj, the
// MLP/MoE) are all-reduced inside the next AddRmsNormOp, the vocabulary-split
// embedding is all-reduced, the vocabulary-split logits are all-gathered.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "comm/tp_group.h"
#include "core/status.h"

#include "graph/cuda_graph.h"
#include "graph/device_inputs.h"
#include "graph/fault_injection.h"
#include "graph/step_graph.h"
#include "io/hf_config.h"
#include "kernels/rope/rope_ref.h"
#include "jit/width_build_policy.h"
#include "model/weights.h"
#include "ops/mla_ops.h"
#include "ops/step_inputs.h"

namespace nucleus {

namespace width {
class MlaFrontWidthBuilds;
}

struct ModelOptions {
  Device device = Device::kCpu;
  AttentionMode attention_mode = AttentionMode::kAuto;
  // Rows of the fixed scratch buffers (absorbed attention, MoE fallback):
  // kernels process at most this many rows per launch.
  int64_t scratch_rows = 256;
  // Cached rows the expanded attention expands at a time (CUDA), merged by
  // log-sum-exp (--prefill-context-chunk).
  int64_t prefill_context_chunk = 8192;
  // Decode steps captured as CUDA graphs, one per batch size (ascending);
  // empty: every step eager (--enforce-eager). CUDA only.
  std::vector<int64_t> cuda_graph_sizes;
  // Block-table width of graph steps: ceil(max_model_len / block_size).
  int64_t max_blocks_per_seq = 0;
  // Steps that would replay a graph run the same padded step eagerly instead
  // (tells padding effects from graph effects; NUCLEUS_GRAPH_EAGER_PAD=1).
  bool graph_eager_pad = false;
  // Prefill "token graph" buckets (ascending; empty: none): a prefill step of
  // at most the largest bucket pads to the smallest bucket that holds it;
  // the dense segments between attention layers replay as graphs captured
  // at bucket height, attention runs eagerly on the real rows.
  std::vector<int64_t> token_graph_sizes;
  // Padded prefill steps run eagerly (NUCLEUS_TOKEN_GRAPH_EAGER_PAD=1).
  bool token_graph_eager_pad = false;
  // CPU only: round every buffer the CUDA backend keeps in bf16 to bf16
  // after each op, to estimate the bf16 backend's expected deviation from
  // the f32 reference (sets the GPU tests' tolerances).
  bool cpu_bf16_emulation = false;
  // Run the prezero pass on the decode graph (NUCLEUS_ENABLE_PREZERO=1; off by default).
  bool enable_prezero = false;
  // Ranks of tensor parallelism (--tensor-parallel-size): threads of this
  // process sharing the work of each step, one GPU each on CUDA.
  int64_t tensor_parallel_size = 1;
  // CUDA, tensor parallelism: the all-reduce after o_proj and after the
  // MLP/MoE runs fused with the residual add and RMSNorm that follow
  // (NUCLEUS_FUSE_ALLREDUCE_NORM=0: an NCCL all-reduce, then the add+norm kernel).
  bool fuse_allreduce_norm = true;
  // Build a rank group (communicators, collectives in the graphs) even at
  // tensor_parallel_size 1: runs the collective path on one GPU (tests).
  bool force_tp_group = false;
  // Latent KV-cache dtype (--kv-cache-dtype, ops/kv_cache_dtype.h); unset
  // ("auto"): the device default, f32 on the CPU, bf16 on CUDA.
  std::optional<KvCacheDtype> kv_cache_dtype;
  // --kv-scale: the k_scale of every layer of an FP8 cache, overriding the
  // checkpoint's k_scale / kv_scale tensors (unset: those, else 1.0).
  std::optional<float> kv_scale;
  // CUDA decode graph: the MLA front end (q/kv projections, norms, RoPE,
  // cache write, W_UK absorption) as one mla_front op served per decode-graph
  // size by an NVRTC width build (NUCLEUS_WIDTH_BUILDS; docs/width_builds.md).
  // Off by default: the separate ops.
  width::WidthBuildsMode width_builds = width::WidthBuildsMode::kOff;
  // load_deepseek_model scans the checkpoint's values (LoadOptions::
  // check_values: NaN / Inf, FP8 NaN bytes, bad block scales); false:
  // --skip-weight-check.
  bool check_weights = true;
};

// The default decode graph sizes: 1, 2, 4, 8, 16, 24, 32, 48, 64, then every
// 32 up to 512, capped at max_num_seqs (vLLM's defaults).
std::vector<int64_t> default_cuda_graph_sizes(int64_t max_num_seqs);

// Default token-graph buckets: 256, 512, 1024, 2048, 3072, capped at
// max_num_batched_tokens; NUCLEUS_TOKEN_GRAPH_SIZES overrides ("" disables).
StatusOr<std::vector<int64_t>> token_graph_sizes_from_env(int64_t max_num_batched_tokens);

// A prefill step padded to `padded` rows: the pad rows form one extra
// sequence (no context, tokens 0 at position 0, slot -1, block table of
// block 0) that no attention op serves.
StepInputs pad_prefill_step(const StepInputs& in, int64_t padded);

// A decode step padded to `padded` rows for graph replay: pad rows are their
// own sequences with no context, token 0 at position 0, slot -1 (they write
// no KV), a block table of block 0 (read, never written) and their own logit
// row; block tables are widened to `width` entries.
StepInputs pad_decode_step(const StepInputs& in, int64_t padded, int32_t width);

// The two graph shapes a step can take. kDecode: every sequence has one new
// token; kPrefill: anything else (prefill chunks, possibly mixed with decodes).
enum class StepKind { kPrefill, kDecode };

// A rank's weights (its shard under tensor parallelism), built on the rank's
// thread (bound to its GPU) with that device's weight backend.
using WeightFactory = std::function<StatusOr<ModelWeights>(WeightBackend& backend, const TpShard& shard)>;

class DeepseekModel {
 public:
  // Where a rank model sits in its tensor-parallel group.
  struct RankContext {
    TpShard shard;                    // rank and world size
    Communicator* comm = nullptr;     // the rank's communicator (null: alone)
    std::vector<void*> peer_signals;  // CUDA fused all-reduce: every rank's signal buffer (empty: unfused)
  };

  ~DeepseekModel();
  // Builds both step graphs and picks every node's backend for options.device
  // and the KV-cache dtype (a single model: options.tensor_parallel_size must
  // be 1). Errors: an f32 cache on CUDA (kUnsupported), --kv-scale not finite
  // and > 0 or given for a cache that is not FP8 (kInvalidArgument), no
  // backend of some op for the device and cache.
  static StatusOr<std::unique_ptr<DeepseekModel>> create(const ModelConfig& config, ModelWeights weights,
                                                         const ModelOptions& options);
  // One rank of a tensor-parallel group: `weights` is the rank's shard; the
  // graphs run the rank's collectives on rank.comm. Call on the rank's thread.
  static StatusOr<std::unique_ptr<DeepseekModel>> create_rank(const ModelConfig& config, ModelWeights weights,
                                                              const ModelOptions& options, RankContext rank);
  // A tensor-parallel model over `ranks` (rank r's model at r), driven on
  // `group`'s threads.
  static std::unique_ptr<DeepseekModel> create_group(const ModelConfig& config, const ModelOptions& options,
                                                     std::unique_ptr<TpGroup> group,
                                                     std::vector<std::unique_ptr<DeepseekModel>> ranks);
  // Ranks of the model (1 unless it is a group).
  int tensor_parallel_size() const { return ranks_.empty() ? 1 : static_cast<int>(ranks_.size()); }
  // Rank r's model of a group (this model when it is not a group).
  DeepseekModel& rank_model(int r) { return ranks_.empty() ? *this : *ranks_.at(r); }

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  // The step graph of `kind` (rank 0's for a group).
  StepGraph& graph(StepKind kind) {
    if (!ranks_.empty()) return ranks_[0]->graph(kind);
    return kind == StepKind::kDecode ? decode_graph_ : prefill_graph_;
  }

  // Runs one step: writes the step's latent rows into `kv_cache` (slots from
  // inputs.slot_mapping) and returns logits [num_logits, vocab_size] f32 on
  // the host, one row per inputs.logit_indices entry. Errors: what an op
  // reported (OpContext::fail: a scratch allocation, a communicator, a plan
  // refusal, an injected fault), naming the node; the step's KV rows are then
  // partly written. Call health() to learn whether the model can run more
  // steps after a failure.
  StatusOr<Tensor> forward(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats = nullptr);
  // The same, leaving the logits where they were computed: on CUDA a view of
  // the step buffers (valid until the next step), on the CPU a host tensor.
  StatusOr<Tensor> forward_logits(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats = nullptr);

  // Whether the model can run further steps: OK, or why not (a fatal
  // injected fault, a tensor-parallel group whose communicators were
  // aborted by a failed step, a sticky CUDA error on the device: kAborted).
  // Synchronises the device on CUDA. Call after a failed forward.
  Status health();

  // Bytes of weights by kind, for roofline accounting: everything but the
  // routed experts (read once per step), and one routed expert (incl. scales).
  // Per rank (one GPU's share) under tensor parallelism.
  struct WeightBytes {
    int64_t dense = 0;
    int64_t per_expert = 0;
  };
  WeightBytes weight_bytes() const;

  // A zeroed cache for this model on its device: [num_layers, num_blocks,
  // block_size, kv_lora + qk_rope] of kv_cache_dtype() (4, 2 or 1 bytes an
  // element), with k_scale = kv_k_scales() for an FP8 cache (a group: one
  // whole cache per rank in KvCache::ranks, each with the same k_scale).
  KvCache make_kv_cache(int64_t num_blocks, int64_t block_size) const;
  // The resolved cache dtype (the one canonical value for every spelling).
  KvCacheDtype kv_cache_dtype() const { return kv_cache_dtype_; }
  // [num_layers] k_scale an FP8 cache stores with: --kv-scale, else the
  // checkpoint's k_scale / kv_scale, else 1.0 (all 1.0 for bf16/f32 caches).
  const std::vector<float>& kv_k_scales() const { return kv_k_scales_; }
  // Allocates the step buffers of both graphs for steps of up to
  // `max_tokens` tokens and `max_logits` logit rows, prefill steps up to
  // max(max_logits, max_prefill_logits) (prompt logprobs), so memory is
  // known before the KV pool is sized.
  void reserve_step_buffers(int64_t max_tokens, int64_t max_logits, int64_t max_prefill_logits = 0);
  // Captures one decode graph per options().cuda_graph_sizes entry and the
  // token-graph segments per options().token_graph_sizes bucket against
  // `kv_cache` (whose addresses the graphs keep). Returns the device bytes
  // the graphs took. Replaces graphs captured before.
  StatusOr<size_t> capture_decode_graphs(KvCache& kv_cache);
  void drop_graphs();
  // The bucket a prefill step of `num_tokens` pads to, or 0 (eager).
  int64_t token_bucket_for(int64_t num_tokens) const;
  int64_t token_graph_replays() const {
    return ranks_.empty() ? token_graph_replays_ : ranks_[0]->token_graph_replays();
  }
  // The engine's block-table width (ceil(max_model_len / block_size)).
  void set_max_blocks_per_seq(int64_t n) {
    options_.max_blocks_per_seq = n;
    for (auto& r : ranks_) r->set_max_blocks_per_seq(n);
  }
  // Graph replays and eager decode steps so far (for tests and logs).
  int64_t graph_replays() const { return ranks_.empty() ? graph_replays_ : ranks_[0]->graph_replays(); }
  // The captured size a decode step of `num_seqs` replays, or 0 (eager).
  int64_t graph_size_for(int64_t num_seqs) const;
  // Bytes one cached token takes over all layers: num_layers x (kv_lora +
  // qk_rope) x the cache element size (an FP8 cache holds twice the tokens
  // of a bf16 one in the same memory).
  int64_t kv_bytes_per_token() const;
  // Whether the decode graph runs the MLA front end through width builds
  // (options().width_builds asked for it and the model could use them; rank 0's).
  bool width_builds_active() const { return width_builds() != nullptr; }
  // The planned width builds (rank 0's), or null.
  const width::MlaFrontWidthBuilds* width_builds() const {
    return ranks_.empty() ? width_builds_.get() : ranks_[0]->width_builds();
  }
  // Device bytes the step buffers take at the current capacity (rank 0's).
  size_t activation_bytes() const {
    return ranks_.empty() ? prefill_buffers_.bytes() + decode_buffers_.bytes() : ranks_[0]->activation_bytes();
  }

 private:
  DeepseekModel(const ModelConfig& config, ModelWeights weights, const ModelOptions& options);
  static StatusOr<std::unique_ptr<DeepseekModel>> build_graphs(std::unique_ptr<DeepseekModel> m);
  void build(StepGraph& g, StepKind kind);
  // Runs fn(rank r's model, r) on every rank's thread; a failure is a bug
  // (every rank's collectives are aborted first; see TpGroup::run).
  void on_ranks(const std::function<Status(DeepseekModel&, int)>& fn) const;
  StatusOr<Tensor> forward_group(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats);

  RankContext rank_;                                 // this model's place in a group
  std::unique_ptr<TpGroup> group_;                   // a group: its ranks' threads and communicators
  std::vector<std::unique_ptr<DeepseekModel>> ranks_;  // a group: the rank models
  // NUCLEUS_FAULT_INJECT: faults_ for a well-formed value naming an op kind
  // of the graphs; kInvalidArgument otherwise.
  Status init_fault_injection();
  // Fills kv_k_scales_ (after kv_cache_dtype_); errors on a bad --kv-scale.
  Status resolve_k_scales();
  // options_.width_builds on CUDA: plans (compiles or loads) the width builds
  // for options_.cuda_graph_sizes, or logs why the model cannot use them.
  // Errors: strict mode (NUCLEUS_STRICT_WIDTHS=1) with a width or the whole
  // model left to the plain path; a malformed register-cap knob.
  Status prepare_width_builds();

  ModelConfig config_;
  ModelWeights weights_;
  ModelOptions options_;
  KvCacheDtype kv_cache_dtype_ = KvCacheDtype::kF32;
  std::vector<float> kv_k_scales_;
  kernels::RopeTable rope_;
  Tensor rope_inv_freq_device_;  // CUDA: [qk_rope / 2] f32
  std::shared_ptr<width::MlaFrontWidthBuilds> width_builds_;  // CUDA, NUCLEUS_WIDTH_BUILDS: the planned widths
  Tensor width_barrier_;                                      // their grid barrier: [2] u32, zero
  StepBuffers prefill_buffers_, decode_buffers_;
  std::vector<int> bf16_buffers_prefill_, bf16_buffers_decode_;  // cpu_bf16_emulation
  std::map<int64_t, CudaGraph> decode_graphs_;  // by padded batch size
  // Prefill graph segments: node ranges replayed as graphs, with the eager
  // nodes (attention, logits) between them.
  struct Segment {
    size_t begin = 0, end = 0;
    bool graph = false;
  };
  std::vector<Segment> prefill_segments_;
  std::map<int64_t, std::vector<CudaGraph>> token_graphs_;  // by bucket: one per graph segment
  int64_t token_graph_replays_ = 0;
  StatusOr<Tensor> forward_token_graph(const StepInputs& inputs, KvCache& kv_cache, int64_t bucket);
  std::unique_ptr<FaultInjector> faults_;  // NUCLEUS_FAULT_INJECT; null: none
  Status broken_;                          // why the model cannot run more steps (a group whose step failed)
  int64_t graphs_generation_ = -1;             // uploader generation the graphs were captured with
  int64_t graph_replays_ = 0;
  std::unique_ptr<DeviceInputUploader> uploader_;
  StepGraph prefill_graph_;
  StepGraph decode_graph_;
};

// The model for `config` and `options`: at tensor_parallel_size 1 a single
// model from make_weights({0, 1}); else a group of that many ranks (in-process
// communicators on the CPU, NCCL over GPUs 0..n-1 on CUDA, peer-mapped
// signal buffers for the fused all-reduce when the GPUs have peer access),
// rank r's weights from make_weights(backend, {r, n}) on its thread. Errors:
// a config that does not split (check_tp_config), too few GPUs, NCCL
// missing, a weight error of any rank.
StatusOr<std::unique_ptr<DeepseekModel>> build_deepseek_model(const ModelConfig& config, const ModelOptions& options,
                                                              const WeightFactory& make_weights);

// Loads config.json (with `overrides`, "key=value") and the checkpoint in
// `model_dir` for options.device (and options.tensor_parallel_size).
StatusOr<std::unique_ptr<DeepseekModel>> load_deepseek_model(const std::string& model_dir,
                                                             const ModelOptions& options,
                                                             const std::vector<std::string>& overrides = {},
                                                             bool show_progress = true);

}  // namespace nucleus
