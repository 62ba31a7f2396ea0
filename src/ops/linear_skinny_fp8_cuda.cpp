// The "cuda_skinny_fp8" linear backend: decode GEMMs of FP8 block-scaled
// weights at the row counts skinny_fp8_max_rows() takes (ops/skinny.h)
// through the FP8 skinny kernel (kernels/gemm/skinny_fp8_gemm.cuh; its stream
// variant where skinny_fp8_stream() says), bf16 or f32 output, overwriting or
// adding (accumulate). Rows above that count, and
// outputs of another dtype, run the FP8 linear's other paths
// (fp8_linear_forward, Fp8Path::kAuto: cuBLASLt's FP8 GEMM or the own
// kernels) in the same call (the rule is per row count; a decode graph's
// width fixes it per graph). Like cuda_skinny it does not take a prezero
// donor's zeroing: it overwrites or adds as op.accumulate() says.
#include "core/cuda/context.h"
#include "kernels/gemm/skinny_fp8_gemm.cuh"
#include "ops/linear_cuda.h"
#include "ops/op_cuda_check.h"
#include "ops/skinny.h"

namespace nucleus::cuda_ops {

Status linear_skinny_fp8_supports(const LinearOp& op) {
  if (!op.splitk_allowed()) return unsupported("not a decode-graph GEMM");
  const LinearWeight& w = op.weight();
  NUCLEUS_RETURN_IF_ERROR(fp8_linear_supported(w));
  if (w.in_features % kernels::kSkinnyFp8Block != 0)
    return unsupported("in_features=" + std::to_string(w.in_features) +
                       " not a multiple of 128 (the FP8 skinny kernel reads whole scale blocks)");
  if (reinterpret_cast<uintptr_t>(w.weight.raw()) % 16 != 0) return unsupported("weight not 16-byte aligned");
  if (skinny_fp8_max_rows(w.out_features, w.in_features) == 0)
    return unsupported(skinny_fp8_switch() == SkinnySwitch::kOff ? std::string("NUCLEUS_SKINNY_FP8=0")
                                                                   : "the other FP8 paths are faster at this shape");
  return ok_status();
}

void linear_skinny_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const LinearWeight& w = op.weight();
  const int64_t m = in[0].dim(0);
  if (m == 0) return;
  if (in[0].dtype() != DType::kBF16) {
    ctx.fail(invalid_argument(w.name + ": FP8 linear input dtype " + dtype_name(in[0].dtype()) + " (needs BF16)"));
    return;
  }
  const DType out_dtype = out[0].dtype();
  kernels::SkinnyFp8GemmArgs a;
  a.x = in[0].data<__nv_bfloat16>();
  a.x_stride = in[0].row_numel();
  a.w = static_cast<const uint8_t*>(w.weight.raw());
  a.scale_inv = w.scale_inv.data<float>();
  a.out = out[0].raw();
  a.out_stride = out[0].row_numel();
  a.out_f32 = out_dtype == DType::kF32;
  a.m = m;
  a.n = w.out_features;
  a.k = w.in_features;
  a.accumulate = op.accumulate();
  a.pdl = skinny_pdl();
  switch (skinny_fp8_pipeline_switch()) {
    case SkinnySwitch::kOn: a.pipelined = true; break;
    case SkinnySwitch::kOff: a.pipelined = false; break;
    case SkinnySwitch::kAuto:
      a.pipelined = kernels::skinny_fp8_pipelined_fits(a.n, a.k, 0, cuda::context().num_sms);
      break;
  }
  // The stream variant where the rule says so.
  if (skinny_fp8_stream(m, a.n, a.k)) {
    a.stream = true;
    a.pipelined = false;
  }
  if ((out_dtype == DType::kBF16 || out_dtype == DType::kF32) && m <= skinny_fp8_max_rows(a.n, a.k) &&
      kernels::skinny_fp8_gemm_check(a) == cudaSuccess) {
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_skinny_fp8_gemm(a, cuda::context().stream));
    return;
  }
  StatusOr<Fp8LinearScratch> scratch = linear_fp8_op_scratch(op, ctx, Fp8Path::kAuto);
  if (!scratch.ok()) return ctx.fail(scratch.status());
  Status s = fp8_linear_forward(w, in[0].raw(), a.x_stride, m, a.out, out_dtype, a.out_stride, a.accumulate,
                                *scratch, Fp8Path::kAuto);
  if (!s.ok()) ctx.fail(s.with_context(w.name));
}

}  // namespace nucleus::cuda_ops
