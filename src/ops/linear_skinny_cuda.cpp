// The "cuda_skinny" linear backend: decode GEMMs of bf16 weights at the row
// counts skinny_max_rows() takes (ops/skinny.h) through the skinny kernel
// (kernels/gemm/skinny_gemm.cuh), bf16 or f32 output, overwriting or adding
// (accumulate). Rows above that count, and outputs of another dtype, run
// cuBLASLt in the same call (the rule is per row count; a decode graph's
// width fixes it per graph).
#include "core/cuda/context.h"
#include "kernels/gemm/gemm_cublaslt.h"
#include "kernels/gemm/gemm_naive.cuh"
#include "kernels/gemm/skinny_gemm.cuh"
#include "ops/linear_cuda.h"
#include "ops/op_cuda_check.h"
#include "ops/skinny.h"

namespace nucleus::cuda_ops {

Status linear_skinny_supports(const LinearOp& op) {
  if (!op.splitk_allowed()) return unsupported("not a decode-graph GEMM");
  const LinearWeight& w = op.weight();
  if (w.weight.dtype() != DType::kBF16)
    return unsupported(std::string("weight dtype ") + dtype_name(w.weight.dtype()) + " (needs BF16)");
  if (w.in_features % 8 != 0) return unsupported("in_features not a multiple of 8 (16-byte rows)");
  if (reinterpret_cast<uintptr_t>(w.weight.raw()) % 16 != 0) return unsupported("weight not 16-byte aligned");
  if (skinny_max_rows(w.out_features, w.in_features) == 0)
    return unsupported(skinny_switch() == SkinnySwitch::kOff ? std::string("NUCLEUS_SKINNY=0")
                                                               : "cuBLASLt is faster at this shape (measured rule)");
  return ok_status();
}

void linear_skinny(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const LinearWeight& w = op.weight();
  cudaStream_t stream = cuda::context().stream;
  const int64_t m = in[0].dim(0);
  if (m == 0) return;
  const DType out_dtype = out[0].dtype();
  kernels::SkinnyGemmArgs a;
  a.x = in[0].data<__nv_bfloat16>();
  a.x_stride = in[0].row_numel();
  a.w = static_cast<const __nv_bfloat16*>(w.weight.raw());
  a.out = out[0].raw();
  a.out_stride = out[0].row_numel();
  a.out_f32 = out_dtype == DType::kF32;
  a.m = m;
  a.n = w.out_features;
  a.k = w.in_features;
  a.accumulate = op.accumulate();
  a.pdl = skinny_pdl();
  if ((out_dtype == DType::kBF16 || out_dtype == DType::kF32) && m <= skinny_max_rows(a.n, a.k) &&
      kernels::skinny_gemm_check(a) == cudaSuccess) {
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_skinny_gemm(a, stream));
    return;
  }
  kernels::GemmArgs g;
  g.x = a.x;
  g.x_stride = a.x_stride;
  g.w = a.w;
  g.out = a.out;
  g.out_stride = a.out_stride;
  g.out_dtype = out_dtype;
  g.m = m;
  g.n = a.n;
  g.k = a.k;
  g.accumulate = a.accumulate;
  Status s = kernels::gemm_bf16_cublaslt(g, stream);
  if (!s.ok()) ctx.fail(s.with_context(w.name));
}

}  // namespace nucleus::cuda_ops
