// The kernels' parameter structs built from a model config (kernels/ takes
// plain structs and never reads io/ types).
#pragma once

#include "io/hf_config.h"
#include "kernels/moe/moe_ref.h"
#include "kernels/rope/rope_ref.h"

namespace nucleus {

// MoE routing hyper-parameters of `config` (scoring_func, topk_method,
// n_routed_experts, num_experts_per_tok, n_group, topk_group, norm_topk_prob,
// routed_scaling_factor).
kernels::MoeRoutingParams moe_routing_params(const ModelConfig& config);

// RoPE parameters of `config`: qk_rope_head_dim, rope_theta, the YaRN fields
// of rope_scaling and the YaRN attention factor
//   mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
//   non-zero, mscale(factor, 1) otherwise, 1 without YaRN
// (DeepSeek-V2 modeling code, DeepseekV2YarnRotaryEmbedding).
kernels::RopeParams rope_params(const ModelConfig& config);

}  // namespace nucleus
