// Fused routed-expert MoE for decode steps of a few tokens (the cuda_decode
// backend of moe_experts), bf16 or FP8 block-scaled weights:
//
//   out[t, :] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, k]
//
// (semantics: moe_ref.h, moe_experts_ref with accumulate = false; the routing
// weights already carry routed_scaling_factor, as moe_route_ref applies it).
//
// At T <= 16 tokens a step is memory-bound: its floor is the bytes of the
// experts it activates over the HBM bandwidth. Two kernels read each activated
// expert's weights exactly once per step, however many of the step's tokens
// chose it, and nothing else of size:
//  1. up:   a CTA owns one activated expert and a slice of its intermediate
//           columns j (gate row j and up row inter + j of gate_up) for every
//           (token, k) pair routed to that expert; its warps stream those rows
//           once (16-byte ld.global.nc.L1::no_allocate loads), multiply them
//           with the pairs' x rows (read through L1) in f32 FMAs and write
//           h[pair, j] = silu(gate) * up in f32 (no bf16 rounding of h);
//  2. down: a warp owns 2 output columns n of hidden for every token of the
//           step; it walks the activated experts in increasing expert id,
//           streams rows n of each expert's down weight once, and adds
//           topk_weights[t, k] * (h[pair] . down_e[n]) into a register of the
//           lane that owns (n, t). The sum over a token's experts thus runs in
//           the reference's order (increasing expert id) in f32, then is
//           rounded to bf16 once. While one expert's products are reduced the
//           next expert's first rows are prefetched into L2.
// Both kernels find the step's activated experts and each expert's pairs from
// topk_ids themselves (every CTA sorts the <= 256 pairs in shared memory: a
// bitmap of the experts, popcount ranks, a prefix sum of the counts; pairs
// inside an expert in pair order), so no host sync, no align launch, no
// device-side sizes: a launch is capturable in a CUDA graph and its grid
// covers min(pairs, num_experts) experts (CTAs of experts a step lacks exit).
// Deterministic: every output is one fixed-order dot product per pair and one
// fixed-order sum over experts; no atomics on floats, no zeroing (out and h are
// overwritten; tokens with no valid expert get 0).
// PDL (pdl = true): both kernels are launched as programmatic dependents. The
// up kernel waits for its predecessor (the router) before anything, then lets
// the down kernel start; the down kernel reads topk_ids (complete by then:
// the up kernel has waited for the router) and issues its first weights'
// L2 prefetches before it waits for h.
// Weights: [n, k] rows, 16-byte aligned, bf16 or FP8 e4m3 with block scales
// (W = q * scale_inv[n / block_n, k / block_k], block_k a multiple of 16): a
// 16-byte chunk holds 8 bf16 or 16 e4m3 (converted exactly through bf16 with
// integer ops, fp8_detail::e4m3x4_to_bf16x4); an FP8 chunk lies in one scale
// block, so its f32 dot product with the activations is multiplied by that
// block's scale once. gate_up and down may differ in type.
//
// Framework-free: raw pointers, sizes in elements, a stream; launchers return
// a cudaError_t. Stream-async, no allocation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/moe/moe_naive.cuh"  // ExpertView

namespace nucleus::kernels {

constexpr int64_t kMoeDecodeMaxTokens = 16;    // T of one launch
constexpr int64_t kMoeDecodeMaxPairs = 256;    // T * top_k
constexpr int64_t kMoeDecodeMaxExperts = 1024;  // num_experts

struct MoeDecodeArgs {
  const __nv_bfloat16* x = nullptr;      // [num_tokens, hidden] bf16, contiguous, 16-byte aligned
  const int32_t* topk_ids = nullptr;     // [num_tokens, top_k]; ids outside [0, num_experts) contribute nothing
  const float* topk_weights = nullptr;   // [num_tokens, top_k] f32
  int64_t num_tokens = 0, hidden = 0, inter = 0, num_experts = 0, top_k = 0;
  const ExpertView* experts = nullptr;   // device array [num_experts]: gate_up [2 inter, hidden], down [hidden, inter]
  float* h = nullptr;                    // scratch [num_tokens * top_k, inter] f32 (moe_decode_scratch_bytes)
  __nv_bfloat16* out = nullptr;          // [num_tokens, hidden] bf16, overwritten
  bool pdl = false;                      // launch both kernels as programmatic dependents
  bool gate_up_fp8 = false;              // the experts' gate_up weights are FP8 (as their views say)
  bool down_fp8 = false;                 // the experts' down weights are FP8
  int up_slices = 0;                     // up kernel's K slices (1, 2, 4, 8); 0: moe_decode_up_slices
};

// Why experts of these sizes and weights cannot run on the decode kernels, or
// nullptr. gate_up / down: one expert's views (all experts share their types,
// shapes and blocks). Needs hidden % 8 == 0 and inter % 8 == 0 (16-byte rows;
// % 16 for an FP8 weight along its k), FP8 scale blocks of block_n >= 1 by
// block_k a multiple of 16, 1 <= top_k <= 16, 1 <= num_experts <= 1024,
// hidden and inter below 2^24, gate_up [2 inter, hidden], down [hidden, inter],
// 16-byte aligned data.
const char* moe_decode_unsupported(int64_t hidden, int64_t inter, int64_t num_experts, int64_t top_k,
                                   const WeightView& gate_up, const WeightView& down);

// Bytes of scratch h for steps of up to max_tokens tokens (f32 [max_tokens *
// top_k, inter]), max_tokens clamped to kMoeDecodeMaxTokens.
size_t moe_decode_scratch_bytes(int64_t max_tokens, int64_t top_k, int64_t inter);

// cudaSuccess when the launch takes `a`: what moe_decode_unsupported checks on
// the sizes, 1 <= num_tokens <= 16, num_tokens * top_k <= 256, non-null
// pointers, x and h 16-byte aligned, hidden % 16 == 0 with gate_up_fp8 and
// inter % 16 == 0 with down_fp8, up_slices 0, 1, 2, 4 or 8.
cudaError_t moe_decode_check(const MoeDecodeArgs& a);

// K slices of the up kernel for up_slices = 0: the S in {1, 2, 4, 8} that puts
// the number of streaming warps (min(pairs, experts) * inter / 2 * S) nearest
// ~11.7 per SM, each slice at least 32 chunks of 16 bytes a lane-row (the
// skinny GEMM's rule, skinny_default_slices).
int moe_decode_up_slices(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter,
                         bool gate_up_fp8, int num_sms);

// Runs the two kernels on `stream`. Errors: cudaErrorInvalidValue for what
// moe_decode_check refuses; launch errors.
cudaError_t launch_moe_decode(const MoeDecodeArgs& a, cudaStream_t stream);

}  // namespace nucleus::kernels
