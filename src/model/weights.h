// Model weights: what a DeepSeek checkpoint must hold (the manifest), the
// loader that checks a checkpoint against it, and the per-device form the
// kernels read (WeightBackend converts).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/tp_shard.h"
#include "ops/linear_weight.h"

namespace nucleus {

// SwiGLU MLP: down(silu(gate(x)) * up(x)); gate_up holds gate_proj's rows
// then up_proj's rows ([2 * inter, hidden]).
struct MlpWeights {
  LinearWeight gate_up;
  LinearWeight down;
  int64_t inter = 0;  // this rank's intermediate width (the config's / tensor-parallel size)
};

struct AttentionWeights {
  std::optional<LinearWeight> q_a_proj;  // [q_lora_rank, hidden] (q LoRA)
  Tensor q_a_layernorm;                  // [q_lora_rank]
  std::optional<LinearWeight> q_b_proj;  // [num_heads * qk_head, q_lora_rank]
  std::optional<LinearWeight> q_proj;    // [num_heads * qk_head, hidden] (no q LoRA)
  LinearWeight kv_a_proj;                // [kv_lora_rank + qk_rope, hidden]
  Tensor kv_a_layernorm;                 // [kv_lora_rank]
  LinearWeight kv_b_proj;                // [num_heads * (qk_nope + v_head), kv_lora_rank]
  LinearWeight o_proj;                   // [hidden, num_heads * v_head]
  // The checkpoint's FP8 KV-cache scale for this layer (a scalar k_scale or
  // kv_scale tensor; see load_weights), unset when it has none.
  std::optional<float> k_scale;
};

struct MoeWeights {
  LinearWeight router;             // [num_experts, hidden], weight f32 (router logits in f32)
  Tensor e_score_correction_bias;  // [num_experts] f32, undefined when absent
  std::vector<MlpWeights> experts;
  // The shared experts, in one of two forms (at most one is set):
  // `shared`, one MLP of width n_shared_experts * moe_intermediate_size (this
  // rank's slice), unless the shared experts run as routed ones
  // (NUCLEUS_MOE_FUSE_SHARED: 1, or auto on CUDA), and also then where the
  // second form's pieces would split an FP8 scale block; else
  // `shared_experts`,
  // n_shared_experts MLPs of the routed experts' width, piece s holding
  // intermediate units [s I_r, (s + 1) I_r) of the slice (I_r =
  // moe_intermediate_size / tp), whose outputs sum to the MLP's. Decode steps
  // run the pieces as routed experts (MoeRoutingParams::shared_slots).
  std::optional<MlpWeights> shared;
  std::vector<MlpWeights> shared_experts;
};

struct LayerWeights {
  Tensor input_layernorm;           // [hidden]
  Tensor post_attention_layernorm;  // [hidden]
  AttentionWeights attn;
  std::optional<MlpWeights> mlp;  // dense layers
  std::optional<MoeWeights> moe;  // MoE layers
};

// The front of DeepSeek-V3's multi-token-prediction (MTP) module: its
// decoder layer's input is x = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)]),
// h_i the previous model's hidden state at position i (design.md
// "Speculative decoding (MTP)").
struct MtpFrontWeights {
  Tensor enorm;           // [hidden] f32
  Tensor hnorm;           // [hidden] f32
  LinearWeight eh_proj;   // [hidden, 2 * hidden]: columns [0, hidden) read the embedding, the rest h
};

struct ModelWeights {
  Tensor embed_tokens;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  Tensor norm;     // [hidden]
  LinearWeight lm_head;  // [vocab, hidden] (never FP8: DeepSeek keeps lm_head bf16)
  // Set on the weights of an MTP module (then `layers` is its one decoder
  // layer, `norm` its shared_head.norm and `lm_head` its shared_head.head).
  std::optional<MtpFrontWeights> mtp_front;
  // The checkpoint's MTP module as a model of its own (LoadOptions::load_mtp);
  // its embed_tokens / lm_head are the main model's tensors (one copy in
  // memory) when the checkpoint's copies hold the same bytes.
  std::shared_ptr<ModelWeights> mtp;
};

// Converts checkpoint tensors (host views in the stored dtype) to a device's
// form. Implementations: CpuWeightBackend (f32), the CUDA backend.
class WeightBackend {
 public:
  virtual ~WeightBackend() = default;
  // The device the converted weights live on.
  virtual Device device() const = 0;
  // The embedding table [vocab, hidden]: any float dtype in.
  virtual StatusOr<Tensor> embedding(const std::string& name, const Tensor& host) = 0;
  // A norm weight or a bias (a vector): f32 on every device.
  virtual StatusOr<Tensor> vector(const std::string& name, const Tensor& host) = 0;
  // The MoE router weight [num_experts, hidden], read by an f32-output GEMM
  // (CPU: f32; CUDA: bf16, the checkpoint's own values).
  virtual StatusOr<Tensor> router(const std::string& name, const Tensor& host) = 0;
  // A linear weight; `scale_inv` is defined for f8e4m3 weights (f32 or
  // E8M0 u8 in, [ceil(n/block_n), ceil(k/block_k)]).
  virtual StatusOr<LinearWeight> linear(const std::string& name, const Tensor& weight, const Tensor& scale_inv,
                                        int64_t block_n, int64_t block_k) = 0;
  // gate_proj and up_proj fused row-wise into one [2 * inter, hidden] weight.
  virtual StatusOr<LinearWeight> concat_rows(const std::string& name, const LinearWeight& a,
                                             const LinearWeight& b) = 0;
};

// The CPU reference form: everything f32, FP8 dequantized.
std::unique_ptr<WeightBackend> make_cpu_weight_backend();
// The CUDA form: bf16 linear weights (FP8 e4m3 + f32 block scales kept as
// such), bf16 embedding and router, f32 vectors, on the device. Null in
// builds without CUDA.
std::unique_ptr<WeightBackend> make_cuda_weight_backend();
// The backend for `device`.
std::unique_ptr<WeightBackend> make_weight_backend(Device device);

struct LoadOptions {
  bool show_progress = true;  // a progress line on stderr when it is a terminal
  // Scan every tensor the model loads for values no weight may hold
  // (model/weight_check.h): NaN or Inf in F32/BF16/F16, the F8_E4M3 NaN
  // bytes, a weight_scale_inv not finite and > 0. Off: --skip-weight-check.
  bool check_values = true;
  // Also load the multi-token-prediction module, layer num_hidden_layers
  // (ModelWeights::mtp): enorm, hnorm, eh_proj, its decoder layer,
  // shared_head.norm, shared_head.head and embed_tokens. Errors: config.json's
  // num_nextn_predict_layers is 0, or a tensor is missing (named).
  bool load_mtp = false;
};

// Loads and converts every tensor a DeepSeek-V2/V3 model with `config` needs,
// or with tensor parallelism (shard.world_size > 1) rank shard.rank's part of
// each (model/tp_shard.h: heads, intermediate widths and the vocabulary
// split, the rest replicated; FP8 scales sliced with their weights).
// Errors (each names the tensor and its file): a missing tensor, a shape
// other than the config implies, an unsupported dtype, a float dtype other
// than config.json's torch_dtype (F32 is always accepted), a bad value
// (options.check_values; kDataLoss with the element's index), an FP8 weight
// without weight_scale_inv or with a scale of the wrong shape, FP8 weights
// while config.json has no fp8 quantization_config, and tensors the model
// does not use (layers past num_hidden_layers, such as DeepSeek-V3's
// multi-token-prediction layer, are skipped, as are rotary inv_freq buffers);
// with tensor parallelism also a config that does not split evenly
// (check_tp_config) and an FP8 weight whose shard boundary falls inside a
// scale block (named, with the sizes that would work).
// FP8 KV-cache scales (vLLM / ATOM / ModelOpt names) are optional, one scalar
// (shape [] or [1], F32/BF16/F16, finite and > 0) per layer:
// model.layers.N.self_attn.{,attn.,mla_attn.}{k_scale,kv_scale}; where several
// are present they must agree. v_scale tensors at the same places are
// accepted and ignored (MLA keeps one latent cache, scaled by k_scale). Under
// tensor parallelism every rank loads them whole (the latent cache is not
// sharded).
StatusOr<ModelWeights> load_weights(const Checkpoint& ckpt, const ModelConfig& config, WeightBackend& backend,
                                    const LoadOptions& options = {}, const TpShard& shard = {});

// Random weights from the config alone (--load-format dummy): N(0, 0.02)
// linear weights (FP8 with block scales when the config says fp8), norm
// weights 1, router bias 0; a fixed seed, so runs are repeatable. A value
// depends on its tensor and its index in the full tensor only, so rank
// shards (generated alone) are exactly the slices of the TP = 1 weights.
// With `with_mtp` also a random MTP module (its embedding and head shared
// with the main model's, as in DeepSeek's checkpoints).
StatusOr<ModelWeights> make_dummy_weights(const ModelConfig& config, WeightBackend& backend, uint64_t seed = 0,
                                          const TpShard& shard = {}, bool with_mtp = false);

}  // namespace nucleus
