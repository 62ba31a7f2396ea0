// The CPU reference's weight form: every tensor f32; FP8 block-scaled weights
// dequantized at load (W = q * scale_inv per block), so the reference
// computes exactly with the checkpoint's values.
#include <cstring>

#include "core/check.h"
#include "kernels/gemm/gemm_ref.h"
#include "model/weights.h"

namespace nucleus {

namespace {

// The f32 copy of `name`, or resource_exhausted when the host has no room
// for it (a model larger than the host's memory is refused while it loads,
// naming the tensor, instead of aborting or waking the OOM killer).
StatusOr<Tensor> f32_tensor(const std::string& name, const std::vector<int64_t>& shape) {
  return Tensor::try_empty_host(shape, DType::kF32,
                                "the CPU reference's f32 copy of '" + name + "' (weights are kept in f32 there)");
}

StatusOr<Tensor> to_f32(const std::string& name, const Tensor& host) {
  NUCLEUS_ASSIGN_OR_RETURN(Tensor out, f32_tensor(name, host.shape()));
  convert_to_f32(host.raw(), host.dtype(), out.data<float>(), static_cast<size_t>(host.numel()));
  return out;
}

class CpuWeightBackend : public WeightBackend {
 public:
  Device device() const override { return Device::kCpu; }
  StatusOr<Tensor> embedding(const std::string& name, const Tensor& host) override { return to_f32(name, host); }
  StatusOr<Tensor> vector(const std::string& name, const Tensor& host) override { return to_f32(name, host); }
  StatusOr<Tensor> router(const std::string& name, const Tensor& host) override { return to_f32(name, host); }

  StatusOr<LinearWeight> linear(const std::string& name, const Tensor& weight, const Tensor& scale_inv,
                                int64_t block_n, int64_t block_k) override {
    LinearWeight lw;
    lw.name = name;
    lw.out_features = weight.dim(0);
    lw.in_features = weight.dim(1);
    if (weight.dtype() == DType::kF8E4M3) {
      NUCLEUS_CHECK(scale_inv.defined(), "FP8 weight {} without scale", name);
      Tensor scale = scale_inv.dtype() == DType::kF32 ? scale_inv : Tensor::empty(scale_inv.shape(), DType::kF32);
      if (scale_inv.dtype() == DType::kU8) {  // E8M0 exponents
        for (int64_t i = 0; i < scale.numel(); ++i) scale.data<float>()[i] = e8m0_to_f32(scale_inv.data<uint8_t>()[i]);
      }
      NUCLEUS_ASSIGN_OR_RETURN(lw.weight, f32_tensor(name, weight.shape()));
      kernels::dequantize_fp8_block_ref(weight.data<uint8_t>(), scale.data<float>(), lw.out_features,
                                        lw.in_features, block_n, block_k, lw.weight.data<float>());
    } else {
      NUCLEUS_ASSIGN_OR_RETURN(lw.weight, to_f32(name, weight));
    }
    return lw;
  }

  StatusOr<LinearWeight> concat_rows(const std::string& name, const LinearWeight& a,
                                     const LinearWeight& b) override {
    NUCLEUS_CHECK(a.in_features == b.in_features, "concat_rows of {} and {}: in_features differ", a.name, b.name);
    LinearWeight lw;
    lw.name = name;
    lw.out_features = a.out_features + b.out_features;
    lw.in_features = a.in_features;
    NUCLEUS_ASSIGN_OR_RETURN(lw.weight, f32_tensor(name, {lw.out_features, lw.in_features}));
    std::memcpy(lw.weight.data<float>(), a.weight.data<float>(), a.weight.nbytes());
    std::memcpy(lw.weight.data<float>() + a.weight.numel(), b.weight.data<float>(), b.weight.nbytes());
    return lw;
  }
};

}  // namespace

std::unique_ptr<WeightBackend> make_cpu_weight_backend() { return std::make_unique<CpuWeightBackend>(); }

}  // namespace nucleus
