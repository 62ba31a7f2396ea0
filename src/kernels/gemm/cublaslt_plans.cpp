#ifdef NUCLEUS_HAVE_CUDA
#include "kernels/gemm/cublaslt_plans.h"

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "core/cuda/context.h"

namespace nucleus::kernels::cublaslt {

namespace {

using Key = std::array<int64_t, 26>;

Key make_key(int device, const PlanDesc& d) {
  Key k{};
  int i = 0;
  k[i++] = device;
  k[i++] = d.trans_a;
  k[i++] = d.trans_b;
  for (const MatrixDesc* m : {&d.a, &d.b, &d.d}) {
    k[i++] = m->type;
    k[i++] = static_cast<int64_t>(m->rows);
    k[i++] = static_cast<int64_t>(m->cols);
    k[i++] = m->ld;
    k[i++] = m->batch;
    k[i++] = m->batch_stride;
  }
  k[i++] = d.fp8_block_scaled;
  k[i++] = d.min_align_a;
  k[i++] = d.min_align_b;
  k[i++] = d.min_align_cd;
  k[i++] = d.heuristic_results;
  return k;
}

std::mutex g_mu;
std::map<Key, std::unique_ptr<Plan>> g_plans;

cublasStatus_t make_layout(cublasLtMatrixLayout_t* l, const MatrixDesc& m) {
  cublasStatus_t s = cublasLtMatrixLayoutCreate(l, m.type, m.rows, m.cols, m.ld);
  if (s != CUBLAS_STATUS_SUCCESS || m.batch == 1) return s;
  s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &m.batch, sizeof(m.batch));
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  return cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &m.batch_stride,
                                          sizeof(m.batch_stride));
}

cublasStatus_t set_scale_pointers(cublasLtMatmulDesc_t op, const void* a_scale, const void* b_scale) {
  cublasStatus_t s =
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale));
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  return cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale));
}

void destroy(Plan& p) {
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.d) cublasLtMatrixLayoutDestroy(p.d);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p.a = p.b = p.d = nullptr;
  p.op = nullptr;
}

// Records the first failing step in `p` and returns false.
#define LT_TRY(expr)                                                                          \
  do {                                                                                        \
    const cublasStatus_t s_ = (expr);                                                         \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                        \
      p.status = s_;                                                                          \
      p.detail = std::string(#expr) + ": status " + std::to_string(static_cast<int>(s_)); \
      return false;                                                                           \
    }                                                                                         \
  } while (0)

bool set_preferences(Plan& p, cublasLtMatmulPreference_t pref, const PlanDesc& d, const cuda::Context& ctx) {
  LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ctx.workspace_bytes,
                                              sizeof(ctx.workspace_bytes)));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, d.min_align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, d.min_align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, d.min_align_cd},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d.min_align_cd}};
  for (const auto& [attr, bytes] : aligns)
    if (bytes != 0) LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, attr, &bytes, sizeof(bytes)));
  return true;
}

bool build(Plan& p, const PlanDesc& d, const void* a_scale, const void* b_scale) {
  cuda::Context& ctx = cuda::context();
  LT_TRY(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LT_TRY(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &d.trans_a, sizeof(d.trans_a)));
  LT_TRY(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &d.trans_b, sizeof(d.trans_b)));
  if (d.fp8_block_scaled) {
    const int8_t fast_accum = 0;  // block scaling requires the promoted (split) accumulator
    LT_TRY(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
    const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    LT_TRY(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
    LT_TRY(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
    LT_TRY(set_scale_pointers(p.op, a_scale, b_scale));
  }
  LT_TRY(make_layout(&p.a, d.a));
  LT_TRY(make_layout(&p.b, d.b));
  LT_TRY(make_layout(&p.d, d.d));

  cublasLtMatmulPreference_t pref;
  LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
  if (!set_preferences(p, pref, d, ctx)) {
    cublasLtMatmulPreferenceDestroy(pref);
    return false;
  }
  constexpr int kMaxResults = 8;
  cublasLtMatmulHeuristicResult_t results[kMaxResults] = {};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.lt, p.op, p.a, p.b, p.d, p.d, pref,
                                                           std::clamp(d.heuristic_results, 1, kMaxResults), results,
                                                           &found);
  cublasLtMatmulPreferenceDestroy(pref);
  for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < found; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) {
      p.algo = results[i].algo;
      return true;
    }
  }
  p.status = st == CUBLAS_STATUS_SUCCESS ? CUBLAS_STATUS_NOT_SUPPORTED : st;
  p.detail = "heuristic status " + std::to_string(static_cast<int>(st)) + ", " + std::to_string(found) + " results";
  return false;
}
#undef LT_TRY

}  // namespace

const Plan& get_plan(const PlanDesc& desc, const void* a_scale, const void* b_scale) {
  const Key key = make_key(cuda::context().device, desc);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return *it->second;
  auto plan = std::make_unique<Plan>();
  if (!build(*plan, desc, a_scale, b_scale)) destroy(*plan);
  return *(g_plans[key] = std::move(plan));
}

cublasStatus_t matmul(const Plan& p, float alpha, const void* a, const void* b, float beta, void* d,
                      cudaStream_t stream, const void* a_scale, const void* b_scale) {
  if (p.status != CUBLAS_STATUS_SUCCESS) return p.status;
  cuda::Context& ctx = cuda::context();
  std::unique_lock<std::mutex> lock(p.mu, std::defer_lock);
  if (a_scale != nullptr || b_scale != nullptr) {
    lock.lock();  // the scales live on the shared descriptor
    const cublasStatus_t s = set_scale_pointers(p.op, a_scale, b_scale);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
  }
  return cublasLtMatmul(ctx.lt, p.op, &alpha, a, p.a, b, p.b, &beta, d, p.d, d, p.d, &p.algo, ctx.workspace,
                        ctx.workspace_bytes, stream);
}

}  // namespace nucleus::kernels::cublaslt
#endif  // NUCLEUS_HAVE_CUDA
