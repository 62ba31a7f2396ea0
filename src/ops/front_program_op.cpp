#include "ops/front_program_op.h"

#include "kernels/mono/mono_program.h"
#include "ops/decode_program.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/front_program_cuda.h"
#endif

namespace nucleus {

std::string FrontProgramOp::attrs() const {
  return "layer=" + std::to_string(layer_) + (has_delta() ? "" : " first") + (absorbs() ? " absorbs" : "") +
         (attend_ ? " attends" : "");
}

Status front_program_supported(const FrontProgramOp& op) {
  const FrontProgramOp::Parts& p = op.parts();
  const bool lora = p.q_a != nullptr;
  if (!p.norm || !p.kv_a || !p.rope || (lora ? !p.q_a_norm || !p.q_b : !p.q_proj))
    return unsupported("a part of the front is missing");
  const int64_t H = op.hidden();
  if (H % 16 != 0 || H > 8192) return unsupported("hidden size " + std::to_string(H) + " is not a multiple of 16 up to 8192");
  if (p.norm->all_reduce().comm) return unsupported("tensor parallelism all-reduces the delta before the norm");
  if (p.norm->weight().dtype() != DType::kF32 || p.norm->weight().numel() != H)
    return unsupported("the input norm's weight is not f32 [hidden]");
  if (p.q_a_norm && p.q_a_norm->weight().dtype() != DType::kF32) return unsupported("q_a_layernorm's weight is not f32");
  if (p.rope->kv_norm_weight().defined() && p.rope->kv_norm_weight().dtype() != DType::kF32)
    return unsupported("kv_a_layernorm's weight is not f32");
  for (const LinearOp* l : {p.q_proj.get(), p.q_a.get(), p.q_b.get(), p.kv_a.get()}) {
    if (!l) continue;
    const LinearWeight& w = l->weight();
    NUCLEUS_RETURN_IF_ERROR(program_weight_supported(w));
    if (l != p.q_b.get() && w.in_features != H) return unsupported(w.name + " does not read the hidden state");
  }
  if (lora) {
    const int64_t q_lora = p.q_a->weight().out_features;
    if (q_lora % 16 != 0 || q_lora > 8192 || p.q_b->weight().in_features != q_lora || p.q_a_norm->width() != q_lora)
      return unsupported("q_lora_rank " + std::to_string(q_lora) + " (need a multiple of 16 up to 8192)");
  }
  const RopeKvCacheWriteOp& r = *p.rope;
  if (!r.kv_norm_weight().defined()) return unsupported("kv_a_layernorm is not fused into the RoPE op (NUCLEUS_FUSE_KV_A_NORM=0)");
  if (r.cache_dtype() != KvCacheDtype::kBF16) return unsupported("the KV cache is not bf16");
  if (!r.inv_freq_device()) return unsupported("no device RoPE frequencies");
  const kernels::MlaDims& d = r.dims();
  if (d.qk_rope < 2 || d.qk_rope % 2 != 0 || d.qk_rope > 128 || d.kv_lora < 1 || d.kv_lora > 1024)
    return unsupported("qk_rope " + std::to_string(d.qk_rope) + ", kv_lora " + std::to_string(d.kv_lora) +
                       " (need an even qk_rope up to 128 and kv_lora up to 1024)");
  if ((lora ? p.q_b : p.q_proj)->weight().out_features != d.num_heads * (d.qk_nope + d.qk_rope) ||
      p.kv_a->weight().out_features != d.kv_lora + d.qk_rope)
    return unsupported("q_proj / kv_a widths do not match the attention's dims");
  if (const LinearWeight* kv_b = p.kv_b) {
    NUCLEUS_RETURN_IF_ERROR(program_weight_supported(*kv_b));
    if (kv_b->fp8() && (d.qk_nope % 128 != 0 || d.v_head % 128 != 0))
      return unsupported(kv_b->name + ": an FP8 absorption needs qk_nope and v_head multiples of 128 (whole scale blocks a head)");
    if (kv_b->out_features != d.num_heads * (d.qk_nope + d.v_head) || kv_b->in_features != d.kv_lora)
      return unsupported(kv_b->name + " is not [heads * (qk_nope + v_head), kv_lora]");
    if (d.num_heads > kernels::mono::kMaxHeadSlots || d.qk_nope < 16 || d.qk_nope % 16 != 0 ||
        (d.qk_nope + d.qk_rope) % 8 != 0)
      return unsupported("the absorption takes at most 128 heads and qk_nope a multiple of 16 (heads " +
                         std::to_string(d.num_heads) + ", qk_nope " + std::to_string(d.qk_nope) + ")");
    if (d.kv_lora != 512 || d.qk_rope != 64)  // the absorbed query [heads, 576] the decode attention reads
      return unsupported("the absorbed query is read as [heads, 512 + 64] (kv_lora " + std::to_string(d.kv_lora) +
                         ", qk_rope " + std::to_string(d.qk_rope) + ")");
  }
  if (op.attends() && (!p.kv_b || !(op.attend_scale() > 0.0f) || !op.attend_buffer()))
    return unsupported("the attention runs in a front that absorbs the query, with a positive softmax scale and a "
                       "partials buffer");
  return ok_status();
}

const std::vector<Backend<FrontProgramOp>>& FrontProgramOp::backends() {
  static const std::vector<Backend<FrontProgramOp>> list = {
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda_program", Device::kCuda, cuda_ops::front_program_supports, cuda_ops::front_program, nullptr,
       cuda_ops::front_program_reserve},
#endif
  };
  return list;
}

}  // namespace nucleus
