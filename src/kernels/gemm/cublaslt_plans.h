// The cuBLASLt plan cache shared by every cuBLASLt GEMM (dense bf16, FP8
// block-scaled, the MLA head GEMMs): a matmul description and layouts built,
// and the heuristic queried, once per (device, shape/dtype/layout
// description); later calls reuse the plan. Thread-safe; each device's plans
// use that device's handle and workspace (cuda::context()). Only compiled
// with CUDA.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <string>

namespace nucleus::kernels::cublaslt {

// One operand of D = op(A) op(B) in cuBLAS' column-major terms: a rows x cols
// matrix of `type` with leading dimension `ld` (elements), optionally a
// strided batch of `batch` such matrices `batch_stride` elements apart.
struct MatrixDesc {
  cudaDataType_t type = CUDA_R_16BF;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int32_t batch = 1;         // 1: not batched (no batch attributes are set)
  int64_t batch_stride = 0;  // elements between consecutive batch entries
};

// What a plan is built from, and the cache key (with the device).
struct PlanDesc {
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  MatrixDesc a, b, d;  // C shares D's layout
  // FP8 block scaling: A scaled per 128 x 128 block (BLK128x128_32F), B per
  // 128-vector (VEC128_32F), no fast accumulation. The scale pointers are
  // per call (matmul's a_scale / b_scale).
  bool fp8_block_scaled = false;
  // Smallest alignment (bytes) promised for A, B and C/D; 0: none stated.
  uint32_t min_align_a = 0, min_align_b = 0, min_align_cd = 0;
  // Candidates asked of the heuristic; the first with state SUCCESS is kept.
  int heuristic_results = 1;
};

// A built plan. Usable when status == CUBLAS_STATUS_SUCCESS; otherwise
// `detail` says which step failed (a descriptor call, or the heuristic with
// its status and result count) and nothing else is set.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  std::string detail;
  mutable std::mutex mu;  // held by matmul while it sets per-call scale pointers
};

// The calling thread's device's plan for `desc`, built on first use (failures
// are cached too). `a_scale` / `b_scale` (fp8_block_scaled only; may be null)
// are set on the descriptor before the heuristic query of a new plan. Not
// graph-capturable on first use (it queries cuBLASLt); the returned reference
// stays valid for the process.
const Plan& get_plan(const PlanDesc& desc, const void* a_scale = nullptr, const void* b_scale = nullptr);

// D = alpha op(A) op(B) + beta D with plan `p` (usable) on `stream`, using the
// device's handle and workspace. For fp8_block_scaled plans `a_scale` and
// `b_scale` (device f32) are set on the shared descriptor and the call is made
// under the plan's lock. Returns cuBLAS' status. Stream-async and
// graph-capturable.
cublasStatus_t matmul(const Plan& p, float alpha, const void* a, const void* b, float beta, void* d,
                      cudaStream_t stream, const void* a_scale = nullptr, const void* b_scale = nullptr);

}  // namespace nucleus::kernels::cublaslt
