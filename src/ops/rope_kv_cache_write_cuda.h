// The CUDA backend of rope_kv_cache_write and the naive CUDA backends of
// mla_decode and mla_prefill (ops/rope_kv_cache_write_cuda.cpp).
#pragma once

#include "core/status.h"
#include "ops/kv_cache_dtype.h"
#include "ops/mla_attention.h"

namespace nucleus::cuda_ops {

// OK when the CUDA kernels store or read a `d` latent cache (bf16, or FP8
// e4m3 with k_scale); an f32 cache is CPU-only.
Status cuda_cache_dtype_supported(KvCacheDtype d);

Status rope_kv_cache_write_supports(const RopeKvCacheWriteOp& op);
void rope_kv_cache_write(RopeKvCacheWriteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
