// Mixture-of-experts ops: routing (top-k experts and their weights per token)
// and the routed experts' weighted sum.
#pragma once

#include <vector>

#include "kernels/moe/moe_ref.h"
#include "ops/linear_weight.h"
#include "ops/op.h"

namespace nucleus {

// Buffers: in = {router_logits [T, num_experts] f32};
// out = {topk_ids [T, slots] i32, topk_weights [T, slots] f32}, slots =
// top_k + shared_slots (the shared experts' fixed slots last,
// MoeRoutingParams::shared_slots).
// Semantics: kernels/moe/moe_ref.h.
class MoeRouteOp : public OpWithBackends<MoeRouteOp> {
 public:
  MoeRouteOp(kernels::MoeRoutingParams params, Tensor bias) : params_(params), bias_(std::move(bias)) {}
  const char* kind() const override { return "moe_route"; }
  std::string attrs() const override;
  static const std::vector<Backend<MoeRouteOp>>& backends();
  // Runs the backend; with ctx.stats, also counts the routed experts
  // activated (not the shared slots).
  void run(OpContext& ctx, const TensorList& in, const TensorList& out) override;
  const kernels::MoeRoutingParams& params() const { return params_; }
  const Tensor& bias() const { return bias_; }  // [num_experts] f32, or undefined

 private:
  kernels::MoeRoutingParams params_;
  Tensor bias_;
};

// One routed expert (SwiGLU): gate_up [2 * inter, hidden], down [hidden, inter].
struct ExpertWeights {
  const LinearWeight* gate_up;
  const LinearWeight* down;
};

// out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]).
// Buffers: in = {x [T, hidden], topk_ids, topk_weights}; out = {out [T, hidden]
// (overwritten), scratch [W, top_k * inter] f32 (CUDA: tokens processed W at a time)}.
class MoeExpertsOp : public OpWithBackends<MoeExpertsOp> {
 public:
  MoeExpertsOp(std::vector<ExpertWeights> experts, int64_t inter, int64_t top_k)
      : experts_(std::move(experts)), inter_(inter), top_k_(top_k) {}
  const char* kind() const override { return "moe_experts"; }
  std::string attrs() const override;
  static const std::vector<Backend<MoeExpertsOp>>& backends();
  const std::vector<ExpertWeights>& experts() const { return experts_; }
  int64_t inter() const { return inter_; }
  int64_t top_k() const { return top_k_; }
  // Backend-owned device state (e.g. the experts' weight views), built on first use.
  Tensor& device_state() { return device_state_; }

 private:
  Tensor device_state_;
  std::vector<ExpertWeights> experts_;
  int64_t inter_;
  int64_t top_k_;
};

}  // namespace nucleus
