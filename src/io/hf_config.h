// ModelConfig: the fields of a Hugging Face config.json that nucleus uses,
// for model_type deepseek_v2 (DeepseekV2ForCausalLM) and deepseek_v3
// (DeepseekV3ForCausalLM). Unknown model types and unsupported values are
// errors that name the field and the accepted values.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/dtype.h"
#include "core/moe_routing_kinds.h"
#include "core/status.h"

namespace nucleus {

const char* scoring_func_name(ScoringFunc f);
const char* topk_method_name(TopkMethod m);

struct RopeScaling {
  bool yarn = false;  // false: plain RoPE (rope_scaling null)
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

struct ModelConfig {
  std::string model_type;  // "deepseek_v2" | "deepseek_v3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP width
  int64_t moe_intermediate_size = 0;  // per-expert width
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t q_lora_rank = 0;  // 0: no q LoRA (q_proj instead of q_a/q_b)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;

  // Mixture of experts (n_routed_experts == 0: every layer dense).
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  TopkMethod topk_method = TopkMethod::kGreedy;
  ScoringFunc scoring_func = ScoringFunc::kSoftmax;
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  // Multi-token-prediction (MTP) modules after the last layer (DeepSeek-V3:
  // 1), stored as layers num_hidden_layers .. + n - 1. Loaded only for
  // speculative decoding (runtime/spec_decode.h).
  int64_t num_nextn_predict_layers = 0;

  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  bool tie_word_embeddings = false;
  // config.json torch_dtype (or dtype): bfloat16, float16 or float32; unset
  // when absent. load_weights accepts float tensors of this dtype or F32.
  std::optional<DType> torch_dtype;

  // FP8 block-scaled weights (quantization_config.quant_method == "fp8").
  bool fp8 = false;
  int64_t weight_block_n = 0;  // weight_block_size[0]
  int64_t weight_block_k = 0;  // weight_block_size[1]

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Width of one latent KV-cache row: kv_lora_rank + qk_rope_head_dim.
  int64_t kv_cache_width() const { return kv_lora_rank + qk_rope_head_dim; }
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  // Softmax scale of MLA: qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2
  // (DeepSeek-V2/V3 modeling code; the same scale for expanded and absorbed
  // attention). DeepSeek-V3: 0.135234; V2-Lite: 0.114721.
  double softmax_scale() const;
};

// YaRN magnitude scale: 0.1 * m * ln(s) + 1 for s > 1, else 1
// (DeepSeek-V2 modeling code, yarn_get_mscale).
double yarn_get_mscale(double scale, double mscale);

// Parses a config.json object. `overrides` are "key=value" strings applied to
// the top-level JSON first (values parsed as JSON, else taken as strings).
// Errors name the field, not the file: the caller adds that context.
StatusOr<ModelConfig> parse_model_config(const nlohmann::json& config,
                                         const std::vector<std::string>& overrides = {});
// Reads and parses `path` (a config.json file); errors begin with `path`.
StatusOr<ModelConfig> load_model_config(const std::string& path,
                                        const std::vector<std::string>& overrides = {});
// The eos_token_id of generation_config.json at `path` (an integer or a list,
// each in [0, vocab_size)): the ids Hugging Face's generate() and vLLM stop on
// besides the tokenizer's eos (Kimi-K2's chat turns end in <|im_end|>, named
// only there). Empty when the file does not exist or has no eos_token_id;
// errors begin with `path`.
StatusOr<std::vector<int64_t>> load_generation_eos_token_ids(const std::string& path, int64_t vocab_size);

}  // namespace nucleus
