#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "kernels/gemm/gemm_cublaslt.h"
#include "kernels/gemm/gemm_naive.cuh"
#include "ops/linear_cuda.h"
#include "ops/op_cuda_check.h"

namespace nucleus::cuda_ops {

kernels::WeightView weight_view(const LinearWeight& w) {
  kernels::WeightView v;
  v.data = w.weight.raw();
  v.scale_inv = w.fp8() ? w.scale_inv.data<float>() : nullptr;
  v.n = w.out_features;
  v.k = w.in_features;
  v.block_n = static_cast<int>(w.block_n);
  v.block_k = static_cast<int>(w.block_k);
  return v;
}

Status linear_forward(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out, DType out_dtype,
                      int64_t out_stride, bool accumulate, const Fp8LinearScratch* fp8_scratch) {
  cudaStream_t stream = cuda::context().stream;
  if (!w.fp8()) {
    kernels::GemmArgs a;
    a.x = x;
    a.x_stride = x_stride;
    a.w = w.weight.raw();
    a.out = out;
    a.out_stride = out_stride;
    a.out_dtype = out_dtype;
    a.m = m;
    a.n = w.out_features;
    a.k = w.in_features;
    a.accumulate = accumulate;
    if (kernels::gemm_bf16_cublaslt(a, stream).ok()) return ok_status();
  }
  if (fp8_linear_supported(w).ok())
    return fp8_linear_forward(w, x, x_stride, m, out, out_dtype, out_stride, accumulate,
                              fp8_scratch ? *fp8_scratch : Fp8LinearScratch{})
        .with_context(w.name);
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_gemm_naive(static_cast<const __nv_bfloat16*>(x), x_stride, weight_view(w), m, out,
                                                out_dtype, out_stride, accumulate, stream));
  return ok_status();
}

Status linear_cublaslt_supports(const LinearOp& op) {
  if (op.weight().weight.dtype() != DType::kBF16)
    return unsupported(std::string("weight dtype ") + dtype_name(op.weight().weight.dtype()) + " (needs BF16)");
  if (op.weight().in_features % 8 != 0 || op.weight().out_features % 8 != 0)
    return unsupported("dims not multiples of 8 (16-byte alignment)");
  return ok_status();
}

void linear_cublaslt(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const LinearWeight& w = op.weight();
  kernels::GemmArgs a;
  a.x = in[0].raw();
  a.x_stride = in[0].row_numel();
  a.w = w.weight.raw();
  a.out = out[0].raw();
  a.out_stride = out[0].row_numel();
  a.out_dtype = out[0].dtype();
  a.m = in[0].dim(0);
  a.n = w.out_features;
  a.k = w.in_features;
  a.accumulate = op.accumulate();
  Status s = kernels::gemm_bf16_cublaslt(a, cuda::context().stream);
  if (!s.ok()) ctx.fail(s.with_context(w.name));  // cuBLASLt refused this shape at run time (its plan, its workspace)
}

void linear_naive(LinearOp& op, OpContext&, const TensorList& in, const TensorList& out) {
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_gemm_naive(in[0].data<__nv_bfloat16>(), in[0].row_numel(),
                                                weight_view(op.weight()), in[0].dim(0), out[0].raw(),
                                                out[0].dtype(), out[0].row_numel(), op.accumulate(),
                                                cuda::context().stream));
}

}  // namespace nucleus::cuda_ops
