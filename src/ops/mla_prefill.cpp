#include "ops/mla_prefill.h"

#include <string>
#include <vector>

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/mla_prefill_cuda.h"
#endif

namespace nucleus {

std::string MlaPrefillAttentionOp::attrs() const {
  return "layer=" + std::to_string(layer()) + " heads=" + std::to_string(dims().num_heads) +
         " mode=" + attention_mode_name(mode()) + " context_chunk=" + std::to_string(context_chunk_) +
         " cache=" + kv_cache_dtype_name(cache_dtype());
}

const std::vector<Backend<MlaPrefillAttentionOp>>& MlaPrefillAttentionOp::backends() {
  static const std::vector<Backend<MlaPrefillAttentionOp>> list = {
      {"cpu_ref", Device::kCpu, [](const MlaPrefillAttentionOp& op) { return cpu_kv_b_supported(op); },
       [](MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         run_mla_reference(op, false, ctx, in[0], out[0], kernels::mla_attention_expanded_ref);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda_flash", Device::kCuda, cuda_ops::mla_prefill_flash_supports, cuda_ops::mla_prefill_flash,
       cuda_ops::mla_prefill_flash_workspace, cuda_ops::mla_prefill_flash_reserve,
       cuda_ops::mla_prefill_flash_plan},
      {"cuda_naive", Device::kCuda, cuda_ops::mla_prefill_naive_supports, cuda_ops::mla_prefill_naive},
#endif
  };
  return list;
}

}  // namespace nucleus
