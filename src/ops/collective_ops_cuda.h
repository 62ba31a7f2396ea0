// The CUDA backends of the collective op families (ops/collective_ops_cuda.cpp):
// the fused all-reduce + add + RMSNorm backend of add_rmsnorm, and all_gather_vocab.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/status.h"
#include "ops/basic_ops.h"
#include "ops/collective_ops.h"

namespace nucleus::cuda_ops {

// The all-reduce + residual add + RMSNorm in one kernel over peer-mapped
// buffers (ops/collective_ops_cuda.cpp). Supports ops with an all-reduce, the
// fusion allowed, every rank's signal buffer and hidden a multiple of 8 up to
// 8192; takes a bf16 or f32 (split-K) delta, and a prezero donor's fill runs
// on extra CTAs of the same launch. Steps that fused_allreduce_chosen()
// (ops/allreduce_choice.h, measured on the H200) does not take run the
// unfused path instead (the choice depends only on the step's shape, so
// every rank makes the same).
Status add_rmsnorm_allreduce_fused_supports(const AddRmsNormOp& op);
void add_rmsnorm_allreduce_fused(AddRmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
// NUCLEUS_FUSED_ALLREDUCE_MAX_BYTES (read once), or -1 when unset: a byte
// limit that replaces the measured rule (for tuning).
int64_t fused_allreduce_max_bytes_override();
// Bytes of a rank's signal buffer for the fused kernel.
size_t fused_allreduce_signal_bytes();

void all_gather_vocab(AllGatherVocabOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
