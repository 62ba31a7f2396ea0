#include "ops/rope_kv_cache_write.h"

#include <cstring>
#include <vector>

#include "core/check.h"
#include "kernels/rmsnorm/rmsnorm_ref.h"
#include "ops/mla_attention.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/rope_kv_cache_write_cuda.h"
#endif

namespace nucleus {

std::string RopeKvCacheWriteOp::attrs() const {
  return "layer=" + std::to_string(layer_) + " heads=" + std::to_string(dims_.num_heads) +
         " rope=" + std::to_string(dims_.qk_rope) + " cache=" + kv_cache_dtype_name(cache_dtype_) +
         (kv_norm_weight_.defined() ? " kv_norm=1" : "");
}

const std::vector<Backend<RopeKvCacheWriteOp>>& RopeKvCacheWriteOp::backends() {
  static const std::vector<Backend<RopeKvCacheWriteOp>> list = {
      {"cpu_ref", Device::kCpu,
       [](const RopeKvCacheWriteOp&) -> Status { return ok_status(); },
       [](RopeKvCacheWriteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         const auto& d = op.dims();
         const StepInputs& si = *ctx.inputs;
         KvCache& kv = *ctx.kv_cache;
         check_cache_dtype(kv, op.cache_dtype(), "rope_kv_cache_write");
         const Tensor& q = out[0];
         if (q.raw() != in[0].raw())  // out of place: rotate a copy
           for (int64_t t = 0; t < q.dim(0); ++t)
             std::memcpy(q.data<float>() + t * q.row_numel(), in[0].data<float>() + t * in[0].row_numel(),
                         q.dim(1) * sizeof(float));
         const Tensor& kv_a = in[1];
         const int64_t q_stride = q.row_numel(), kv_stride = kv_a.row_numel();
         auto* cache = static_cast<char*>(kv.layer_data(op.layer()));
         const int64_t row_bytes = kv.row_bytes();
         const float k_scale = kv.layer_k_scale(op.layer());
         std::vector<float> k_pe(d.qk_rope), latent(kv.width);
         for (int64_t t = 0; t < si.num_tokens(); ++t) {
           const int64_t pos = si.positions[t];
           for (int64_t h = 0; h < d.num_heads; ++h)
             kernels::apply_rope_interleaved_ref(op.rope(), pos, q.data<float>() + t * q_stride + h * d.qk_head() +
                                                                   d.qk_nope);
           const float* row = kv_a.data<float>() + t * kv_stride;
           std::memcpy(k_pe.data(), row + d.kv_lora, d.qk_rope * 4);
           kernels::apply_rope_interleaved_ref(op.rope(), pos, k_pe.data());
           const int64_t slot = si.slot_mapping[t];
           if (slot < 0) continue;
           NUCLEUS_CHECK(slot < kv.num_slots(), "slot {} outside the cache ({} slots)", slot, kv.num_slots());
           if (op.kv_norm_weight().defined())  // the fused kv_a_layernorm: RmsNormOp's reference
             kernels::rmsnorm_ref(row, kv_stride, op.kv_norm_weight().data<float>(), 1, d.kv_lora, op.kv_norm_eps(),
                                  latent.data(), kv.width);
           else
             std::memcpy(latent.data(), row, d.kv_lora * 4);
           std::memcpy(latent.data() + d.kv_lora, k_pe.data(), d.qk_rope * 4);
           encode_kv_row(latent.data(), kv.width, kv.dtype(), k_scale, cache + slot * row_bytes);
         }
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda", Device::kCuda, cuda_ops::rope_kv_cache_write_supports, cuda_ops::rope_kv_cache_write},
#endif
  };
  return list;
}

}  // namespace nucleus
