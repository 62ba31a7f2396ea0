// The DeepSeek-V2/V3 model (MLA + MoE) as step graphs over its weights.
//
// Per layer l (design.md "The model"):
//   h = x + o_proj(MLA(RMSNorm(x)))
//   y = h + FFN(RMSNorm(h)),  FFN = dense SwiGLU (l < first_k_dense_replace) or MoE
// and at the end logits = lm_head(RMSNorm(y)) for the step's logit rows.
// Residual adds are fused into the following RMSNorm (AddRmsNormOp).
#pragma once

#include <map>
#include <memory>
#include <optional>

#include "core/status.h"

#include "graph/cuda_graph.h"
#include "graph/device_inputs.h"
#include "graph/step_graph.h"
#include "io/hf_config.h"
#include "kernels/rope/rope_ref.h"
#include "model/weights.h"
#include "ops/mla_ops.h"
#include "ops/step_inputs.h"

namespace nucleus {

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
  // Latent KV-cache dtype (--kv-cache-dtype, ops/kv_cache_dtype.h); unset
  // ("auto"): the device default, f32 on the CPU, bf16 on CUDA.
  std::optional<KvCacheDtype> kv_cache_dtype;
  // --kv-scale: the k_scale of every layer of an FP8 cache, overriding the
  // checkpoint's k_scale / kv_scale tensors (unset: those, else 1.0).
  std::optional<float> kv_scale;
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

class DeepseekModel {
 public:
  // Builds both step graphs and picks every node's backend for options.device
  // and the KV-cache dtype. Errors: an f32 cache on CUDA (kUnsupported),
  // --kv-scale not finite and > 0 or given for a cache that is not FP8
  // (kInvalidArgument), no backend of some op for the device and cache.
  static StatusOr<std::unique_ptr<DeepseekModel>> create(const ModelConfig& config, ModelWeights weights,
                                                         const ModelOptions& options);

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  StepGraph& graph(StepKind kind) { return kind == StepKind::kDecode ? decode_graph_ : prefill_graph_; }

  // Runs one step: writes the step's latent rows into `kv_cache` (slots from
  // inputs.slot_mapping) and returns logits [num_logits, vocab_size] f32 on
  // the host, one row per inputs.logit_indices entry.
  StatusOr<Tensor> forward(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats = nullptr);
  // The same, leaving the logits where they were computed: on CUDA a view of
  // the step buffers (valid until the next step), on the CPU a host tensor.
  StatusOr<Tensor> forward_logits(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats = nullptr);

  // Bytes of weights by kind, for roofline accounting: everything but the
  // routed experts (read once per step), and one routed expert (incl. scales).
  struct WeightBytes {
    int64_t dense = 0;
    int64_t per_expert = 0;
  };
  WeightBytes weight_bytes() const;

  // A zeroed cache for this model on its device: [num_layers, num_blocks,
  // block_size, kv_lora + qk_rope] of kv_cache_dtype() (4, 2 or 1 bytes an
  // element), with k_scale = kv_k_scales() for an FP8 cache.
  KvCache make_kv_cache(int64_t num_blocks, int64_t block_size) const;
  // The resolved cache dtype (the one canonical value for every spelling).
  KvCacheDtype kv_cache_dtype() const { return kv_cache_dtype_; }
  // [num_layers] k_scale an FP8 cache stores with: --kv-scale, else the
  // checkpoint's k_scale / kv_scale, else 1.0 (all 1.0 for bf16/f32 caches).
  const std::vector<float>& kv_k_scales() const { return kv_k_scales_; }
  // Allocates the step buffers of both graphs for steps of up to
  // `max_tokens` tokens and `max_logits` logit rows (so memory is known
  // before the KV pool is sized).
  void reserve_step_buffers(int64_t max_tokens, int64_t max_logits);
  // Captures one decode graph per options().cuda_graph_sizes entry and the
  // token-graph segments per options().token_graph_sizes bucket against
  // `kv_cache` (whose addresses the graphs keep). Returns the device bytes
  // the graphs took. Replaces graphs captured before.
  StatusOr<size_t> capture_decode_graphs(KvCache& kv_cache);
  void drop_graphs() {
    decode_graphs_.clear();
    token_graphs_.clear();
  }
  // The bucket a prefill step of `num_tokens` pads to, or 0 (eager).
  int64_t token_bucket_for(int64_t num_tokens) const;
  int64_t token_graph_replays() const { return token_graph_replays_; }
  // The engine's block-table width (ceil(max_model_len / block_size)).
  void set_max_blocks_per_seq(int64_t n) { options_.max_blocks_per_seq = n; }
  // Graph replays and eager decode steps so far (for tests and logs).
  int64_t graph_replays() const { return graph_replays_; }
  // The captured size a decode step of `num_seqs` replays, or 0 (eager).
  int64_t graph_size_for(int64_t num_seqs) const;
  // Bytes one cached token takes over all layers: num_layers x (kv_lora +
  // qk_rope) x the cache element size (an FP8 cache holds twice the tokens
  // of a bf16 one in the same memory).
  int64_t kv_bytes_per_token() const;
  // Device bytes the step buffers take at the current capacity.
  size_t activation_bytes() const { return prefill_buffers_.bytes() + decode_buffers_.bytes(); }

 private:
  DeepseekModel(const ModelConfig& config, ModelWeights weights, const ModelOptions& options);
  void build(StepGraph& g, StepKind kind);
  // Fills kv_k_scales_ (after kv_cache_dtype_); errors on a bad --kv-scale.
  Status resolve_k_scales();

  ModelConfig config_;
  ModelWeights weights_;
  ModelOptions options_;
  KvCacheDtype kv_cache_dtype_ = KvCacheDtype::kF32;
  std::vector<float> kv_k_scales_;
  kernels::RopeTable rope_;
  Tensor rope_inv_freq_device_;  // CUDA: [qk_rope / 2] f32
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
  int64_t graphs_generation_ = -1;             // uploader generation the graphs were captured with
  int64_t graph_replays_ = 0;
  std::unique_ptr<DeviceInputUploader> uploader_;
  StepGraph prefill_graph_;
  StepGraph decode_graph_;
};

// Loads config.json (with `overrides`, "key=value") and the checkpoint in
// `model_dir` for options.device.
StatusOr<std::unique_ptr<DeepseekModel>> load_deepseek_model(const std::string& model_dir,
                                                             const ModelOptions& options,
                                                             const std::vector<std::string>& overrides = {},
                                                             bool show_progress = true);

}  // namespace nucleus
