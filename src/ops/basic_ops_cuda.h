// The CUDA backends of the basic op families (ops/basic_ops_cuda.cpp):
// embedding, rmsnorm, add_rmsnorm (unfused), silu_mul, gather_logit_rows; and
// the prezero donor's fill sizing that collective_ops_cuda.cpp shares.
#pragma once

#include <cstdint>

#include "kernels/rmsnorm/rmsnorm.cuh"
#include "ops/basic_ops.h"

namespace nucleus::cuda_ops {

// Blocks a prezero donor gives its zero-fill of `bytes` bytes beside the
// norm's `rows` blocks: one per kPrezeroFillBytesPerBlock, at least one, at
// most the SMs the norm leaves idle.
constexpr int64_t kPrezeroFillBytesPerBlock = 32 * 1024;
int prezero_fill_blocks(int64_t rows, int64_t bytes);

// A prezero donor's fill of `buffer` ([m, n_total] f32; prezero_fill_count)
// for p's rows: p.zero_fill, zero_fill_count and fill_blocks (none when the
// gate fills nothing). p.rows must be set.
void set_prezero_fill(const PrezeroDonor& donor, const Tensor& buffer, kernels::AddRmsNormParams& p);

void embedding(EmbeddingOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void rmsnorm(RmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
// With an all-reduce (tensor parallelism): the NCCL all-reduce of the delta,
// then the add+norm kernel (the unfused path).
void add_rmsnorm(AddRmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// Two launches of the f32 -> bf16 RMSNorm into the halves of cat, a memset of
// the residual (and of the embedding rows at position 0 when asked).
void mtp_input(MtpInputOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

void silu_mul(SiluMulOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void gather_logit_rows(GatherLogitRowsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
