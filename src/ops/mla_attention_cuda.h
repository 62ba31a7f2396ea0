// CUDA helpers the MLA op families' CUDA backends share (rope_kv_cache_write,
// mla_decode, mla_prefill; ops/mla_attention_cuda.cpp).
#pragma once

#include "core/status.h"
#include "kernels/mla/mla_attention_naive.cuh"
#include "kernels/mla/mla_attention_ref.h"
#include "ops/kv_cache_dtype.h"

namespace nucleus::cuda_ops {

// OK when the CUDA kernels store or read a `d` latent cache (bf16, or FP8
// e4m3 with k_scale); an f32 cache is CPU-only.
Status cuda_cache_dtype_supported(KvCacheDtype d);

// The naive MLA kernels' shape (kernels/mla/mla_attention_naive.cuh) of `d`.
kernels::MlaShape mla_naive_shape(const kernels::MlaDims& d);

}  // namespace nucleus::cuda_ops
