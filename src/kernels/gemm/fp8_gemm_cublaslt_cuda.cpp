#include "kernels/gemm/fp8_gemm_cublaslt.h"

#include <cublasLt.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"

namespace nucleus::kernels {

namespace {

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
  std::string why;  // when !ok
};

// Largest power of two (<= 256) dividing the address: cuBLASLt picks kernels
// by the alignment it is promised.
uint32_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int, bool, uint32_t, uint32_t>;
std::mutex g_mu;
std::map<Key, Plan> g_plans;

void destroy(Plan& p) {
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p.a = p.b = p.c = nullptr;
  p.op = nullptr;
}

void set_scale_pointers(Plan& p, const Fp8CublasArgs& a) {
  const void* ws = a.w_scale;
  const void* xs = a.x_scale;
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof(ws)));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs, sizeof(xs)));
}

Plan make_plan(const Fp8CublasArgs& a, uint32_t out_align) {
  cuda::Context& ctx = cuda::context();
  Plan p;
  const cudaDataType_t out_type = a.out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int8_t fast_accum = 0;  // block scaling requires the promoted (split) accumulator
  NUCLEUS_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
  const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
  set_scale_pointers(p, a);
  NUCLEUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, a.k, a.n, a.k));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, a.k, a.m, a.k));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, out_type, a.n, a.m, a.out_stride));

  cublasLtMatmulPreference_t pref;
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &ctx.workspace_bytes, sizeof(ctx.workspace_bytes)));
  const uint32_t align_a = alignment(a.w), align_b = alignment(a.xq);
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                            &align_a, sizeof(align_a)));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                            &align_b, sizeof(align_b)));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                            &out_align, sizeof(out_align)));
  NUCLEUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                            &out_align, sizeof(out_align)));
  cublasLtMatmulHeuristicResult_t results[8] = {};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(ctx.lt, p.op, p.a, p.b, p.c, p.c, pref, 8, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < found; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) {
      p.algo = results[i].algo;
      p.ok = true;
      return p;
    }
  }
  p.why = "cuBLASLt has no FP8 block-scaled algorithm for m=" + std::to_string(a.m) + " n=" + std::to_string(a.n) +
          " k=" + std::to_string(a.k) + " out=" + dtype_name(a.out_dtype) + " out_stride=" +
          std::to_string(a.out_stride) + (a.accumulate ? " accumulate" : "") + " (heuristic status " +
          std::to_string(static_cast<int>(st)) + ", " + std::to_string(found) + " results)";
  destroy(p);
  return p;
}

}  // namespace

Status gemm_fp8_cublaslt(const Fp8CublasArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return ok_status();
  if (a.out_dtype != DType::kBF16 && a.out_dtype != DType::kF32)
    return unsupported(std::string("FP8 cuBLASLt output dtype ") + dtype_name(a.out_dtype));
  const uint32_t out_align = alignment(a.out);
  const Key key{a.m, a.n, a.k, a.out_stride, static_cast<int>(a.out_dtype), a.accumulate, out_align,
                alignment(a.w)};
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_plans.find(key);
  if (it == g_plans.end()) it = g_plans.emplace(key, make_plan(a, out_align)).first;
  Plan& p = it->second;
  if (!p.ok) return unsupported(p.why);
  set_scale_pointers(p, a);  // the plan is per shape; the scales are per call
  cuda::Context& ctx = cuda::context();
  const float alpha = 1.0f, beta = a.accumulate ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(ctx.lt, p.op, &alpha, a.w, p.a, a.xq, p.b, &beta, a.out, p.c, a.out, p.c,
                                           &p.algo, ctx.workspace, ctx.workspace_bytes, stream);
  if (st != CUBLAS_STATUS_SUCCESS)
    return unsupported("cublasLtMatmul (FP8 block-scaled) refused m=" + std::to_string(a.m) + " n=" +
                       std::to_string(a.n) + " k=" + std::to_string(a.k) + ": status " +
                       std::to_string(static_cast<int>(st)));
  return ok_status();
}

}  // namespace nucleus::kernels
