#include "ops/moe_ops.h"

#include <algorithm>
#include <set>

#include "core/device.h"
#include "io/hf_config.h"
#include "kernels/rmsnorm/rmsnorm_ref.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/moe_cuda.h"
#endif

namespace nucleus {

std::string MoeRouteOp::attrs() const {
  return std::string("experts=") + std::to_string(params_.num_experts) + " top_k=" + std::to_string(params_.top_k) +
         " scoring=" + scoring_func_name(params_.scoring) + " method=" + topk_method_name(params_.method) +
         " groups=" + std::to_string(params_.topk_group) + "/" + std::to_string(params_.n_group) +
         (params_.shared_slots > 0 ? " shared_slots=" + std::to_string(params_.shared_slots) : std::string());
}

void MoeRouteOp::run(OpContext& ctx, const TensorList& in, const TensorList& out) {
  OpWithBackends<MoeRouteOp>::run(ctx, in, out);
  if (!ctx.stats) return;
  Tensor ids = to_host(out[0]);
  std::set<int32_t> unique;
  for (int64_t i = 0; i < ids.numel(); ++i)
    if (ids.data<int32_t>()[i] < params_.num_experts) unique.insert(ids.data<int32_t>()[i]);
  ++ctx.stats->moe_layers;
  ctx.stats->experts_activated += static_cast<int64_t>(unique.size());
}

const std::vector<Backend<MoeRouteOp>>& MoeRouteOp::backends() {
  static const std::vector<Backend<MoeRouteOp>> list = {
      {"cpu_ref", Device::kCpu, nullptr,
       [](MoeRouteOp& op, OpContext&, const TensorList& in, const TensorList& out) {
         kernels::moe_route_ref(op.params(), in[0].data<float>(), op.bias().defined() ? op.bias().data<float>() : nullptr,
                                in[0].dim(0), out[0].data<int32_t>(), out[1].data<float>());
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda", Device::kCuda,
       [](const MoeRouteOp& op) -> Status {
         const auto& p = op.params();
         if (p.num_experts > 1024 || p.top_k > 16 || p.n_group > 64 || p.shared_slots > 16)
           return unsupported("the CUDA router takes at most 1024 experts, top_k 16, 64 groups and 16 shared slots (got " +
                              std::to_string(p.num_experts) + ", " + std::to_string(p.top_k) + ", " +
                              std::to_string(p.n_group) + ", " + std::to_string(p.shared_slots) + ")");
         return Status();
       },
       cuda_ops::moe_route},
#endif
  };
  return list;
}

std::string MoeExpertsOp::attrs() const {
  std::string a = "experts=" + std::to_string(experts_.size()) + " inter=" + std::to_string(inter_) +
                  " top_k=" + std::to_string(top_k_);
  if (fuses_add_rmsnorm()) a += " add_rmsnorm=1";
  return a + prezero_attrs(prezero_);
}

const std::vector<Backend<MoeExpertsOp>>& MoeExpertsOp::backends() {
  static const std::vector<Backend<MoeExpertsOp>> list = {
      {"cpu_ref", Device::kCpu,
       [](const MoeExpertsOp& op) -> Status {
         for (const auto& e : op.experts())
           if (e.gate_up->weight.dtype() != DType::kF32 || e.down->weight.dtype() != DType::kF32)
             return unsupported("expert weights are not F32");
         return ok_status();
       },
       [](MoeExpertsOp& op, OpContext&, const TensorList& in, const TensorList& out) {
         std::vector<kernels::ExpertWeightsRef> refs;
         refs.reserve(op.experts().size());
         for (const auto& e : op.experts()) refs.push_back({e.gate_up->weight.data<float>(), e.down->weight.data<float>()});
         const int64_t hidden = in[0].dim(1);
         kernels::moe_experts_ref(in[0].data<float>(), in[0].dim(0), hidden, op.inter(), in[1].data<int32_t>(),
                                  in[2].data<float>(), op.top_k(), refs.data(), out[0].data<float>(), false);
         if (!op.fuses_add_rmsnorm()) return;
         // The add + norm after it: AddRmsNormOp's cpu_ref on out[0].
         const Tensor& residual = out[2];
         kernels::add_rmsnorm_ref(residual.data<float>(), out[0].data<float>(), op.norm_weight().data<float>(),
                                  residual.dim(0), residual.dim(1), op.norm_eps(), out[3].data<float>());
         if (op.prezero().n_total > 0)  // the donor's fill
           std::fill_n(out[4].data<float>(), prezero_fill_count(op.prezero(), out[4].dim(0)), 0.0f);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda_decode", Device::kCuda, cuda_ops::moe_experts_decode_supports, cuda_ops::moe_experts_decode,
       cuda_ops::moe_experts_decode_workspace, cuda_ops::moe_experts_decode_reserve},
      {"cuda_grouped", Device::kCuda, cuda_ops::moe_experts_grouped_supports, cuda_ops::moe_experts_grouped,
       cuda_ops::moe_experts_grouped_workspace, cuda_ops::moe_experts_grouped_reserve},
      {"cuda_naive", Device::kCuda, nullptr, cuda_ops::moe_experts_naive},
#endif
  };
  return list;
}

}  // namespace nucleus
