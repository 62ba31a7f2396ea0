#include "ops/moe_program_op.h"

#include "kernels/mono/mono_program.h"
#include "ops/decode_program.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/moe_program_cuda.h"
#endif

namespace nucleus {

std::string MoeProgramOp::attrs() const {
  const std::string block =
      dense() ? " dense MLP " + std::to_string(parts_.down->weight().in_features)
              : " experts=" + std::to_string(parts_.experts->experts().size()) + " (shared " +
                    std::to_string(shared_pieces_) + ") top_k=" + std::to_string(parts_.route->params().top_k);
  return "layer=" + std::to_string(layer_) + block +
         (next_front_ ? " +front of layer " + std::to_string(next_front_->layer()) : "") +
         (attention_ ? " +attention output" : "");
}

Status moe_program_supported(const MoeProgramOp& op) {
  const MoeProgramOp::Parts& p = op.parts();
  if (!p.o_proj || !p.norm || (op.dense() ? !p.act || !p.down || p.router || p.route || p.experts
                                          : !p.router || !p.route || !p.experts))
    return unsupported("a part of the block is missing");
  const int64_t H = op.hidden();
  if (H % 16 != 0 || H > 8192) return unsupported("hidden size " + std::to_string(H) + " is not a multiple of 16 up to 8192");
  const LinearWeight& o = p.o_proj->weight();
  NUCLEUS_RETURN_IF_ERROR(program_weight_supported(o));
  if (o.out_features != H || o.in_features % 16 != 0 || o.in_features > kernels::mono::kMaxGlobalK)
    return unsupported(o.name + ": an input width of " + std::to_string(o.in_features) +
                       " (need a multiple of 16 up to 32768)");
  if (p.norm->all_reduce().comm) return unsupported("tensor parallelism all-reduces the delta before the norm");
  if (p.norm->weight().dtype() != DType::kF32 || p.norm->weight().numel() != H)
    return unsupported("the post-attention norm's weight is not f32 [hidden]");
  if (op.dense()) {  // the MLP: gate_up [2 inter, hidden], down [hidden, inter]
    const LinearWeight& gu = p.gate_up->weight();
    const LinearWeight& dn = p.down->weight();
    NUCLEUS_RETURN_IF_ERROR(program_weight_supported(gu));
    NUCLEUS_RETURN_IF_ERROR(program_weight_supported(dn));
    const int64_t inter = dn.in_features;
    if (inter % 16 != 0 || inter > kernels::mono::kMaxGlobalK || gu.out_features != 2 * inter ||
        gu.in_features != H || dn.out_features != H)
      return unsupported(gu.name + ": an MLP of width " + std::to_string(inter) +
                         " (need a multiple of 16 up to 32768 and [2 inter, hidden] / [hidden, inter])");
  } else {
    if (p.experts->fuses_add_rmsnorm()) return unsupported("the experts op runs the next add + norm");
    const LinearWeight& router = p.router->weight();
    if (router.weight.dtype() != DType::kBF16) return unsupported("the router weight is not bf16");
    const kernels::MoeRoutingParams& r = p.route->params();
    if (r.num_experts < 1 || r.num_experts > 384) return unsupported("more than 384 routed experts");
    if (r.method == TopkMethod::kGroupLimitedGreedy ||
        (r.method == TopkMethod::kNoauxTc && (r.n_group > 8 || r.num_experts % r.n_group != 0)))
      return unsupported("routing other than greedy or noaux_tc in at most 8 groups");
    if (r.top_k * 8 > 64) return unsupported("top_k " + std::to_string(r.top_k) + ": 8 rows would need more than 64 slots");
    if (r.shared_slots != op.shared_pieces()) return unsupported("the route op's shared slots are not the shared pieces");
    const auto& experts = p.experts->experts();
    if (static_cast<int64_t>(experts.size()) != r.num_experts + op.shared_pieces())
      return unsupported("the experts op does not hold the routed experts and the shared pieces");
    for (size_t e = 0; e < experts.size(); ++e) {
      const LinearWeight& gu = *experts[e].gate_up;
      const LinearWeight& dn = *experts[e].down;
      NUCLEUS_RETURN_IF_ERROR(program_weight_supported(gu));
      NUCLEUS_RETURN_IF_ERROR(program_weight_supported(dn));
      const int64_t inter = dn.in_features;
      if (inter % 16 != 0 || inter > 8192 || gu.out_features != 2 * inter || gu.in_features != H || dn.out_features != H)
        return unsupported(gu.name + ": an expert of width " + std::to_string(inter) +
                           " (need a multiple of 16 up to 8192 and [2 inter, hidden] / [hidden, inter])");
      const bool shared = static_cast<int64_t>(e) >= r.num_experts;
      const LinearWeight& same = *experts[shared ? r.num_experts : 0].down;
      if (inter != same.in_features) return unsupported("experts of different widths");
      const size_t first = shared ? static_cast<size_t>(r.num_experts) : 0;
      if (gu.fp8() != experts[first].gate_up->fp8() || dn.fp8() != experts[first].down->fp8())
        return unsupported(gu.name + ": experts of different weight types (one stage reads them all)");
    }
  }
  if (const MlaDecodeAttentionOp* a = op.attention()) {
    const kernels::MlaDims& d = a->dims();
    if (a->layer() != op.layer() ||
        (a->output_in_program_rows() != op.max_rows() && a->attention_in_program_rows() != op.max_rows()))
      return unsupported("the attention op is not this layer's, set to leave its output to the program");
    if (d.kv_lora != 512 || d.qk_rope != 64 || d.qk_nope != 128 || d.v_head != 128 || d.num_heads < 1 ||
        d.num_heads > kernels::mono::kMaxHeadSlots)
      return unsupported("the attention output needs kv_lora 512, qk_rope 64, qk_nope 128, v_head 128 and at most 128 "
                         "heads (heads " + std::to_string(d.num_heads) + ")");
    if (a->attention_in_program_rows() > 0 && !op.attention_buffer())
      return unsupported("the attention runs in the front program but the block has no partials buffer");
    NUCLEUS_RETURN_IF_ERROR(program_weight_supported(a->kv_b()));
    if (o.in_features != d.num_heads * d.v_head) return unsupported("o_proj does not read the attention's heads");
  }
  // The stages one program holds (moe_chain_stages, attention_output_stages, front_chain_stages).
  const int64_t stages = (op.dense() ? 4 : 6 + (op.shared_pieces() > 0 ? 2 : 0)) + (op.attention() ? 2 : 0) +
                         (op.next_front() ? 3 + (op.next_front()->parts().q_a ? 1 : 0) +
                                                (op.next_front()->absorbs() ? 1 : 0) +
                                                (op.next_front()->attends() ? 1 : 0)
                                          : 0);
  if (stages > kernels::mono::kMaxStages)
    return unsupported(std::to_string(stages) + " stages, more than a program holds (" +
                       std::to_string(kernels::mono::kMaxStages) + ")");
  if (const FrontProgramOp* f = op.next_front()) {
    if (f->layer() != op.layer() + 1 || !f->has_delta() || f->hidden() != H || f->max_rows() != op.max_rows())
      return unsupported("the joined front is not the next layer's (layer " + std::to_string(f->layer()) +
                         ", hidden " + std::to_string(f->hidden()) + ", at most " + std::to_string(f->max_rows()) +
                         " rows a program)");
    if (Status why = front_program_supported(*f); !why.ok())
      return unsupported("the joined front: " + why.message());
  }
  return ok_status();
}

const std::vector<Backend<MoeProgramOp>>& MoeProgramOp::backends() {
  static const std::vector<Backend<MoeProgramOp>> list = {
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda_program", Device::kCuda, cuda_ops::moe_program_supports, cuda_ops::moe_program, nullptr,
       cuda_ops::moe_program_reserve},
#endif
  };
  return list;
}

}  // namespace nucleus
