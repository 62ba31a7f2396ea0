// The CUDA backends' run functions of every op family (ops/*_cuda.cpp), listed
// in the families' backend tables when the build has CUDA.
#pragma once

#ifdef NUCLEUS_HAVE_CUDA
#include "kernels/common/weight_view.cuh"
#include "ops/basic_ops.h"
#include "ops/linear_op.h"
#include "ops/mla_ops.h"
#include "ops/moe_ops.h"

namespace nucleus::cuda_ops {

// The kernels' view of a linear weight (bf16, or FP8 with f32 block scales).
kernels::WeightView weight_view(const LinearWeight& w);

// out[m, n] (+)= x W^T on the engine stream with the best backend for the
// weight: cuBLASLt for bf16, the plain kernel otherwise. x: [m, k] bf16.
void linear_forward(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out, DType out_dtype,
                    int64_t out_stride, bool accumulate);

void embedding(EmbeddingOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void rmsnorm(RmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void add_rmsnorm(AddRmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void silu_mul(SiluMulOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void gather_logit_rows(GatherLogitRowsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

Status linear_cublaslt_supports(const LinearOp& op);
void linear_cublaslt(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void linear_naive(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

void rope_kv_cache_write(RopeKvCacheWriteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void mla_decode_naive(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void mla_prefill_naive(MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

void moe_route(MoeRouteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void moe_experts_naive(MoeExpertsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// Expanded-form MLA prefill on tensor cores, all served sequences in one
// attention launch per scratch-sized batch (ops/mla_prefill_cuda.cpp).
Status mla_prefill_flash_supports(const MlaPrefillAttentionOp& op);
void mla_prefill_flash(MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
#endif  // NUCLEUS_HAVE_CUDA
