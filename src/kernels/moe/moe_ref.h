// CPU reference mixture-of-experts routing and expert computation.
//
// Routing (DeepSeek-V2 and V3 modeling code; design.md "MoE"):
//   scores = softmax(logits) (V2) or sigmoid(logits) (V3), f32.
//   choice = scores + e_score_correction_bias (when a bias is given).
//   greedy:                 top_k experts by choice.
//   group_limited_greedy:   group score = max of choice in each of n_group
//                           groups; keep the best topk_group groups.
//   noaux_tc:               group score = sum of the top-2 choice values.
//   Experts outside the kept groups are excluded (never chosen, even when
//   every kept choice value is negative). Ties go to the lower index.
//   weights = scores (plain, not choice) of the chosen experts;
//   noaux_tc: divided by their sum (+1e-20) if norm_topk_prob, then times
//             routed_scaling_factor (once);
//   others:   divided by their sum if norm_topk_prob and top_k > 1, else
//             times routed_scaling_factor.
#pragma once

#include <cstdint>

#include "core/moe_routing_kinds.h"

namespace nucleus::kernels {

// The routing hyper-parameters (config.json's names; built from a ModelConfig
// by moe_routing_params in model/deepseek/kernel_params.h).
struct MoeRoutingParams {
  ScoringFunc scoring = ScoringFunc::kSoftmax;  // scoring_func
  TopkMethod method = TopkMethod::kGreedy;      // topk_method
  int64_t num_experts = 0;                      // n_routed_experts
  int64_t top_k = 0;                            // num_experts_per_tok
  int64_t n_group = 1;                          // expert groups
  int64_t topk_group = 1;                       // groups kept per token
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  // Shared experts run as routed ones (NUCLEUS_MOE_FUSE_SHARED): slots
  // appended after the top_k chosen ones, slot top_k + s holding expert id
  // num_experts + s with weight 1 (a shared expert's output is added
  // unweighted, DeepSeek-V2/V3 modeling code: y = moe(x) + shared_experts(x)).
  // The rows of topk_ids / topk_weights are then top_k + shared_slots wide.
  int64_t shared_slots = 0;
  int64_t slots() const { return top_k + shared_slots; }  // row width of topk_ids / topk_weights
};

// logits: [num_tokens, num_experts] f32; bias: [num_experts] f32 or null.
// topk_ids: [num_tokens, slots()] int32 (the top_k chosen in order of
// decreasing choice score, then the shared slots); topk_weights:
// [num_tokens, slots()] f32.
void moe_route_ref(const MoeRoutingParams& p, const float* logits, const float* bias, int64_t num_tokens,
                   int32_t* topk_ids, float* topk_weights);

// One SwiGLU expert's weights, f32: gate_up [2 * inter, hidden] (gate_proj
// rows then up_proj rows), down [hidden, inter].
struct ExpertWeightsRef {
  const float* gate_up = nullptr;
  const float* down = nullptr;
};

// out[t, :] (+)= sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t, :])
// with expert(x) = down(silu(gate(x)) * up(x)); experts summed in increasing
// expert index (the reference implementations' order).
//   x: [num_tokens, hidden] f32; experts: [num_experts]; out: [num_tokens, hidden].
void moe_experts_ref(const float* x, int64_t num_tokens, int64_t hidden, int64_t inter, const int32_t* topk_ids,
                     const float* topk_weights, int64_t top_k, const ExpertWeightsRef* experts, float* out,
                     bool accumulate);

}  // namespace nucleus::kernels
