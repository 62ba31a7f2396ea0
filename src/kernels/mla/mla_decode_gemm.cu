// The absorbed-MLA head GEMMs as cuBLASLt strided-batched bf16 GEMMs (batch =
// heads, f32 accumulation), in cuBLAS' column-major terms:
//   absorb: D (512 x n, ld H*576, batch 576) = W_UK[h] (512 x 128, ld 512) . q_nope_c^T (128 x n, ld H*128)
//   output: D (128 x n, ld out_ld, batch 128) = W_UV[h]^T... i.e. op_T(W_UV stored 512 x 128, ld 512)
//           . o_lat^T (512 x n, ld H*512)
// where W_UK[h] / W_UV[h] are kv_b rows [256 h, +128) / [256 h + 128, +128).
#include <cublasLt.h>

#include <map>
#include <mutex>
#include <tuple>

#include "core/cuda/context.h"
#include "kernels/mla/mla_decode.cuh"

namespace nucleus::kernels {

namespace {

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
};

// (kind, heads, rows, out_ld)
using Key = std::tuple<int, int, int64_t, int64_t>;
std::mutex g_mu;
std::map<Key, Plan> g_plans;

cublasStatus_t make_layout(cublasLtMatrixLayout_t* l, uint64_t rows, uint64_t cols, int64_t ld, int32_t batch,
                           int64_t batch_stride) {
  cublasStatus_t s = cublasLtMatrixLayoutCreate(l, CUDA_R_16BF, rows, cols, ld);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch));
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  return cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride,
                                          sizeof(batch_stride));
}

#define MLA_LT_TRY(expr)                           \
  do {                                             \
    cublasStatus_t s_ = (expr);                    \
    if (s_ != CUBLAS_STATUS_SUCCESS) {             \
      p.status = s_;                               \
      return &(g_plans[key] = p);                  \
    }                                              \
  } while (0)

// kind 0: absorb (m 512, k 128), kind 1: output (m 128, k 512).
const Plan* get_plan(int kind, int heads, int64_t n, int64_t out_ld) {
  const Key key{kind, heads, n, out_ld};
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return &it->second;
  cuda::Context& ctx = cuda::context();
  Plan p;
  const int64_t w_stride = static_cast<int64_t>(kMlaDecodeNope + kMlaDecodeVHead) * kMlaDecodeLora;
  MLA_LT_TRY(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = kind == 0 ? CUBLAS_OP_N : CUBLAS_OP_T, tb = CUBLAS_OP_N;
  MLA_LT_TRY(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  MLA_LT_TRY(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (kind == 0) {
    MLA_LT_TRY(make_layout(&p.a, kMlaDecodeLora, kMlaDecodeNope, kMlaDecodeLora, heads, w_stride));
    MLA_LT_TRY(make_layout(&p.b, kMlaDecodeNope, n, static_cast<int64_t>(heads) * kMlaDecodeNope, heads,
                           kMlaDecodeNope));
    MLA_LT_TRY(make_layout(&p.d, kMlaDecodeLora, n, static_cast<int64_t>(heads) * kMlaDecodeLatent, heads,
                           kMlaDecodeLatent));
  } else {
    MLA_LT_TRY(make_layout(&p.a, kMlaDecodeLora, kMlaDecodeVHead, kMlaDecodeLora, heads, w_stride));
    MLA_LT_TRY(make_layout(&p.b, kMlaDecodeLora, n, static_cast<int64_t>(heads) * kMlaDecodeLora, heads,
                           kMlaDecodeLora));
    MLA_LT_TRY(make_layout(&p.d, kMlaDecodeVHead, n, out_ld, heads, kMlaDecodeVHead));
  }
  cublasLtMatmulPreference_t pref;
  MLA_LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ctx.workspace_bytes,
                                       sizeof(ctx.workspace_bytes));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.lt, p.op, p.a, p.b, p.d, p.d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found == 0) st = CUBLAS_STATUS_NOT_SUPPORTED;
  p.status = st;
  p.algo = result.algo;
  return &(g_plans[key] = p);
}
#undef MLA_LT_TRY

int run(const Plan* p, const void* a, const void* b, void* d, cudaStream_t stream) {
  if (p->status != CUBLAS_STATUS_SUCCESS) return static_cast<int>(p->status);
  cuda::Context& ctx = cuda::context();
  const float alpha = 1.0f, beta = 0.0f;
  return static_cast<int>(cublasLtMatmul(ctx.lt, p->op, &alpha, a, p->a, b, p->b, &beta, d, p->d, d, p->d, &p->algo,
                                         ctx.workspace, ctx.workspace_bytes, stream));
}

}  // namespace

int mla_decode_gemm_absorb(const __nv_bfloat16* kv_b, int num_heads, int64_t num_rows,
                           const __nv_bfloat16* q_nope_c, __nv_bfloat16* q_full, cudaStream_t stream) {
  if (num_rows == 0) return 0;
  return run(get_plan(0, num_heads, num_rows, 0), kv_b, q_nope_c, q_full, stream);
}

int mla_decode_gemm_output(const __nv_bfloat16* kv_b, int num_heads, int64_t num_rows, const __nv_bfloat16* o_lat,
                           __nv_bfloat16* out, int64_t out_ld, cudaStream_t stream) {
  if (num_rows == 0) return 0;
  return run(get_plan(1, num_heads, num_rows, out_ld), kv_b + kMlaDecodeNope * kMlaDecodeLora, o_lat, out, stream);
}

}  // namespace nucleus::kernels
