// The CUDA backends' run functions of every op family (ops/*_cuda.cpp), listed
// in the families' backend tables when the build has CUDA.
#pragma once

#ifdef NUCLEUS_HAVE_CUDA
#include "kernels/common/weight_view.cuh"
#include "ops/basic_ops.h"
#include "ops/collective_ops.h"
#include "ops/linear_op.h"
#include "ops/mla_front_op.h"
#include "ops/mla_ops.h"
#include "ops/moe_ops.h"

namespace nucleus::cuda_ops {

// The kernels' view of a linear weight (bf16, or FP8 with f32 block scales).
kernels::WeightView weight_view(const LinearWeight& w);

// out[m, n] (+)= x W^T on the engine stream with the best backend for the
// weight: cuBLASLt for bf16, the plain kernel otherwise. x: [m, k] bf16.
// Errors: the FP8 path's scratch allocation or plan failing.
Status linear_forward(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out, DType out_dtype,
                    int64_t out_stride, bool accumulate);

// Blocks a prezero donor gives its zero-fill of `bytes` bytes beside the
// norm's `rows` blocks: one per kPrezeroFillBytesPerBlock, at least one, at
// most the SMs the norm leaves idle.
constexpr int64_t kPrezeroFillBytesPerBlock = 32 * 1024;
int prezero_fill_blocks(int64_t rows, int64_t bytes);

void embedding(EmbeddingOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void rmsnorm(RmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
// With an all-reduce (tensor parallelism): the NCCL all-reduce of the delta,
// then the add+norm kernel (the unfused path).
void add_rmsnorm(AddRmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
// The all-reduce + residual add + RMSNorm in one kernel over peer-mapped
// buffers (ops/collective_ops_cuda.cpp). Supports ops with an all-reduce, the
// fusion allowed, every rank's signal buffer and hidden a multiple of 8 up to
// 8192; takes a bf16 or f32 (split-K) delta, and a prezero donor's fill runs
// on extra CTAs of the same launch. Steps that fused_allreduce_chosen()
// (ops/allreduce_choice.h, measured on the H200) does not take run the
// unfused path instead (the choice depends only on the step's shape, so
// every rank makes the same).
Status add_rmsnorm_allreduce_fused_supports(const AddRmsNormOp& op);
void add_rmsnorm_allreduce_fused(AddRmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
// NUCLEUS_FUSED_ALLREDUCE_MAX_BYTES (read once), or -1 when unset: a byte
// limit that replaces the measured rule (for tuning).
int64_t fused_allreduce_max_bytes_override();
// Bytes of a rank's signal buffer for the fused kernel.
size_t fused_allreduce_signal_bytes();

void all_gather_vocab(AllGatherVocabOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void silu_mul(SiluMulOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void gather_logit_rows(GatherLogitRowsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// cuda_splitk (ops/linear_splitk_cuda.cpp): decode GEMMs of bf16 weights that
// splitk_max_rows() takes, split-K into an f32 output (ops/splitk.h).
Status linear_splitk_supports(const LinearOp& op);
void linear_splitk(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// cuda_skinny (ops/linear_skinny_cuda.cpp): decode GEMMs of bf16 weights at
// the row counts skinny_max_rows() takes (ops/skinny.h), others on cuBLASLt.
Status linear_skinny_supports(const LinearOp& op);
void linear_skinny(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

Status linear_cublaslt_supports(const LinearOp& op);
void linear_cublaslt(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void linear_naive(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// OK when the CUDA kernels store or read a `d` latent cache (bf16, or FP8
// e4m3 with k_scale); an f32 cache is CPU-only.
Status cuda_cache_dtype_supported(KvCacheDtype d);

Status rope_kv_cache_write_supports(const RopeKvCacheWriteOp& op);
void rope_kv_cache_write(RopeKvCacheWriteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
Status mla_decode_naive_supports(const MlaDecodeAttentionOp& op);
void mla_decode_naive(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// The MLA decode front end (ops/mla_front_op.h): the width build serving the
// step's rows (jit/mla_front_builds.h), else the plain chain.
Status mla_front_supports(const MlaFrontOp& op);
void mla_front(MlaFrontOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
Status mla_prefill_naive_supports(const MlaPrefillAttentionOp& op);
void mla_prefill_naive(MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

void moe_route(MoeRouteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
void moe_experts_naive(MoeExpertsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

// Expanded-form MLA prefill on tensor cores, all served sequences in one
// attention launch per scratch-sized batch (ops/mla_prefill_cuda.cpp).
// Its K/V expansion scratch and LSE live in the step workspace; the batching
// of the step's sequences is a per-step plan (host, uploaded once per step).
Status mla_prefill_flash_supports(const MlaPrefillAttentionOp& op);
void mla_prefill_flash(MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
size_t mla_prefill_flash_workspace(const MlaPrefillAttentionOp& op, const StepLimits& limits);
std::shared_ptr<StepPlan> mla_prefill_flash_plan(const MlaPrefillAttentionOp& op);

// mla_decode fast backends (ops/mla_decode_cuda.cpp): "nucleus" (own
// split-KV kernel, its split partials in the step workspace) and "flashinfer"
// (FlashInfer's Hopper MLA kernel, planned on the host once per step; it
// refuses an op of a captured graph). Both need kv_lora 512, qk_rope 64,
// qk_nope 128, v_head 128 and a bf16 or FP8 kv_b_proj. nucleus reads a bf16
// or an FP8 (e4m3 x k_scale) cache; flashinfer reads bf16 rows only and
// refuses an FP8 cache.
Status mla_decode_nucleus_supports(const MlaDecodeAttentionOp& op);
void mla_decode_nucleus(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
size_t mla_decode_nucleus_workspace(const MlaDecodeAttentionOp& op, const StepLimits& limits);
Status mla_decode_flashinfer_supports(const MlaDecodeAttentionOp& op);
void mla_decode_flashinfer(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
size_t mla_decode_flashinfer_workspace(const MlaDecodeAttentionOp& op, const StepLimits& limits);
std::shared_ptr<StepPlan> mla_decode_flashinfer_plan(const MlaDecodeAttentionOp& op);

// cuda_grouped (ops/moe_grouped_cuda.cpp): grouped tensor-core GEMMs over
// expert-sorted tokens, bf16 or FP8 block-scaled weights.
// Its pass workspace lives in the step workspace, sized for the tokens per
// pass that reserve() fixes from the step limits.
Status moe_experts_grouped_supports(const MoeExpertsOp& op);
void moe_experts_grouped(MoeExpertsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);
size_t moe_experts_grouped_workspace(const MoeExpertsOp& op, const StepLimits& limits);
Status moe_experts_grouped_reserve(MoeExpertsOp& op, const StepLimits& limits, Device device);

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
#endif  // NUCLEUS_HAVE_CUDA
