#include "ops/mla_attention_cuda.h"

#include <string>

namespace nucleus::cuda_ops {

Status cuda_cache_dtype_supported(KvCacheDtype d) {
  if (d == KvCacheDtype::kBF16 || d == KvCacheDtype::kFp8E4M3) return ok_status();
  return unsupported(std::string("KV cache dtype ") + kv_cache_dtype_name(d) +
                     ": the CUDA kernels store and read bf16 or fp8_e4m3 rows");
}

kernels::MlaShape mla_naive_shape(const kernels::MlaDims& d) {
  kernels::MlaShape s;
  s.num_heads = static_cast<int>(d.num_heads);
  s.qk_nope = static_cast<int>(d.qk_nope);
  s.qk_rope = static_cast<int>(d.qk_rope);
  s.v_head = static_cast<int>(d.v_head);
  s.kv_lora = static_cast<int>(d.kv_lora);
  s.scale = d.scale;
  return s;
}

}  // namespace nucleus::cuda_ops
