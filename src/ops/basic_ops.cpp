#include "ops/basic_ops.h"

#include <algorithm>
#include <cstring>

#include "kernels/activation/silu_mul_ref.h"
#include "kernels/embedding/embedding_ref.h"
#include "kernels/rmsnorm/rmsnorm_ref.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/basic_ops_cuda.h"
#include "ops/collective_ops_cuda.h"
#endif

namespace nucleus {

std::string EmbeddingOp::attrs() const {
  std::string a = "vocab=" + std::to_string(table_.dim(0)) + " hidden=" + std::to_string(table_.dim(1));
  if (shard_.comm)
    a += " vocab_start=" + std::to_string(shard_.vocab_start) + " allreduce=" + shard_.comm->backend() + "x" +
         std::to_string(shard_.comm->world_size());
  return a;
}

const std::vector<Backend<EmbeddingOp>>& EmbeddingOp::backends() {
  static const std::vector<Backend<EmbeddingOp>> list = {
      {"cpu_ref", Device::kCpu, nullptr,
       [](EmbeddingOp& op, OpContext& ctx, const TensorList&, const TensorList& out) {
         const auto& ids = ctx.inputs->token_ids;
         if (!op.shard().comm) {
           kernels::embedding_ref(op.table().data<float>(), op.table().dim(0), op.table().dim(1), ids.data(),
                                  static_cast<int64_t>(ids.size()), out[0].data<float>());
           return;
         }
         kernels::embedding_shard_ref(op.table().data<float>(), op.shard().vocab_start, op.table().dim(0),
                                      op.table().dim(1), ids.data(), static_cast<int64_t>(ids.size()),
                                      out[0].data<float>());
         Status s = op.shard().comm->all_reduce_sum(out[0].raw(), out[0].raw(), out[0].numel(), DType::kF32, nullptr);
         if (!s.ok()) ctx.fail(s.with_context("embedding all-reduce"));
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda", Device::kCuda, nullptr, cuda_ops::embedding},
#endif
  };
  return list;
}

std::string RmsNormOp::attrs() const { return "width=" + std::to_string(width()); }

const std::vector<Backend<RmsNormOp>>& RmsNormOp::backends() {
  static const std::vector<Backend<RmsNormOp>> list = {
      {"cpu_ref", Device::kCpu, nullptr,
       [](RmsNormOp& op, OpContext&, const TensorList& in, const TensorList& out) {
         const Tensor& x = in[0];
         const Tensor& y = out[0];
         kernels::rmsnorm_ref(x.data<float>(), x.row_numel(), op.weight().data<float>(), x.dim(0), op.width(),
                              op.eps(), y.data<float>(), y.row_numel());
         if (y.raw() == x.raw()) return;
         const int64_t carried = x.dim(1) - op.width();  // columns past the norm, copied
         for (int64_t r = 0; r < x.dim(0) && carried > 0; ++r)
           std::memcpy(y.data<float>() + r * y.row_numel() + op.width(),
                       x.data<float>() + r * x.row_numel() + op.width(), carried * sizeof(float));
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda", Device::kCuda, nullptr, cuda_ops::rmsnorm},
#endif
  };
  return list;
}

std::string AddRmsNormOp::attrs() const {
  std::string a = "width=" + std::to_string(weight_.dim(0)) + (has_delta_ ? " residual_add=1" : " residual_add=0");
  if (all_reduce_.comm)
    a += std::string(" allreduce=") + all_reduce_.comm->backend() + "x" + std::to_string(all_reduce_.comm->world_size()) +
         (all_reduce_.fuse && !all_reduce_.peer_signals.empty() ? " fusable=1" : " fusable=0");
  return a + prezero_attrs(prezero_);
}

const std::vector<Backend<AddRmsNormOp>>& AddRmsNormOp::backends() {
  static const std::vector<Backend<AddRmsNormOp>> list = {
      {"cpu_ref", Device::kCpu, nullptr,
       [](AddRmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         if (op.all_reduce().comm) {  // sum the ranks' partial deltas in place
           Status s = op.all_reduce().comm->all_reduce_sum(in[1].raw(), in[1].raw(), in[1].numel(), DType::kF32,
                                                           nullptr);
           if (!s.ok()) return ctx.fail(s.with_context("add_rmsnorm all-reduce"));
         }
         const Tensor& residual = in[0];
         const float* delta = op.has_delta() ? in[1].data<float>() : nullptr;
         kernels::add_rmsnorm_ref(residual.data<float>(), delta, op.weight().data<float>(), residual.dim(0),
                                  residual.dim(1), op.eps(), out[1].data<float>());
         const Tensor* fill = op.prezero().n_total > 0 ? &out[2] : nullptr;  // the donor's fill
         if (fill) std::fill_n(fill->data<float>(), prezero_fill_count(op.prezero(), fill->dim(0)), 0.0f);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      // Tensor parallelism: the fused all-reduce + add + RMSNorm kernel when
      // it can, else NCCL then the add+norm kernel. Both take an f32 delta (a
      // split-K GEMM's output) and both run a prezero donor's fill.
      {"cuda_allreduce_fused", Device::kCuda, cuda_ops::add_rmsnorm_allreduce_fused_supports,
       cuda_ops::add_rmsnorm_allreduce_fused},
      {"cuda", Device::kCuda, nullptr, cuda_ops::add_rmsnorm},
#endif
  };
  return list;
}

std::string MtpInputOp::attrs() const {
  return "hidden=" + std::to_string(enorm_.dim(0)) + (zero_pos0_ ? " zero_embed_at_position0=1" : "");
}

Status MtpInputOp::check_hidden(const OpContext& ctx, int64_t num_tokens) const {
  const Tensor& h = ctx.inputs->mtp_hidden;
  if (!h.defined())
    return internal_error("mtp_input: the step has no mtp_hidden (an MTP step needs the previous model's hidden states)");
  if (h.dtype() != DType::kF32 || h.rank() != 2 || h.dim(0) != num_tokens || h.dim(1) != enorm_.dim(0) ||
      h.device() != ctx.device)
    return internal_error("mtp_input: mtp_hidden is " + std::string(dtype_name(h.dtype())) + " " +
                          shape_to_string(h.shape()) + ", expected F32 [" + std::to_string(num_tokens) + ", " +
                          std::to_string(enorm_.dim(0)) + "] on the step's device");
  return ok_status();
}

const std::vector<Backend<MtpInputOp>>& MtpInputOp::backends() {
  static const std::vector<Backend<MtpInputOp>> list = {
      {"cpu_ref", Device::kCpu, nullptr,
       [](MtpInputOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         const Tensor& embed = in[0];
         const Tensor& cat = out[0];
         const int64_t T = embed.dim(0), H = embed.dim(1);
         if (Status s = op.check_hidden(ctx, T); !s.ok()) return ctx.fail(s);
         if (op.zero_embed_at_position0())
           for (int64_t t = 0; t < T; ++t)
             if (ctx.inputs->positions[t] == 0) std::fill(embed.data<float>() + t * H, embed.data<float>() + (t + 1) * H, 0.0f);
         kernels::rmsnorm_ref(embed.data<float>(), H, op.enorm().data<float>(), T, H, op.eps(), cat.data<float>(), 2 * H);
         kernels::rmsnorm_ref(ctx.inputs->mtp_hidden.data<float>(), H, op.hnorm().data<float>(), T, H, op.eps(),
                              cat.data<float>() + H, 2 * H);
         std::fill(out[1].data<float>(), out[1].data<float>() + T * H, 0.0f);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda", Device::kCuda, nullptr, cuda_ops::mtp_input},
#endif
  };
  return list;
}

const std::vector<Backend<SiluMulOp>>& SiluMulOp::backends() {
  static const std::vector<Backend<SiluMulOp>> list = {
      {"cpu_ref", Device::kCpu, nullptr,
       [](SiluMulOp&, OpContext&, const TensorList& in, const TensorList& out) {
         kernels::silu_mul_ref(in[0].data<float>(), in[0].dim(0), out[0].dim(1), out[0].data<float>());
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda", Device::kCuda, nullptr, cuda_ops::silu_mul},
#endif
  };
  return list;
}

const std::vector<Backend<GatherLogitRowsOp>>& GatherLogitRowsOp::backends() {
  static const std::vector<Backend<GatherLogitRowsOp>> list = {
      {"cpu_ref", Device::kCpu, nullptr,
       [](GatherLogitRowsOp&, OpContext& ctx, const TensorList& in, const TensorList& out) {
         const int64_t width = in[0].dim(1);
         const auto& idx = ctx.inputs->logit_indices;
         for (size_t i = 0; i < idx.size(); ++i)
           std::memcpy(out[0].data<float>() + i * width, in[0].data<float>() + idx[i] * width, width * 4);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda", Device::kCuda, nullptr, cuda_ops::gather_logit_rows},
#endif
  };
  return list;
}

}  // namespace nucleus
