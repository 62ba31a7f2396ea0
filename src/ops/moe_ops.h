// Mixture-of-experts ops: routing (top-k experts and their weights per token)
// and the routed experts' weighted sum.
#pragma once

#include <vector>

#include "kernels/moe/moe_ref.h"
#include "ops/linear_weight.h"
#include "ops/op.h"
#include "ops/prezero.h"

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
//
// With the add + RMSNorm that follows it folded in (fuse_add_rmsnorm; the
// decode graph does so where this op is the last writer of the delta,
// NUCLEUS_MOE_COMBINE_NORM), the op then also runs AddRmsNormOp's
//   residual[t] += out[t];  normed[t] = rmsnorm(residual[t]) * norm_weight
// on its output, and is that norm's prezero donor when the pass makes it one:
// in = {x, topk_ids, topk_weights, residual [T, hidden] f32}; out = {out,
// scratch, residual (the same buffer as in[3]), normed [T, hidden] (may be
// x's buffer: written after the experts read x)[, the prezero fill [T,
// n_total] f32]}. The values are those of this op followed by AddRmsNormOp;
// on CUDA the same bits (the combine kernel runs the norm kernel's row code,
// kernels/moe/moe_grouped.cuh MoeCombineNorm).
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

  // The add + RMSNorm after the op (weight [hidden] f32), run inside it.
  void fuse_add_rmsnorm(Tensor weight, float eps) {
    norm_weight_ = std::move(weight);
    norm_eps_ = eps;
  }
  bool fuses_add_rmsnorm() const { return norm_weight_.defined(); }
  const Tensor& norm_weight() const { return norm_weight_; }
  float norm_eps() const { return norm_eps_; }
  const PrezeroDonor& prezero() const { return prezero_; }
  void set_prezero(PrezeroDonor d) { prezero_ = d; }

 private:
  Tensor device_state_;
  std::vector<ExpertWeights> experts_;
  int64_t inter_;
  int64_t top_k_;
  Tensor norm_weight_;
  float norm_eps_ = 0.0f;
  PrezeroDonor prezero_;
};

}  // namespace nucleus
