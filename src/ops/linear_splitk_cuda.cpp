// The "cuda_splitk" linear backend: decode GEMMs of bf16 weights through the
// split-K kernel (kernels/gemm/splitk_gemm.cuh) into f32 outputs, honouring
// zero_init (a prezero consumer skips it when its donor zeroed the output).
// Rows above splitk_max_rows() run cuBLASLt into the same f32 output
// (overwriting, or adding for a genuine accumulator: what cuBLASLt writes
// does not depend on whether the buffer was zeroed). The deterministic mode's
// partial sums are the op's share of the step workspace, its per-tile
// counters the op's own (allocated at reservation).
#include <cuda_runtime_api.h>

#include <algorithm>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "kernels/gemm/gemm_cublaslt.h"
#include "kernels/gemm/gemm_naive.cuh"
#include "kernels/gemm/splitk_gemm.cuh"
#include "ops/linear_cuda.h"
#include "ops/op_cuda_check.h"
#include "ops/splitk.h"

namespace nucleus::cuda_ops {

namespace {
constexpr int64_t kMaxPartialFloats = int64_t{8} << 20;  // at most 32 MB of deterministic-mode partial sums
}  // namespace

Status linear_splitk_supports(const LinearOp& op) {
  if (!op.splitk_allowed()) return unsupported("not a decode-graph GEMM");
  const LinearWeight& w = op.weight();
  if (w.weight.dtype() != DType::kBF16)
    return unsupported(std::string("weight dtype ") + dtype_name(w.weight.dtype()) + " (needs BF16)");
  if (w.in_features % 8 != 0) return unsupported("in_features not a multiple of 8 (16-byte rows)");
  if (reinterpret_cast<uintptr_t>(w.weight.raw()) % 16 != 0) return unsupported("weight not 16-byte aligned");
  if (splitk_max_rows(w.out_features, w.in_features) == 0)
    return unsupported(splitk_switch() == SplitKSwitch::kOff
                           ? std::string("NUCLEUS_SPLITK=0")
                           : "weight of " + std::to_string(w.weight.nbytes() >> 20) +
                                 " MiB: cuBLASLt streams it (NUCLEUS_SPLITK=1 forces split-K)");
  return ok_status();
}

size_t linear_splitk_workspace(const LinearOp& op, const StepLimits& limits) {
  const LinearWeight& w = op.weight();
  const int64_t rows = std::min(limits.max_tokens, splitk_max_rows(w.out_features, w.in_features));
  if (rows <= 0) return 0;
  return static_cast<size_t>(std::min(
             kMaxPartialFloats, kernels::splitk_workspace_partial_floats(rows, w.out_features, w.in_features))) *
         sizeof(float);
}

Status linear_splitk_reserve(LinearOp& op, const StepLimits& limits, Device device) {
  const int64_t counters = kernels::splitk_workspace_counters(op.weight().out_features);
  if (!op.split_counters().defined() || op.split_counters().numel() < counters) {
    NUCLEUS_ASSIGN_OR_RETURN(op.split_counters(),
                             try_empty({counters}, DType::kI32, device, op.weight().name + " split-K counters"));
    NUCLEUS_OP_CUDA_CHECK(cudaMemset(op.split_counters().raw(), 0, counters * sizeof(int)));
  }
  op.set_reserved_rows(limits.max_tokens);
  return ok_status();
}

void linear_splitk(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const LinearWeight& w = op.weight();
  cudaStream_t stream = cuda::context().stream;
  const int64_t m = in[0].dim(0);
  kernels::SplitKGemmArgs a;
  a.x = in[0].data<__nv_bfloat16>();
  a.x_stride = in[0].row_numel();
  a.w = static_cast<const __nv_bfloat16*>(w.weight.raw());
  a.out = out[0].dtype() == DType::kF32 ? out[0].data<float>() : nullptr;
  a.out_stride = out[0].row_numel();
  a.m = m;
  a.n = w.out_features;
  a.k = w.in_features;
  if (m == 0) return;
  if (a.out && m <= splitk_max_rows(a.n, a.k) && kernels::splitk_check(a) == cudaSuccess) {
    a.zero_init = !op.accumulate_for(m);
    a.mode = splitk_deterministic() ? kernels::SplitKMode::kDeterministic : kernels::SplitKMode::kAtomic;
    // kDeterministic: the partial sums in the step workspace, the op's own
    // counters (kAtomic needs neither).
    if (a.mode == kernels::SplitKMode::kDeterministic && (op.reserved_rows() == 0 || !op.split_counters().defined()))
      return ctx.fail(failed_precondition(w.name + ": cuda_splitk linear run before its reservation "
                                          "(StepResources::reserve_ops)"));
    kernels::SplitKWorkspace ws;
    if (a.mode == kernels::SplitKMode::kDeterministic && ctx.workspace.data) {
      ws.partial = static_cast<float*>(ctx.workspace.data);
      ws.partial_floats = static_cast<int64_t>(ctx.workspace.bytes / sizeof(float));
      ws.counters = op.split_counters().data<int>();
      ws.num_counters = op.split_counters().numel();
    }
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_splitk_gemm(a, ws, stream));
    return;
  }
  kernels::GemmArgs g;
  g.x = a.x;
  g.x_stride = a.x_stride;
  g.w = a.w;
  g.out = out[0].raw();
  g.out_stride = a.out_stride;
  g.out_dtype = out[0].dtype();
  g.m = m;
  g.n = a.n;
  g.k = a.k;
  g.accumulate = op.accumulate();
  if (kernels::gemm_bf16_cublaslt(g, stream).ok()) return;
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_gemm_naive(a.x, a.x_stride, weight_view(w), m, out[0].raw(), out[0].dtype(),
                                                a.out_stride, op.accumulate(), stream));
}

}  // namespace nucleus::cuda_ops
