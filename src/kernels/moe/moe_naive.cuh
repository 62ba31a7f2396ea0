// CUDA MoE routing (both families) and a plain expert computation
// (semantics: moe_ref.h). The routing kernel is the production one; the
// expert kernels are the always-available fallback behind the dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/weight_view.cuh"
#include "kernels/moe/moe_ref.h"

namespace nucleus::kernels {

// Which kernel launch_moe_route runs (both one warp a token, the same
// selection, the same weights: see moe_route_ref):
//  - kRegisters: scores in registers, each argmax two redux.sync (the
//    register path; moe_route_regs_supported says for which params);
//  - kSharedMemory: scores in shared memory, argmaxes as shuffle trees (any
//    params launch_moe_route accepts; the path before);
//  - kAuto: kRegisters where supported, else kSharedMemory.
enum class MoeRouteKernel { kAuto, kRegisters, kSharedMemory };

// The register path holds up to 32 * kMoeRouteRegsMaxSlots experts (Kimi-K2: 384).
inline constexpr int kMoeRouteRegsMaxSlots = 12;

// True when the register path serves p: 1 <= num_experts <= 384, 1 <= top_k
// <= num_experts, and for the grouped methods (noaux_tc, group-limited
// greedy with n_group > 1) num_experts / n_group a multiple of 32 (V3 and R1:
// 256 / 8; not DeepSeek-V2's 160 / 8).
bool moe_route_regs_supported(const MoeRoutingParams& p);

// logits: [num_tokens, num_experts] f32; bias: [num_experts] f32 or null;
// topk_ids / topk_weights: [num_tokens, p.slots()] (the shared slots after
// the top_k, MoeRoutingParams::shared_slots). num_experts <= 1024,
// 1 <= top_k <= min(16, num_experts), shared_slots <= 16, n_group dividing
// num_experts, and kernel == kRegisters only where moe_route_regs_supported;
// else cudaErrorInvalidValue.
// Stream-async, graph-safe. dependent: launched as a programmatic dependent
// (PDL, kernels/common/pdl.cuh) of the kernel before it; it waits for that
// kernel before it reads anything, and only then lets its own dependent launch.
cudaError_t launch_moe_route(const MoeRoutingParams& p, const float* logits, const float* bias, int64_t num_tokens,
                             int32_t* topk_ids, float* topk_weights, cudaStream_t stream, bool dependent = false,
                             MoeRouteKernel kernel = MoeRouteKernel::kAuto);

// One expert: gate_up [2 * inter, hidden], down [hidden, inter].
struct ExpertView {
  WeightView gate_up;
  WeightView down;
};

// out[t, :] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t, :]).
//   x: [num_tokens, hidden] bf16; experts: device array [num_experts];
//   scratch: [num_tokens * top_k, inter] f32; out: [num_tokens, hidden] bf16.
cudaError_t launch_moe_experts_naive(const __nv_bfloat16* x, int64_t num_tokens, int64_t hidden, int64_t inter,
                                     const int32_t* topk_ids, const float* topk_weights, int64_t top_k,
                                     const ExpertView* experts, float* scratch, __nv_bfloat16* out,
                                     cudaStream_t stream);

}  // namespace nucleus::kernels
