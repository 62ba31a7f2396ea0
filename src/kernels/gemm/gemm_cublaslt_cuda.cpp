#include "kernels/gemm/gemm_cublaslt.h"

#include <string>

#include "core/cuda/cuda_check.h"
#include "kernels/gemm/cublaslt_plans.h"

namespace nucleus::kernels {

// Row-major out[m, n] = x[m, k] W[n, k]^T is, in cuBLAS' column-major terms,
// out^T[n, m] = W^T... i.e. D (n x m, ld out_stride) = op(A) B with
// A = W seen as a k x n column-major matrix (ld k), op = transpose, and
// B = x seen as k x m (ld x_stride).
Status gemm_bf16_cublaslt(const GemmArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return ok_status();
  cublaslt::PlanDesc desc;
  desc.trans_a = CUBLAS_OP_T;
  desc.trans_b = CUBLAS_OP_N;
  desc.a = {CUDA_R_16BF, static_cast<uint64_t>(a.k), static_cast<uint64_t>(a.n), a.k};
  desc.b = {CUDA_R_16BF, static_cast<uint64_t>(a.k), static_cast<uint64_t>(a.m), a.x_stride};
  desc.d = {a.out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF, static_cast<uint64_t>(a.n),
            static_cast<uint64_t>(a.m), a.out_stride};
  const cublaslt::Plan& p = cublaslt::get_plan(desc);
  if (p.status != CUBLAS_STATUS_SUCCESS)
    return unsupported("cuBLASLt has no bf16 algorithm for m=" + std::to_string(a.m) + " n=" + std::to_string(a.n) +
                       " k=" + std::to_string(a.k) + " (" + p.detail + ")");
  const float beta = a.accumulate ? 1.0f : 0.0f;
  NUCLEUS_CUBLAS_CHECK(cublaslt::matmul(p, 1.0f, a.w, a.x, beta, a.out, stream));
  return ok_status();
}

}  // namespace nucleus::kernels
