// The cuda_decode backend of moe_experts: steps of at most
// moe_decode_max_tokens() tokens (ops/moe_decode.h) run the fused decode
// kernels (kernels/moe/moe_decode.cuh; bf16 or FP8 block-scaled weights),
// each activated expert's weights read once a step; larger steps run cuda_grouped in the same call (a decode
// graph's width fixes the choice per graph). Hence it takes only experts
// cuda_grouped takes too, shares its state (the experts' device views) and
// reservation, and its workspace is the larger of the two paths' (the arena
// serves one of them per run).
#include <algorithm>
#include <string>

#include "core/cuda/context.h"
#include "kernels/moe/moe_decode.cuh"
#include "ops/linear_cuda.h"
#include "ops/moe_cuda.h"
#include "ops/moe_decode.h"
#include "ops/op_cuda_check.h"
#include "ops/skinny.h"

namespace nucleus::cuda_ops {

static_assert(kMoeDecodeKernelMaxTokens == kernels::kMoeDecodeMaxTokens, "ops/moe_decode.h mirrors the kernel's limit");

namespace {

int64_t hidden_of(const MoeExpertsOp& op) { return op.experts().front().gate_up->in_features; }

}  // namespace

Status moe_experts_decode_supports(const MoeExpertsOp& op) {
  if (moe_decode_max_tokens() == 0)
    return unsupported("off (NUCLEUS_MOE_DECODE=0, or auto: slower than cuda_grouped at every measured T, ops/moe_decode.h)");
  if (op.experts().empty()) return unsupported("no experts");
  if (Status s = moe_experts_grouped_supports(op); !s.ok())
    return unsupported("steps past the decode kernel's size run cuda_grouped, which refuses: " + s.message());
  const LinearWeight& gu = *op.experts().front().gate_up;
  const LinearWeight& dn = *op.experts().front().down;
  if (const char* why = kernels::moe_decode_unsupported(hidden_of(op), op.inter(),
                                                        static_cast<int64_t>(op.experts().size()), op.top_k(),
                                                        weight_view(gu), weight_view(dn)))
    return unsupported(why);
  return ok_status();
}

size_t moe_experts_decode_workspace(const MoeExpertsOp& op, const StepLimits& limits) {
  const int64_t decode_tokens = std::min(limits.max_tokens, moe_decode_max_tokens());
  return std::max(moe_experts_grouped_workspace(op, limits),
                  kernels::moe_decode_scratch_bytes(decode_tokens, op.top_k(), op.inter()));
}

Status moe_experts_decode_reserve(MoeExpertsOp& op, const StepLimits& limits, Device device) {
  return moe_experts_grouped_reserve(op, limits, device);
}

void moe_experts_decode(MoeExpertsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const Tensor& x = in[0];
  const int64_t T = x.dim(0);
  if (T == 0) return;
  if (T > moe_decode_max_tokens()) return moe_experts_grouped(op, ctx, in, out);
  const size_t need = kernels::moe_decode_scratch_bytes(T, op.top_k(), op.inter());
  if (ctx.workspace.bytes < need)
    return ctx.fail(failed_precondition("cuda_decode moe_experts: step workspace of " +
                                        std::to_string(ctx.workspace.bytes) + " bytes, " + std::to_string(T) +
                                        " tokens need " + std::to_string(need) + " (not reserved for this step)"));
  kernels::MoeDecodeArgs a;
  a.x = x.data<__nv_bfloat16>();
  a.topk_ids = in[1].data<int32_t>();
  a.topk_weights = in[2].data<float>();
  a.num_tokens = T;
  a.hidden = x.dim(1);
  a.inter = op.inter();
  a.num_experts = static_cast<int64_t>(op.experts().size());
  a.top_k = op.top_k();
  a.experts = moe_experts_grouped_views(op);
  a.h = static_cast<float*>(ctx.workspace.data);
  a.out = out[0].data<__nv_bfloat16>();
  a.gate_up_fp8 = op.experts().front().gate_up->fp8();
  a.down_fp8 = op.experts().front().down->fp8();
  a.pdl = skinny_pdl();
  NUCLEUS_CHECK(a.hidden == hidden_of(op), "moe_experts x width {} vs hidden {}", a.hidden, hidden_of(op));
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_moe_decode(a, cuda::context().stream));
  moe_experts_add_rmsnorm(op, out);
}

}  // namespace nucleus::cuda_ops
