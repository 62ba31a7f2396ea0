#include <algorithm>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "kernels/activation/silu_mul.cuh"
#include "kernels/embedding/embedding.cuh"
#include "kernels/gather/gather_rows.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "ops/basic_ops_cuda.h"
#include "ops/op_cuda_check.h"
#include "ops/skinny.h"

namespace nucleus::cuda_ops {

int prezero_fill_blocks(int64_t rows, int64_t bytes) {
  const int64_t idle = std::max<int64_t>(1, cuda::context().num_sms - rows);
  return static_cast<int>(std::clamp<int64_t>((bytes + kPrezeroFillBytesPerBlock - 1) / kPrezeroFillBytesPerBlock, 1, idle));
}

namespace {
cudaStream_t stream() { return cuda::context().stream; }
__nv_bfloat16* bf16(const Tensor& t) { return t.data<__nv_bfloat16>(); }
}  // namespace

void embedding(EmbeddingOp& op, OpContext& ctx, const TensorList&, const TensorList& out) {
  if (!op.shard().comm) {
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_embedding(bf16(op.table()), op.table().dim(1), ctx.dev->token_ids,
                                                 out[0].dim(0), out[0].data<float>(), stream()));
    return;
  }
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_embedding_shard(bf16(op.table()), op.shard().vocab_start, op.table().dim(0),
                                                     op.table().dim(1), ctx.dev->token_ids, out[0].dim(0),
                                                     out[0].data<float>(), stream()));
  Status s = op.shard().comm->all_reduce_sum(out[0].raw(), out[0].raw(), out[0].numel(), DType::kF32, stream());
  if (!s.ok()) ctx.fail(s.with_context("embedding all-reduce"));
}

void rmsnorm(RmsNormOp& op, OpContext&, const TensorList& in, const TensorList& out) {
  const Tensor& x = in[0];
  const Tensor& y = out[0];
  if (x.dtype() == DType::kF32) {  // a split-K GEMM's output, normalised into the declared bf16 buffer
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_rmsnorm_f32_to_bf16(x.data<float>(), x.row_numel(), op.weight().data<float>(),
                                                           x.dim(0), op.width(), x.dim(1), op.eps(), bf16(y),
                                                           y.row_numel(), stream(), small_ops_pdl()));
    return;
  }
  NUCLEUS_CHECK(x.raw() == y.raw(), "rmsnorm: a bf16 input is normalised in place");
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_rmsnorm_inplace(bf16(x), x.row_numel(), op.weight().data<float>(), x.dim(0),
                                                     op.width(), op.eps(), stream(), small_ops_pdl()));
}

void mtp_input(MtpInputOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const Tensor& embed = in[0];
  const Tensor& cat = out[0];
  const int64_t T = embed.dim(0), H = embed.dim(1);
  if (Status s = op.check_hidden(ctx, T); !s.ok()) return ctx.fail(s);
  if (op.zero_embed_at_position0())
    for (int64_t t = 0; t < T; ++t)
      if (ctx.inputs->positions[t] == 0)
        NUCLEUS_OP_CUDA_CHECK(cudaMemsetAsync(embed.data<float>() + t * H, 0, H * sizeof(float), stream()));
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_rmsnorm_f32_to_bf16(embed.data<float>(), H, op.enorm().data<float>(), T, H, H,
                                                         op.eps(), bf16(cat), 2 * H, stream()));
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_rmsnorm_f32_to_bf16(ctx.inputs->mtp_hidden.data<float>(), H,
                                                         op.hnorm().data<float>(), T, H, H, op.eps(), bf16(cat) + H,
                                                         2 * H, stream()));
  NUCLEUS_OP_CUDA_CHECK(cudaMemsetAsync(out[1].raw(), 0, T * H * sizeof(float), stream()));
}

void set_prezero_fill(const PrezeroDonor& donor, const Tensor& buffer, kernels::AddRmsNormParams& p) {
  p.zero_fill_count = prezero_fill_count(donor, buffer.dim(0));
  p.zero_fill = p.zero_fill_count > 0 ? buffer.data<float>() : nullptr;
  p.fill_blocks = p.zero_fill_count > 0
                      ? prezero_fill_blocks(p.rows, p.zero_fill_count * static_cast<int64_t>(sizeof(float)))
                      : 0;
}

void add_rmsnorm(AddRmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  if (op.all_reduce().comm) {  // sum the ranks' partial deltas in place
    // bf16, or f32 when a split-K GEMM wrote the delta (graph/passes/splitk_pass.h).
    Status s = op.all_reduce().comm->all_reduce_sum(in[1].raw(), in[1].raw(), in[1].numel(), in[1].dtype(), stream());
    if (!s.ok()) return ctx.fail(s.with_context("add_rmsnorm all-reduce"));
  }
  const Tensor& residual = in[0];
  kernels::AddRmsNormParams p;
  p.residual = residual.data<float>();
  p.delta = op.has_delta() ? in[1].raw() : nullptr;
  p.delta_f32 = op.has_delta() && in[1].dtype() == DType::kF32;
  p.w = op.weight().data<float>();
  p.rows = residual.dim(0);
  p.width = residual.dim(1);
  p.eps = op.eps();
  p.out = bf16(out[1]);
  p.pdl = small_ops_pdl();
  if (op.prezero().n_total > 0) set_prezero_fill(op.prezero(), out[2], p);  // the donor's fill for this step's rows
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_add_rmsnorm(p, stream()));
}

void silu_mul(SiluMulOp&, OpContext&, const TensorList& in, const TensorList& out) {
  if (in[0].dtype() == DType::kF32)
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_silu_mul(in[0].data<float>(), in[0].dim(0), out[0].dim(1), bf16(out[0]), stream(),
                                                   small_ops_pdl()));
  else
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_silu_mul(bf16(in[0]), in[0].dim(0), out[0].dim(1), bf16(out[0]), stream(),
                                                   small_ops_pdl()));
}

void gather_logit_rows(GatherLogitRowsOp&, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const int64_t row_bytes = in[0].row_numel() * static_cast<int64_t>(dtype_size(in[0].dtype()));
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_gather_rows(in[0].raw(), ctx.dev->logit_indices, out[0].dim(0), row_bytes,
                                                 out[0].raw(), stream()));
}

}  // namespace nucleus::cuda_ops
