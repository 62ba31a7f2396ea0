// The CUDA backends of the MoE op families: moe_route and moe_experts
// "cuda_naive" (ops/moe_ops_cuda.cpp), moe_experts "cuda_grouped"
// (ops/moe_grouped_cuda.cpp).
#pragma once

#include <cstddef>

#include "core/status.h"
#include "ops/moe_ops.h"

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

}  // namespace nucleus::cuda_ops
