#include "ops/collective_ops.h"

#include <cstring>

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/collective_ops_cuda.h"
#endif

namespace nucleus {

std::string AllGatherVocabOp::attrs() const {
  return std::string("backend=") + comm_->backend() + " ranks=" + std::to_string(comm_->world_size());
}

const std::vector<Backend<AllGatherVocabOp>>& AllGatherVocabOp::backends() {
  static const std::vector<Backend<AllGatherVocabOp>> list = {
      {"cpu_ref", Device::kCpu, nullptr,
       [](AllGatherVocabOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         const Tensor& local = in[0];
         const int64_t rows = local.dim(0), part = local.dim(1), world = op.comm().world_size();
         if (rows == 0) return;
         float* gathered = out[1].data<float>();
         Status s = op.comm().all_gather(local.raw(), gathered, rows * part, DType::kF32, nullptr);
         if (!s.ok()) return ctx.fail(s.with_context("logits all-gather"));
         float* logits = out[0].data<float>();
         for (int64_t r = 0; r < world; ++r)
           for (int64_t l = 0; l < rows; ++l)
             std::memcpy(logits + l * world * part + r * part, gathered + (r * rows + l) * part, part * 4);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda", Device::kCuda, nullptr, cuda_ops::all_gather_vocab},
#endif
  };
  return list;
}

}  // namespace nucleus
