// The DeepSeek-V2/V3 model (MLA + MoE) as step graphs over its weights.
//
// Per layer l (design.md "The model"):
//   h = x + o_proj(MLA(RMSNorm(x)))
//   y = h + FFN(RMSNorm(h)),  FFN = dense SwiGLU (l < first_k_dense_replace) or MoE
// and at the end logits = lm_head(RMSNorm(y)) for the step's logit rows.
// Residual adds are fused into the following RMSNorm (AddRmsNormOp).
//
// Tensor parallelism (docs/tp.md): each rank builds its graphs over its shard
// of the weights. Partial sums (o_proj, the MLP/MoE) are all-reduced inside
// the next AddRmsNormOp, the vocabulary-split embedding is all-reduced, the
// vocabulary-split logits are all-gathered. The ranks' fan-out is
// runtime/model_executor.h's.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "comm/tp_group.h"
#include "core/status.h"

#include "graph/step_executor.h"
#include "io/hf_config.h"
#include "kernels/rope/rope_ref.h"
#include "jit/width_build_policy.h"
#include "model/weights.h"
#include "ops/mla_attention.h"
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
  // Steps of 2..4 tokens a sequence (MTP verify and draft passes, short
  // prompts) run as decode steps of one row a token, on CUDA through the
  // decode graphs (graph/step_executor.h as_decode_rows;
  // NUCLEUS_MULTI_TOKEN_DECODE=0 turns it off).
  bool multi_token_decode = true;
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
  // MTP modules (ModelWeights::mtp_front): a row at position 0 takes a zero
  // embedding (ops/basic_ops.h MtpInputOp).
  bool mtp_zero_embed_at_position0 = false;
  // Load the checkpoint's MTP module and run it beside the model
  // (speculative decoding, --speculative-config; runtime/spec_decode.h).
  bool load_mtp = false;
};

// A rank's weights (its shard under tensor parallelism), built on the rank's
// thread (bound to its GPU) with that device's weight backend.
using WeightFactory = std::function<StatusOr<ModelWeights>(WeightBackend& backend, const TpShard& shard)>;

// One rank's DeepSeek model: its weights and the graph builder of its step
// graphs. Execution (buffers, uploads, CUDA graphs, the rank fan-out) is the
// step executor's (graph/step_executor.h, runtime/model_executor.h).
class DeepseekModel {
 public:
  // Where a rank model sits in its tensor-parallel group.
  struct RankContext {
    TpShard shard;                    // rank and world size
    Communicator* comm = nullptr;     // the rank's communicator (null: alone)
    std::vector<void*> peer_signals;  // CUDA fused all-reduce: every rank's signal buffer (empty: unfused)
  };

  ~DeepseekModel();
  // Resolves the KV-cache dtype and k_scale and plans the width builds
  // (options.width_builds). Call on the rank's thread (its GPU). Errors: an
  // f32 cache on CUDA (kUnsupported), --kv-scale not finite and > 0 or given
  // for a cache that is not FP8 (kInvalidArgument), a malformed split-K,
  // skinny or prezero switch, strict width builds that cannot serve.
  static StatusOr<std::unique_ptr<DeepseekModel>> create(const ModelConfig& config, ModelWeights weights,
                                                         const ModelOptions& options, RankContext rank);
  // A model alone (no tensor-parallel group).
  static StatusOr<std::unique_ptr<DeepseekModel>> create(const ModelConfig& config, ModelWeights weights,
                                                         const ModelOptions& options);
  // OK, or invalid_argument naming the first malformed kernel switch of the
  // environment (core/knobs.h flags; the split-K, skinny/PDL, MoE decode, MoE
  // UP split-K, MLA decode and prezero switches). create() checks them; the
  // loaders (build_deepseek_model) check them before any weight is read, so
  // a typo costs no load.
  static Status env_status();

  // The step graph of `kind` (design.md "The model"), every node's backend
  // chosen for options().device and the cache dtype; the decode graph after
  // its passes (split-K outputs in f32, then prezero when enabled). Errors:
  // no backend of some op (naming the node and every refusal), a pass error.
  StatusOr<BuiltGraph> build_graph(StepKind kind);

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  const RankContext& rank() const { return rank_; }

  // Bytes of weights by kind, for roofline accounting: everything but the
  // routed experts (read once per step), and one routed expert (incl. scales).
  // This rank's share under tensor parallelism.
  struct WeightBytes {
    int64_t dense = 0;
    int64_t per_expert = 0;
  };
  WeightBytes weight_bytes() const;

  // A zeroed cache for this rank on its device: [num_layers, num_blocks,
  // block_size, kv_lora + qk_rope] of kv_cache_dtype() (4, 2 or 1 bytes an
  // element), with k_scale = kv_k_scales() for an FP8 cache.
  KvCache make_kv_cache(int64_t num_blocks, int64_t block_size) const;
  // The resolved cache dtype (the one canonical value for every spelling).
  KvCacheDtype kv_cache_dtype() const { return kv_cache_dtype_; }
  // [num_layers] k_scale an FP8 cache stores with: --kv-scale, else the
  // checkpoint's k_scale / kv_scale, else 1.0 (all 1.0 for bf16/f32 caches).
  const std::vector<float>& kv_k_scales() const { return kv_k_scales_; }
  // Bytes one cached token takes over all layers: num_layers x (kv_lora +
  // qk_rope) x the cache element size (an FP8 cache holds twice the tokens
  // of a bf16 one in the same memory).
  int64_t kv_bytes_per_token() const;
  // The planned width builds (options().width_builds asked for them and the
  // model can use them), or null.
  const width::MlaFrontWidthBuilds* width_builds() const { return width_builds_.get(); }

 private:
  DeepseekModel(const ModelConfig& config, ModelWeights weights, const ModelOptions& options, RankContext rank);
  // The graph's nodes and buffers (no backend chosen yet); appends the
  // buffers the CUDA backend keeps in bf16 to *bf16_buffers.
  void build(StepGraph& g, StepKind kind, std::vector<int>* bf16_buffers);
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
  RankContext rank_;
  KvCacheDtype kv_cache_dtype_ = KvCacheDtype::kF32;
  std::vector<float> kv_k_scales_;
  kernels::RopeTable rope_;
  Tensor rope_inv_freq_device_;  // CUDA: [qk_rope / 2] f32
  std::shared_ptr<width::MlaFrontWidthBuilds> width_builds_;  // CUDA, NUCLEUS_WIDTH_BUILDS: the planned widths
  Tensor width_barrier_;                                      // their grid barrier: [2] u32, zero
};

}  // namespace nucleus
