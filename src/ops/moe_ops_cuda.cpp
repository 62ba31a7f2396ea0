#include <algorithm>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "kernels/moe/moe_naive.cuh"
#include "ops/linear_cuda.h"
#include "ops/moe_cuda.h"
#include "ops/moe_decode.h"
#include "ops/op_cuda_check.h"
#include "ops/skinny.h"

namespace nucleus::cuda_ops {

void moe_route(MoeRouteOp& op, OpContext&, const TensorList& in, const TensorList& out) {
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_moe_route(op.params(), in[0].data<float>(),
                                               op.bias().defined() ? op.bias().data<float>() : nullptr, in[0].dim(0),
                                               out[0].data<int32_t>(), out[1].data<float>(),
                                               cuda::context().stream, small_ops_pdl(),
                                               moe_route_regs_switch() ? kernels::MoeRouteKernel::kAuto
                                                                       : kernels::MoeRouteKernel::kSharedMemory));
}

void moe_experts_naive(MoeExpertsOp& op, OpContext&, const TensorList& in, const TensorList& out) {
  Tensor& views = op.device_state();
  if (!views.defined()) {
    std::vector<kernels::ExpertView> host;
    for (const auto& e : op.experts()) host.push_back({weight_view(*e.gate_up), weight_view(*e.down)});
    const auto bytes = static_cast<int64_t>(host.size() * sizeof(kernels::ExpertView));
    views = Tensor::empty({bytes}, DType::kU8, Device::kCuda);
    copy_to_device(views.raw(), host.data(), static_cast<size_t>(bytes));
  }
  const Tensor& x = in[0];
  const int64_t T = x.dim(0), hidden = x.dim(1), chunk = out[1].dim(0);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_moe_experts_naive(
        x.data<__nv_bfloat16>() + t0 * hidden, n, hidden, op.inter(), in[1].data<int32_t>() + t0 * op.top_k(),
        in[2].data<float>() + t0 * op.top_k(), op.top_k(), views.data<kernels::ExpertView>(), out[1].data<float>(),
        out[0].data<__nv_bfloat16>() + t0 * hidden, cuda::context().stream));
  }
  moe_experts_add_rmsnorm(op, out);
}

}  // namespace nucleus::cuda_ops
