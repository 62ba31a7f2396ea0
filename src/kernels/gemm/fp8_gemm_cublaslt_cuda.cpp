#include "kernels/gemm/fp8_gemm_cublaslt.h"

#include <string>

#include "kernels/gemm/cublaslt_plans.h"

namespace nucleus::kernels {

namespace {

// Largest power of two (<= 256) dividing the address: cuBLASLt picks kernels
// by the alignment it is promised.
uint32_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

}  // namespace

Status gemm_fp8_cublaslt(const Fp8CublasArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return ok_status();
  if (a.out_dtype != DType::kBF16 && a.out_dtype != DType::kF32)
    return unsupported(std::string("FP8 cuBLASLt output dtype ") + dtype_name(a.out_dtype));
  cublaslt::PlanDesc desc;
  desc.trans_a = CUBLAS_OP_T;
  desc.trans_b = CUBLAS_OP_N;
  desc.a = {CUDA_R_8F_E4M3, static_cast<uint64_t>(a.k), static_cast<uint64_t>(a.n), a.k};
  desc.b = {CUDA_R_8F_E4M3, static_cast<uint64_t>(a.k), static_cast<uint64_t>(a.m), a.k};
  desc.d = {a.out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF, static_cast<uint64_t>(a.n),
            static_cast<uint64_t>(a.m), a.out_stride};
  desc.fp8_block_scaled = true;
  desc.min_align_a = alignment(a.w);
  desc.min_align_b = alignment(a.xq);
  desc.min_align_cd = alignment(a.out);
  desc.heuristic_results = 8;
  const cublaslt::Plan& p = cublaslt::get_plan(desc, a.w_scale, a.x_scale);
  if (p.status != CUBLAS_STATUS_SUCCESS)
    return unsupported("cuBLASLt has no FP8 block-scaled algorithm for m=" + std::to_string(a.m) + " n=" +
                       std::to_string(a.n) + " k=" + std::to_string(a.k) + " out=" + dtype_name(a.out_dtype) +
                       " out_stride=" + std::to_string(a.out_stride) + (a.accumulate ? " accumulate" : "") + " (" +
                       p.detail + ")");
  // The plan is per shape; the scales are per call.
  const float beta = a.accumulate ? 1.0f : 0.0f;
  const cublasStatus_t st = cublaslt::matmul(p, 1.0f, a.w, a.xq, beta, a.out, stream, a.w_scale, a.x_scale);
  if (st != CUBLAS_STATUS_SUCCESS)
    return unsupported("cublasLtMatmul (FP8 block-scaled) refused m=" + std::to_string(a.m) + " n=" +
                       std::to_string(a.n) + " k=" + std::to_string(a.k) + ": status " +
                       std::to_string(static_cast<int>(st)));
  return ok_status();
}

}  // namespace nucleus::kernels
