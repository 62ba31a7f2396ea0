// The CUDA backends of the linear op family (ops/linear_op_cuda.cpp,
// linear_splitk_cuda.cpp, linear_skinny_cuda.cpp, linear_fp8_cuda.cpp) and
// the linear helpers other families' CUDA backends call (weight_view,
// linear_forward, fp8_linear_forward).
#pragma once

#include <cstdint>
#include <memory>

#include "core/status.h"
#include "kernels/common/weight_view.cuh"
#include "ops/linear_op.h"

namespace nucleus::cuda_ops {

// The kernels' view of a linear weight (bf16, or FP8 with f32 block scales).
kernels::WeightView weight_view(const LinearWeight& w);

// out[m, n] (+)= x W^T on the engine stream with the best backend for the
// weight: cuBLASLt for bf16, the plain kernel otherwise. x: [m, k] bf16.
// Errors: the FP8 path's scratch allocation or plan failing.
Status linear_forward(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out, DType out_dtype,
                    int64_t out_stride, bool accumulate);

// cuda_splitk (ops/linear_splitk_cuda.cpp): decode GEMMs of bf16 weights that
// splitk_max_rows() takes, split-K into an f32 output (ops/splitk.h).
Status linear_splitk_supports(const LinearOp& op);
void linear_splitk(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// cuda_skinny (ops/linear_skinny_cuda.cpp): decode GEMMs of bf16 weights at
// the row counts skinny_max_rows() takes (ops/skinny.h), others on cuBLASLt.
Status linear_skinny_supports(const LinearOp& op);
void linear_skinny(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// cuda_skinny_fp8 (ops/linear_skinny_fp8_cuda.cpp): decode GEMMs of FP8
// block-scaled weights at the row counts skinny_fp8_max_rows() takes
// (ops/skinny.h), other rows through fp8_linear_forward (Fp8Path::kAuto).
// Refused (naming why) for a non-decode GEMM, a weight that is not FP8 with
// 128x128 f32 scales, in_features not a multiple of 128, NUCLEUS_SKINNY_FP8=0.
Status linear_skinny_fp8_supports(const LinearOp& op);
void linear_skinny_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

Status linear_cublaslt_supports(const LinearOp& op);
void linear_cublaslt(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void linear_naive(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// FP8 block-scaled linears (ops/linear_fp8_cuda.cpp). W: f8e4m3 with 128x128
// f32 block scales; x: [m, k] bf16; out: [m, n] bf16 or f32.
enum class Fp8Path {
  kAuto,    // cuBLASLt (W8A8, activations quantized per 1x128) where it helps and accepts, own kernels otherwise
  kOwn,     // own kernels only (W8A16): decode kernel for m <= 64, tiled tensor-core kernel otherwise
  kCublas,  // cuBLASLt only (for benchmarks and tests): kUnsupported where it refuses
};
// Fp8Path::kAuto: the own kernels for m <= kFp8OwnMaxRows on weights of at
// most kFp8OwnMaxWeightBytes (cuBLASLt's FP8 path costs >= 16 us there,
// the decode kernel 7-17 us); cuBLASLt everywhere else it accepts the layout
// (measured, docs/perf.md). cuBLASLt's activation operand needs
// m % kFp8CublasRowMultiple == 0; other m run padded (zero rows, f32 scratch,
// then copied out) or, when that copy would outweigh a second read of the
// weight, leave their last m % 4 rows to the own kernels.
constexpr int64_t kFp8OwnMaxRows = 8;
constexpr int64_t kFp8OwnMaxWeightBytes = int64_t{16} << 20;
constexpr int64_t kFp8CublasRowMultiple = 4;
// Rows [0, r) of an m-row call on `path` that cuBLASLt computes (W8A8,
// activations quantized); rows [r, m) run on the own kernels (W8A16).
int64_t fp8_cublas_rows(int64_t m, int64_t n, int64_t k, Fp8Path path);
// OK when the FP8 kernels read `w` (f8e4m3, 128x128 blocks, f32 scales).
Status fp8_linear_supported(const LinearWeight& w);
// OK when cuBLASLt's block-scaled FP8 GEMM takes an [n, k] weight.
Status fp8_cublaslt_layout_supported(int64_t n, int64_t k);
// out[m, n] (+)= x W^T on the engine stream (async; graph-capturable after one
// eager call per shape, which sizes the scratch and plans cuBLASLt).
Status fp8_linear_forward(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out,
                          DType out_dtype, int64_t out_stride, bool accumulate, Fp8Path path = Fp8Path::kAuto);
Status linear_cublaslt_fp8_supports(const LinearOp& op);
void linear_cublaslt_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
Status linear_cuda_fp8_supports(const LinearOp& op);
void linear_cuda_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
