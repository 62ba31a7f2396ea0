#ifdef NUCLEUS_HAVE_CUDA
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "kernels/activation/silu_mul.cuh"
#include "kernels/embedding/embedding.cuh"
#include "kernels/gather/gather_rows.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "ops/cuda_backends.h"

namespace nucleus::cuda_ops {

namespace {
cudaStream_t stream() { return cuda::context().stream; }
__nv_bfloat16* bf16(const Tensor& t) { return t.data<__nv_bfloat16>(); }
}  // namespace

void embedding(EmbeddingOp& op, OpContext& ctx, const TensorList&, const TensorList& out) {
  if (!op.shard().comm) {
    NUCLEUS_CUDA_CHECK(kernels::launch_embedding(bf16(op.table()), op.table().dim(1), ctx.dev->token_ids,
                                                 out[0].dim(0), out[0].data<float>(), stream()));
    return;
  }
  NUCLEUS_CUDA_CHECK(kernels::launch_embedding_shard(bf16(op.table()), op.shard().vocab_start, op.table().dim(0),
                                                     op.table().dim(1), ctx.dev->token_ids, out[0].dim(0),
                                                     out[0].data<float>(), stream()));
  Status s = op.shard().comm->all_reduce_sum(out[0].raw(), out[0].raw(), out[0].numel(), DType::kF32, stream());
  NUCLEUS_CHECK(s.ok(), "embedding all-reduce: {}", s.to_string());
}

void rmsnorm(RmsNormOp& op, OpContext&, const TensorList& in, const TensorList&) {
  NUCLEUS_CUDA_CHECK(kernels::launch_rmsnorm_inplace(bf16(in[0]), in[0].row_numel(), op.weight().data<float>(),
                                                     in[0].dim(0), op.width(), op.eps(), stream()));
}

void add_rmsnorm(AddRmsNormOp& op, OpContext&, const TensorList& in, const TensorList& out) {
  if (op.all_reduce().comm) {  // sum the ranks' partial deltas in place
    Status s = op.all_reduce().comm->all_reduce_sum(in[1].raw(), in[1].raw(), in[1].numel(), DType::kBF16, stream());
    NUCLEUS_CHECK(s.ok(), "add_rmsnorm all-reduce: {}", s.to_string());
  }
  const Tensor& residual = in[0];
  const __nv_bfloat16* delta = op.has_delta() ? bf16(in[1]) : nullptr;
  NUCLEUS_CUDA_CHECK(kernels::launch_add_rmsnorm(residual.data<float>(), delta, op.weight().data<float>(),
                                                 residual.dim(0), residual.dim(1), op.eps(), bf16(out[1]),
                                                 stream()));
}

void silu_mul(SiluMulOp&, OpContext&, const TensorList& in, const TensorList& out) {
  NUCLEUS_CUDA_CHECK(kernels::launch_silu_mul(bf16(in[0]), in[0].dim(0), out[0].dim(1), bf16(out[0]), stream()));
}

void gather_logit_rows(GatherLogitRowsOp&, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const int64_t row_bytes = in[0].row_numel() * static_cast<int64_t>(dtype_size(in[0].dtype()));
  NUCLEUS_CUDA_CHECK(kernels::launch_gather_rows(in[0].raw(), ctx.dev->logit_indices, out[0].dim(0), row_bytes,
                                                 out[0].raw(), stream()));
}

}  // namespace nucleus::cuda_ops
#endif  // NUCLEUS_HAVE_CUDA
