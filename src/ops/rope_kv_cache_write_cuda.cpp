// The CUDA backend of rope_kv_cache_write (kernels/rope/rope_kv_cache.cuh).
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "kernels/rope/rope_kv_cache.cuh"
#include "ops/mla_attention.h"
#include "ops/mla_attention_cuda.h"
#include "ops/op_cuda_check.h"
#include "ops/rope_kv_cache_write_cuda.h"
#include "ops/skinny.h"

namespace nucleus::cuda_ops {

namespace {
cudaStream_t stream() { return cuda::context().stream; }
}  // namespace

Status rope_kv_cache_write_supports(const RopeKvCacheWriteOp& op) {
  if (op.kv_norm_weight().defined()) {
    if (op.kv_norm_weight().dtype() != DType::kF32 || op.kv_norm_weight().device() != Device::kCuda)
      return unsupported("the fused kv_a_layernorm weight is not f32 on the GPU");
    if (op.dims().kv_lora > 1024) return unsupported("the fused kv_a_layernorm takes kv_lora <= 1024");
  }
  if (op.cache_dtype() == KvCacheDtype::kFp8DsMla)
    return op.dims().kv_lora == kDsMlaLatent && op.dims().qk_rope == kDsMlaRope
               ? ok_status()
               : unsupported("fp8_ds_mla rows need kv_lora 512 and qk_rope 64");
  return cuda_cache_dtype_supported(op.cache_dtype());
}

void rope_kv_cache_write(RopeKvCacheWriteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const auto& d = op.dims();
  KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), "rope_kv_cache_write");
  kernels::RopeKvCacheParams p;
  p.q = out[0].data<__nv_bfloat16>();
  p.q_stride = out[0].row_numel();
  if (in[0].dtype() == DType::kF32) {  // a split-K GEMM's output: written whole into the bf16 q
    p.q_in = in[0].data<float>();
    p.q_in_stride = in[0].row_numel();
  } else {
    NUCLEUS_CHECK(in[0].raw() == out[0].raw(), "rope: a bf16 q is rotated in place");
  }
  p.kv_a = in[1].data<__nv_bfloat16>();
  p.kv_stride = in[1].row_numel();
  if (op.kv_norm_weight().defined()) {
    p.kv_norm_w = op.kv_norm_weight().data<float>();
    p.kv_norm_eps = op.kv_norm_eps();
  }
  p.positions = ctx.dev->positions;
  p.slot_mapping = ctx.dev->slot_mapping;
  p.inv_freq = op.inv_freq_device();
  p.attention_factor = op.attention_factor();
  p.cache = kv.layer_data(op.layer());
  p.cache_fp8 = kv.dtype() == KvCacheDtype::kFp8E4M3;
  p.cache_ds_mla = kv.dtype() == KvCacheDtype::kFp8DsMla;
  p.k_scale = kv.layer_k_scale(op.layer());
  p.num_tokens = in[0].dim(0);
  p.num_heads = static_cast<int>(d.num_heads);
  p.qk_nope = static_cast<int>(d.qk_nope);
  p.qk_rope = static_cast<int>(d.qk_rope);
  p.kv_lora = static_cast<int>(d.kv_lora);
  p.pdl = small_ops_pdl();
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_rope_kv_cache_write(p, stream()));
}

}  // namespace nucleus::cuda_ops
