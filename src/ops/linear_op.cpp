#include "ops/linear_op.h"

#include "kernels/gemm/gemm_ref.h"
#include "ops/prezero.h"
#include "ops/splitk.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/linear_cuda.h"
#endif

namespace nucleus {

std::string LinearOp::attrs() const {
  return "n=" + std::to_string(weight_->out_features) + " k=" + std::to_string(weight_->in_features) +
         " dtype=" + dtype_name(weight_->weight.dtype()) +
         (prezero_gate_n_ > 0 ? " zero_init=gate(m," + std::to_string(prezero_gate_n_) +
                                    (prezero_max_rows_ == kPrezeroAnyRows ? "" : ",m<=" + std::to_string(prezero_max_rows_)) + ")"
                              : (accumulate_ ? " accumulate=1" : " accumulate=0"));
}

bool LinearOp::accumulate_for(int64_t rows) const {
  return prezero_gate_n_ > 0 ? rows <= prezero_max_rows_ && is_prezero_free(rows, prezero_gate_n_) : accumulate_;
}

int64_t LinearOp::zero_init_max_rows() const {
  if (backend_ == "cpu_ref") return kPrezeroAnyRows;
  if (backend_ == "cuda_splitk") return splitk_max_rows(weight_->out_features, weight_->in_features);
  return 0;
}

const std::vector<Backend<LinearOp>>& LinearOp::backends() {
  static const std::vector<Backend<LinearOp>> list = {
      {"cpu_ref", Device::kCpu,
       [](const LinearOp& op) -> Status {
         if (op.weight().weight.dtype() != DType::kF32)
           return unsupported("weight dtype " + std::string(dtype_name(op.weight().weight.dtype())) + " (needs F32)");
         return ok_status();
       },
       [](LinearOp& op, OpContext&, const TensorList& in, const TensorList& out) {
         const LinearWeight& w = op.weight();
         kernels::gemm_ref(in[0].data<float>(), in[0].row_numel(), w.weight.data<float>(), in[0].dim(0),
                           w.out_features, w.in_features, out[0].data<float>(), out[0].row_numel(),
                           op.accumulate_for(in[0].dim(0)));
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda_splitk", Device::kCuda, cuda_ops::linear_splitk_supports, cuda_ops::linear_splitk,
       cuda_ops::linear_splitk_workspace, cuda_ops::linear_splitk_reserve},
      {"cuda_skinny", Device::kCuda, cuda_ops::linear_skinny_supports, cuda_ops::linear_skinny},
      {"cuda_skinny_fp8", Device::kCuda, cuda_ops::linear_skinny_fp8_supports, cuda_ops::linear_skinny_fp8,
       cuda_ops::linear_cublaslt_fp8_workspace, cuda_ops::linear_fp8_reserve},
      {"cublaslt", Device::kCuda, cuda_ops::linear_cublaslt_supports, cuda_ops::linear_cublaslt},
      {"cublaslt_fp8", Device::kCuda, cuda_ops::linear_cublaslt_fp8_supports, cuda_ops::linear_cublaslt_fp8,
       cuda_ops::linear_cublaslt_fp8_workspace, cuda_ops::linear_fp8_reserve},
      {"cuda_fp8", Device::kCuda, cuda_ops::linear_cuda_fp8_supports, cuda_ops::linear_cuda_fp8,
       cuda_ops::linear_cuda_fp8_workspace, cuda_ops::linear_fp8_reserve},
      {"cuda_naive", Device::kCuda, nullptr, cuda_ops::linear_naive},
#endif
  };
  return list;
}

}  // namespace nucleus
