// The absorbed-MLA head GEMMs as cuBLASLt strided-batched bf16 GEMMs (batch =
// heads, f32 accumulation), in cuBLAS' column-major terms:
//   absorb: D (512 x n, ld H*576, batch 576) = W_UK[h] (512 x 128, ld 512) . q_nope_c^T (128 x n, ld H*128)
//   output: D (128 x n, ld out_ld, batch 128) = W_UV[h]^T... i.e. op_T(W_UV stored 512 x 128, ld 512)
//           . o_lat^T (512 x n, ld H*512)
// where W_UK[h] / W_UV[h] are kv_b rows [256 h, +128) / [256 h + 128, +128).
#include "kernels/gemm/cublaslt_plans.h"
#include "kernels/mla/mla_decode.cuh"

namespace nucleus::kernels {

namespace {

cublaslt::MatrixDesc bf16_batched(uint64_t rows, uint64_t cols, int64_t ld, int32_t batch, int64_t batch_stride) {
  return {CUDA_R_16BF, rows, cols, ld, batch, batch_stride};
}

// kind 0: absorb (m 512, k 128), kind 1: output (m 128, k 512).
const cublaslt::Plan& get_plan(int kind, int heads, int64_t n, int64_t out_ld) {
  const int64_t w_stride = static_cast<int64_t>(kMlaDecodeNope + kMlaDecodeVHead) * kMlaDecodeLora;
  const uint64_t cols = static_cast<uint64_t>(n);
  cublaslt::PlanDesc desc;
  desc.trans_a = kind == 0 ? CUBLAS_OP_N : CUBLAS_OP_T;
  desc.trans_b = CUBLAS_OP_N;
  if (kind == 0) {
    desc.a = bf16_batched(kMlaDecodeLora, kMlaDecodeNope, kMlaDecodeLora, heads, w_stride);
    desc.b = bf16_batched(kMlaDecodeNope, cols, static_cast<int64_t>(heads) * kMlaDecodeNope, heads, kMlaDecodeNope);
    desc.d = bf16_batched(kMlaDecodeLora, cols, static_cast<int64_t>(heads) * kMlaDecodeLatent, heads,
                          kMlaDecodeLatent);
  } else {
    desc.a = bf16_batched(kMlaDecodeLora, kMlaDecodeVHead, kMlaDecodeLora, heads, w_stride);
    desc.b = bf16_batched(kMlaDecodeLora, cols, static_cast<int64_t>(heads) * kMlaDecodeLora, heads, kMlaDecodeLora);
    desc.d = bf16_batched(kMlaDecodeVHead, cols, out_ld, heads, kMlaDecodeVHead);
  }
  return cublaslt::get_plan(desc);
}

int run(const cublaslt::Plan& p, const void* a, const void* b, void* d, cudaStream_t stream) {
  return static_cast<int>(cublaslt::matmul(p, 1.0f, a, b, 0.0f, d, stream));
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
