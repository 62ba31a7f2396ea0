#include "ops/mla_decode.h"

#include <string>
#include <vector>

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/mla_decode_cuda.h"
#endif

namespace nucleus {

std::string MlaDecodeAttentionOp::attrs() const {
  return "layer=" + std::to_string(layer()) + " heads=" + std::to_string(dims().num_heads) +
         " mode=" + attention_mode_name(mode()) + " cache=" + kv_cache_dtype_name(cache_dtype());
}

const std::vector<Backend<MlaDecodeAttentionOp>>& MlaDecodeAttentionOp::backends() {
  static const std::vector<Backend<MlaDecodeAttentionOp>> list = {
      {"cpu_ref", Device::kCpu, [](const MlaDecodeAttentionOp& op) { return cpu_kv_b_supported(op); },
       [](MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         run_mla_reference(op, true, ctx, in[0], out[0], kernels::mla_attention_absorbed_ref);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      // nucleus first although FlashInfer is faster at most shapes (docs/perf.md,
      // "MLA decode attention"): FlashInfer plans on the host, so it refuses
      // a captured graph, and a graph replay (nucleus) would then differ from
      // an eager step (the graphs must be bit-identical to eager runs).
      {"nucleus", Device::kCuda, cuda_ops::mla_decode_nucleus_supports, cuda_ops::mla_decode_nucleus,
       cuda_ops::mla_decode_nucleus_workspace},
      {"flashinfer", Device::kCuda, cuda_ops::mla_decode_flashinfer_supports, cuda_ops::mla_decode_flashinfer,
       cuda_ops::mla_decode_flashinfer_workspace, nullptr, cuda_ops::mla_decode_flashinfer_plan},
      {"cuda_naive", Device::kCuda, cuda_ops::mla_decode_naive_supports, cuda_ops::mla_decode_naive},
#endif
  };
  return list;
}

}  // namespace nucleus
