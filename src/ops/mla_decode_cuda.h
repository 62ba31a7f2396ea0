// The CUDA backends of the mla_decode op family: "nucleus",
// "flashinfer" and "cuda_naive" (ops/mla_decode_cuda.cpp).
#pragma once

#include <cstddef>
#include <memory>

#include "core/status.h"
#include "ops/mla_decode.h"

namespace nucleus::cuda_ops {

// mla_decode fast backends (ops/mla_decode_cuda.cpp): "nucleus" (own
// split-KV kernel, its split partials in the step workspace) and "flashinfer"
// (FlashInfer's Hopper MLA kernel, planned on the host once per step; it
// refuses an op of a captured graph). Both need kv_lora 512, qk_rope 64,
// qk_nope 128, v_head 128 and a bf16 or FP8 kv_b_proj. nucleus reads a bf16
// or an FP8 (e4m3 x k_scale) cache; flashinfer reads bf16 rows only and
// refuses an FP8 cache.
Status mla_decode_nucleus_supports(const MlaDecodeAttentionOp& op);
void mla_decode_nucleus(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
size_t mla_decode_nucleus_workspace(const MlaDecodeAttentionOp& op, const StepLimits& limits);
Status mla_decode_flashinfer_supports(const MlaDecodeAttentionOp& op);
void mla_decode_flashinfer(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
size_t mla_decode_flashinfer_workspace(const MlaDecodeAttentionOp& op, const StepLimits& limits);
std::shared_ptr<StepPlan> mla_decode_flashinfer_plan(const MlaDecodeAttentionOp& op);

// Where a nucleus attention call of `rows` rows (all single-token rows, at
// most kernels::kMlaDecodeSmallRows) leaves its KV splits when the op stops
// after the attention kernel (MlaDecodeAttentionOp::output_in_program_rows):
// the grid's split count and the split rule's arguments (kernels/mla/
// mla_split_plan.h), and the partials part_o [rows, num_splits, heads, 512]
// f32 and part_lse [rows, num_splits, heads] at the start of the step
// workspace `workspace` (num_splits 1: o_lat [rows, heads, 512] bf16 at the
// start of the op's out[2] instead). The same choice the call makes, from the
// same switches, read now.
struct MlaDecodeSplitPlan {
  int num_splits = 1, min_split_keys = 0, key_tile = 32;
  const float* part_o = nullptr;
  const float* part_lse = nullptr;
};
MlaDecodeSplitPlan mla_decode_nucleus_split_plan(const MlaDecodeAttentionOp& op, int64_t rows, void* workspace);

// "cuda_naive": the plain absorbed-form kernel over the served rows,
// out[1].dim(0) rows per launch; bf16 or FP8 cache.
Status mla_decode_naive_supports(const MlaDecodeAttentionOp& op);
void mla_decode_naive(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
