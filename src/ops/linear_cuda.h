// The CUDA backends of the linear op family (ops/linear_op_cuda.cpp,
// linear_splitk_cuda.cpp, linear_skinny_cuda.cpp, linear_fp8_cuda.cpp) and
// the linear helpers other families' CUDA backends call (weight_view,
// linear_forward, fp8_linear_forward).
#pragma once

#include <cstdint>
#include <memory>

#include "core/status.h"
#include "kernels/common/weight_view.cuh"
#include "kernels/gemm/fp8_gemm.cuh"
#include "ops/linear_op.h"

namespace nucleus::cuda_ops {

// The kernels' view of a linear weight (bf16, or FP8 with f32 block scales).
kernels::WeightView weight_view(const LinearWeight& w);

struct Fp8LinearScratch;

// out[m, n] (+)= x W^T on the engine stream with the best backend for the
// weight: cuBLASLt for bf16, the FP8 kernels (fp8_linear_forward with
// `fp8_scratch`, or none: no split-K, no cuBLASLt) for FP8, the plain kernel
// otherwise. x: [m, k] bf16. Errors: the FP8 path's cuBLASLt plan failing.
Status linear_forward(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out, DType out_dtype,
                      int64_t out_stride, bool accumulate, const Fp8LinearScratch* fp8_scratch = nullptr);

// cuda_splitk (ops/linear_splitk_cuda.cpp): decode GEMMs of bf16 weights that
// splitk_max_rows() takes, split-K into an f32 output (ops/splitk.h).
Status linear_splitk_supports(const LinearOp& op);
// Its deterministic mode's partial sums are the op's share of the step
// workspace (the splits of up to splitk_max_rows rows, capped at 32 MB); its
// per-tile counters are allocated at reservation and kept in the op.
size_t linear_splitk_workspace(const LinearOp& op, const StepLimits& limits);
Status linear_splitk_reserve(LinearOp& op, const StepLimits& limits, Device device);
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

// The device scratch of FP8 linear calls, owned by the caller: the linear
// op's share of the step workspace plus its own split counters
// (linear_fp8_workspace / linear_fp8_reserve), or an Fp8LinearScratchOwner.
// Any part may be empty. Without split partials or counters the decode
// kernel does not split K; without room for the quantized activations (or,
// when m % 4 != 0 needs padding, the padded f32 output) cuBLASLt is not used:
// Fp8Path::kAuto runs those rows on the own kernels, Fp8Path::kCublas fails.
struct Fp8LinearScratch {
  kernels::Fp8SplitWorkspace split;  // f32 partial sums [splits, m, n] and zeroed per-tile counters
  uint8_t* xq = nullptr;             // cuBLASLt: e4m3 activations [m_pad, k]
  size_t xq_bytes = 0;
  float* xs = nullptr;  // cuBLASLt: activation scales [m_pad, ceil(k / 128)]
  size_t xs_bytes = 0;
  float* y = nullptr;  // cuBLASLt with m % 4 != 0: f32 output [m_pad, n], then stored
  size_t y_bytes = 0;
};
// Bytes of workspace (split partials, capped at 32 MB, then the cuBLASLt
// buffers, each 256-byte aligned) that let calls of up to `max_m` rows on an
// [n, k] weight along `path` run as they would with unbounded scratch.
size_t fp8_linear_scratch_bytes(int64_t max_m, int64_t n, int64_t k, Fp8Path path);
// The split counters (ints, zero) an [n, k] weight's calls need.
int64_t fp8_linear_scratch_counters(int64_t n);
// The scratch laid out in `bytes` at `base` as fp8_linear_scratch_bytes
// lays it out (parts that do not fit are left empty), with `counters`
// ([num_counters] ints, zero; null: no split-K).
Fp8LinearScratch fp8_linear_scratch_carve(void* base, size_t bytes, int64_t max_m, int64_t n, int64_t k,
                                          Fp8Path path, int* counters, int64_t num_counters);

// An owned Fp8LinearScratch for calls of up to max_m rows on an [n, k]
// weight, for callers outside the step executor (benchmarks, tests).
class Fp8LinearScratchOwner {
 public:
  // Errors: kResourceExhausted when the device has no room.
  static Status create(int64_t max_m, int64_t n, int64_t k, Fp8Path path, Fp8LinearScratchOwner* owner);
  const Fp8LinearScratch& scratch() const { return scratch_; }

 private:
  Tensor buffer_, counters_;
  Fp8LinearScratch scratch_;
};

// out[m, n] (+)= x W^T on the engine stream (async; graph-capturable after one
// eager call per shape, which plans cuBLASLt), with `scratch` as above.
// Errors: kUnsupported for a weight the FP8 kernels do not read; with
// Fp8Path::kCublas, cuBLASLt refusing or `scratch` too small for it.
Status fp8_linear_forward(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out,
                          DType out_dtype, int64_t out_stride, bool accumulate, const Fp8LinearScratch& scratch,
                          Fp8Path path = Fp8Path::kAuto);
// cuda_fp8 (Fp8Path::kOwn) and cublaslt_fp8 (Fp8Path::kAuto): the op's
// workspace is fp8_linear_scratch_bytes at the step's max_tokens rows; its
// split counters are allocated at reservation (kept in the op).
size_t linear_cuda_fp8_workspace(const LinearOp& op, const StepLimits& limits);
size_t linear_cublaslt_fp8_workspace(const LinearOp& op, const StepLimits& limits);
Status linear_fp8_reserve(LinearOp& op, const StepLimits& limits, Device device);
// The scratch of a reserved FP8 op's run on `path` (its share of
// ctx.workspace and its counters). Errors: kFailedPrecondition when the op
// was not reserved (StepResources::reserve_ops / reserve).
StatusOr<Fp8LinearScratch> linear_fp8_op_scratch(LinearOp& op, const OpContext& ctx, Fp8Path path);
Status linear_cublaslt_fp8_supports(const LinearOp& op);
void linear_cublaslt_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
Status linear_cuda_fp8_supports(const LinearOp& op);
void linear_cuda_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
