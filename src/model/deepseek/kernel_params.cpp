#include "model/deepseek/kernel_params.h"

namespace nucleus {

kernels::MoeRoutingParams moe_routing_params(const ModelConfig& c) {
  kernels::MoeRoutingParams p;
  p.scoring = c.scoring_func;
  p.method = c.topk_method;
  p.num_experts = c.n_routed_experts;
  p.top_k = c.num_experts_per_tok;
  p.n_group = c.n_group;
  p.topk_group = c.topk_group;
  p.norm_topk_prob = c.norm_topk_prob;
  p.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
  return p;
}

kernels::RopeParams rope_params(const ModelConfig& c) {
  const RopeScaling& rs = c.rope_scaling;
  kernels::RopeParams p;
  p.rope_dim = c.qk_rope_head_dim;
  p.theta = c.rope_theta;
  p.yarn = rs.yarn;
  p.factor = rs.factor;
  p.original_max_position_embeddings = rs.original_max_position_embeddings;
  p.beta_fast = rs.beta_fast;
  p.beta_slow = rs.beta_slow;
  if (!rs.yarn)
    p.attention_factor = 1.0;
  else if (rs.mscale != 0.0 && rs.mscale_all_dim != 0.0)
    p.attention_factor = yarn_get_mscale(rs.factor, rs.mscale) / yarn_get_mscale(rs.factor, rs.mscale_all_dim);
  else
    p.attention_factor = yarn_get_mscale(rs.factor, 1.0);
  return p;
}

}  // namespace nucleus
