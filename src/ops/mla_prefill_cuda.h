// The CUDA backends of the mla_prefill op family: "cuda_flash" and
// "cuda_naive" (ops/mla_prefill_cuda.cpp).
#pragma once

#include <cstddef>
#include <memory>

#include "core/status.h"
#include "ops/mla_prefill.h"

namespace nucleus::cuda_ops {

// Expanded-form MLA prefill on tensor cores, all served sequences in one
// attention launch per scratch-sized batch (ops/mla_prefill_cuda.cpp).
// Its K/V expansion scratch and LSE live in the step workspace; the batching
// of the step's sequences is a per-step plan (host, uploaded once per step).
Status mla_prefill_flash_supports(const MlaPrefillAttentionOp& op);
void mla_prefill_flash(MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
size_t mla_prefill_flash_workspace(const MlaPrefillAttentionOp& op, const StepLimits& limits);
// Makes the K/V expansion (GatherKvBProj) now, so that what it allocates is
// counted before the KV pool is sized; its errors (an allocation failing).
Status mla_prefill_flash_reserve(MlaPrefillAttentionOp& op, const StepLimits& limits, Device device);
std::shared_ptr<StepPlan> mla_prefill_flash_plan(const MlaPrefillAttentionOp& op);

// "cuda_naive": expanded-form attention on the plain kernels, K/V expanded
// from the latent cache at most context_chunk rows (and 256 MiB of scratch)
// at a time; bf16 or FP8 cache.
Status mla_prefill_naive_supports(const MlaPrefillAttentionOp& op);
void mla_prefill_naive(MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
