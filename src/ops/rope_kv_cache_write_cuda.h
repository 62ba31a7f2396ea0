// The CUDA backend of the rope_kv_cache_write op family
// (ops/rope_kv_cache_write_cuda.cpp).
#pragma once

#include "core/status.h"
#include "ops/rope_kv_cache_write.h"

namespace nucleus::cuda_ops {

// "cuda": one kernel rotates q and k_pe and writes the latent cache rows
// (kernels/rope/rope_kv_cache.cuh); it stores bf16 or FP8 e4m3 rows.
Status rope_kv_cache_write_supports(const RopeKvCacheWriteOp& op);
void rope_kv_cache_write(RopeKvCacheWriteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
