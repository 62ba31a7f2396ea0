#include "ops/mla_front_op.h"

#include <string>

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/mla_front_cuda.h"
#endif

namespace nucleus {

std::string MlaFrontOp::attrs() const {
  return "layer=" + std::to_string(layer_) + " heads=" + std::to_string(num_heads_) +
         " q_lora=" + std::to_string(q_lora_) + " cache=" + kv_cache_dtype_name(cache_dtype_);
}

Status mla_front_supported(const MlaFrontOp::Weights& w, int64_t hidden, int64_t q_lora, const kernels::MlaDims& dims,
                           KvCacheDtype cache_dtype) {
  if (dims.kv_lora != 512 || dims.qk_rope != 64 || dims.qk_nope != 128 || dims.v_head != 128)
    return unsupported("needs kv_lora 512, qk_rope 64, qk_nope 128, v_head 128 (got " + std::to_string(dims.kv_lora) +
                       ", " + std::to_string(dims.qk_rope) + ", " + std::to_string(dims.qk_nope) + ", " +
                       std::to_string(dims.v_head) + ")");
  if (cache_dtype != KvCacheDtype::kBF16)
    return unsupported(std::string("needs a bf16 KV cache (got ") + kv_cache_dtype_name(cache_dtype) + ")");
  if (hidden % 8 != 0) return unsupported("hidden size " + std::to_string(hidden) + " is not a multiple of 8");
  if (q_lora % 8 != 0 || q_lora > 8192)
    return unsupported("q_lora_rank " + std::to_string(q_lora) + " is not a multiple of 8 up to 8192");
  if ((q_lora > 0) != (w.q_a != nullptr && w.q_a_norm != nullptr))
    return unsupported("q LoRA weights do not match q_lora_rank");
  for (const LinearWeight* lw : {w.q_a, w.q, w.kv_a, w.kv_b}) {
    if (!lw) continue;
    if (lw->weight.dtype() != DType::kBF16)
      return unsupported(lw->name + " is " + dtype_name(lw->weight.dtype()) + " (the width builds read bf16 weights)");
  }
  if (!w.q || !w.kv_a || !w.kv_a_norm || !w.kv_b) return unsupported("an attention weight is missing");
  return ok_status();
}

const std::vector<Backend<MlaFrontOp>>& MlaFrontOp::backends() {
  static const std::vector<Backend<MlaFrontOp>> list = {
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda_width_builds", Device::kCuda, cuda_ops::mla_front_supports, cuda_ops::mla_front},
#endif
  };
  return list;
}

}  // namespace nucleus
