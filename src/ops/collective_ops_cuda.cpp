// CUDA backends for tensor parallelism: the fused all-reduce + residual add +
// RMSNorm, and the logits all-gather.
#include <algorithm>
#include <cstdlib>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/knobs.h"
#include "kernels/allreduce/allreduce_rmsnorm.cuh"
#include "ops/allreduce_choice.h"
#include "ops/basic_ops_cuda.h"
#include "ops/collective_ops_cuda.h"
#include "ops/op_cuda_check.h"

namespace nucleus::cuda_ops {

int64_t fused_allreduce_max_bytes_override() {
  static const int64_t override_bytes = [] {
    auto v = env_string(Knob::kFusedAllreduceMaxBytes);
    if (!v) return int64_t{-1};
    char* end = nullptr;
    const long long n = std::strtoll(v->c_str(), &end, 10);
    NUCLEUS_CHECK(!v->empty() && *end == '\0' && n >= 0,
                  "NUCLEUS_FUSED_ALLREDUCE_MAX_BYTES='{}' is not a non-negative integer", *v);
    return static_cast<int64_t>(n);
  }();
  return override_bytes;
}

size_t fused_allreduce_signal_bytes() { return kernels::allreduce_signal_bytes(); }

Status add_rmsnorm_allreduce_fused_supports(const AddRmsNormOp& op) {
  const AllReduceSpec& ar = op.all_reduce();
  if (!ar.comm) return unsupported("no all-reduce (tensor-parallel size 1)");
  if (!ar.fuse) return unsupported("fusion off (NUCLEUS_FUSE_ALLREDUCE_NORM=0)");
  if (static_cast<int>(ar.peer_signals.size()) != ar.comm->world_size())
    return unsupported("no peer-mapped signal buffers (peer access between the GPUs unavailable)");
  if (!op.has_delta()) return unsupported("no delta to reduce");
  const int64_t width = op.weight().dim(0);
  if (width % 8 != 0 || width > kernels::kArMaxWidth)
    return unsupported("hidden size " + std::to_string(width) + " is not a multiple of 8 up to 8192");
  return ok_status();
}

void add_rmsnorm_allreduce_fused(AddRmsNormOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const AllReduceSpec& ar = op.all_reduce();
  const int64_t rows = in[0].dim(0), width = in[0].dim(1);
  // The delta is bf16, or f32 when a split-K GEMM wrote it (the split-K pass
  // runs after backend selection); the graphs of every rank are alike, so
  // every rank takes the same path.
  const bool delta_f32 = in[1].dtype() == DType::kF32;
  const int64_t delta_bytes = rows * width * static_cast<int64_t>(dtype_size(in[1].dtype()));
  // Large steps: NCCL's ring, then add+norm (which runs the prezero fill too).
  if (!fused_allreduce_chosen(ar.comm->world_size(), rows, width, delta_bytes, fused_allreduce_max_bytes_override())) {
    add_rmsnorm(op, ctx, in, out);
    return;
  }
  kernels::AllReduceNormParams p;
  for (size_t r = 0; r < ar.peer_signals.size(); ++r) p.signals[r] = ar.peer_signals[r];
  p.rank = ar.comm->rank();
  p.world_size = ar.comm->world_size();
  p.delta = in[1].raw();
  p.delta_f32 = delta_f32;
  p.residual = in[0].data<float>();
  p.weight = op.weight().data<float>();
  p.out = out[1].data<__nv_bfloat16>();
  p.rows = rows;
  p.width = width;
  p.eps = op.eps();
  if (op.prezero().n_total > 0) {  // a prezero donor (set by the pass): the fill on extra CTAs of the same launch
    const Tensor& buf = out[2];
    p.zero_fill_count = prezero_fill_count(op.prezero(), buf.dim(0));
    if (p.zero_fill_count > 0) {
      p.zero_fill = buf.data<float>();
      const int64_t row_blocks = std::min<int64_t>(rows, p.max_blocks);
      p.fill_blocks = prezero_fill_blocks(row_blocks, p.zero_fill_count * static_cast<int64_t>(sizeof(float)));
    }
  }
  const char* why = kernels::allreduce_add_rmsnorm_unsupported(p);
  NUCLEUS_CHECK(why == nullptr, "fused all-reduce + RMSNorm refused a supported call: {}", why ? why : "");
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_allreduce_add_rmsnorm(p, cuda::context().stream));
}

void all_gather_vocab(AllGatherVocabOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const Tensor& local = in[0];
  const int64_t rows = local.dim(0), part = local.dim(1), world = op.comm().world_size();
  if (rows == 0) return;
  cudaStream_t stream = cuda::context().stream;
  float* gathered = out[1].data<float>();
  Status s = op.comm().all_gather(local.raw(), gathered, rows * part, DType::kF32, stream);
  if (!s.ok()) return ctx.fail(s.with_context("logits all-gather"));
  const size_t row_bytes = static_cast<size_t>(part) * sizeof(float);
  for (int64_t r = 0; r < world; ++r)  // [world, rows, part] -> [rows, world * part]
    NUCLEUS_OP_CUDA_CHECK(cudaMemcpy2DAsync(out[0].data<float>() + r * part, world * row_bytes,
                                         gathered + r * rows * part, row_bytes, row_bytes, rows,
                                         cudaMemcpyDeviceToDevice, stream));
}

}  // namespace nucleus::cuda_ops
