// The CUDA backends of the MoE op families: moe_route and moe_experts
// "cuda_naive" (ops/moe_ops_cuda.cpp), moe_experts "cuda_grouped"
// (ops/moe_grouped_cuda.cpp) and "cuda_decode" (ops/moe_decode_cuda.cpp).
#pragma once

#include <cstddef>

#include "core/status.h"
#include "ops/moe_ops.h"

namespace nucleus::kernels {
struct ExpertView;  // kernels/moe/moe_naive.cuh
}  // namespace nucleus::kernels

namespace nucleus::cuda_ops {

// moe_route: the router kernel (kernels/moe/moe_naive.cuh). moe_experts
// "cuda_naive": the plain experts kernel, out[1].dim(0) tokens per launch.
void moe_route(MoeRouteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void moe_experts_naive(MoeExpertsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// cuda_grouped (ops/moe_grouped_cuda.cpp): grouped tensor-core GEMMs over
// expert-sorted tokens, bf16 or FP8 block-scaled weights.
// Its pass workspace lives in the step workspace, sized for the tokens per
// pass that reserve() fixes from the step limits.
Status moe_experts_grouped_supports(const MoeExpertsOp& op);
void moe_experts_grouped(MoeExpertsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
size_t moe_experts_grouped_workspace(const MoeExpertsOp& op, const StepLimits& limits);
Status moe_experts_grouped_reserve(MoeExpertsOp& op, const StepLimits& limits, Device device);
// The experts' device views (kernels::ExpertView [num_experts]) cuda_grouped
// keeps in the op's device_state(), built on first use.
const kernels::ExpertView* moe_experts_grouped_views(MoeExpertsOp& op);

// The add + RMSNorm of an op that folds it in (MoeExpertsOp::fuse_add_rmsnorm)
// as its own launch on out[0], for the backends whose kernels do not run it
// (cuda_naive, and cuda_decode's decode kernels); nothing when the op does
// not fold it in. cuda_grouped runs it inside its combine instead.
void moe_experts_add_rmsnorm(MoeExpertsOp& op, const TensorList& out);

// cuda_decode (ops/moe_decode_cuda.cpp): steps of at most
// moe_decode_max_tokens() tokens (ops/moe_decode.h) on the fused decode
// kernels (kernels/moe/moe_decode.cuh: bf16 or FP8 block-scaled weights, each
// activated expert read once a step), larger ones on cuda_grouped in the same
// call. Refuses what cuda_grouped refuses, what moe_decode_unsupported names
// (e.g. top_k > 16), and everything under NUCLEUS_MOE_DECODE=0. Workspace: the larger of the grouped path's and the
// decode scratch (f32 [min(max_tokens, 16) * top_k, inter]).
Status moe_experts_decode_supports(const MoeExpertsOp& op);
void moe_experts_decode(MoeExpertsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
size_t moe_experts_decode_workspace(const MoeExpertsOp& op, const StepLimits& limits);
Status moe_experts_decode_reserve(MoeExpertsOp& op, const StepLimits& limits, Device device);

}  // namespace nucleus::cuda_ops
