#include "kernels/gemm/gemm_cublaslt.h"

#include <cublasLt.h>

#include <map>
#include <mutex>
#include <tuple>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"

namespace nucleus::kernels {

namespace {

// Row-major out[m, n] = x[m, k] W[n, k]^T is, in cuBLAS' column-major terms,
// out^T[n, m] = W^T... i.e. D (n x m, ld out_stride) = op(A) B with
// A = W seen as a k x n column-major matrix (ld k), op = transpose, and
// B = x seen as k x m (ld x_stride).
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, bool>;
std::mutex g_mu;
std::map<Key, Plan> g_plans;

StatusOr<Plan*> get_plan(const GemmArgs& a) {
  Key key{a.m, a.n, a.k, a.x_stride, a.out_stride, static_cast<int>(a.out_dtype), a.accumulate};
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return &it->second;
  cuda::Context& ctx = cuda::context();
  Plan p;
  const cudaDataType_t out_type = a.out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, a.k, a.n, a.k));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, a.k, a.m, a.x_stride));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, out_type, a.n, a.m, a.out_stride));
  cublasLtMatmulPreference_t pref;
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &ctx.workspace_bytes, sizeof(ctx.workspace_bytes)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.lt, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
    return unsupported("cuBLASLt has no bf16 algorithm for m=" + std::to_string(a.m) + " n=" + std::to_string(a.n) +
                       " k=" + std::to_string(a.k));
  }
  p.algo = result.algo;
  return &(g_plans[key] = p);
}

}  // namespace

Status gemm_bf16_cublaslt(const GemmArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return ok_status();
  NUCLEUS_ASSIGN_OR_RETURN(Plan * p, get_plan(a));
  cuda::Context& ctx = cuda::context();
  const float alpha = 1.0f, beta = a.accumulate ? 1.0f : 0.0f;
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmul(ctx.lt, p->op, &alpha, a.w, p->a, a.x, p->b, &beta, a.out, p->c, a.out, p->c,
                                      &p->algo, ctx.workspace, ctx.workspace_bytes, stream));
  return ok_status();
}

}  // namespace nucleus::kernels
