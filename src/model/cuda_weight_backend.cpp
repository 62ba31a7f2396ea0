// The CUDA form of the weights: bf16 linear weights (FP8 e4m3 weights kept
// FP8 with f32 block scales), bf16 embedding and router, f32 norm vectors,
// all uploaded to the device one tensor at a time.
#include "model/weights.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "kernels/gemm/gemm_ref.h"

namespace nucleus {

namespace {

Tensor host_as(const Tensor& host, DType dtype) {
  if (host.dtype() == dtype) return host;
  Tensor f = Tensor::empty(host.shape(), DType::kF32);
  convert_to_f32(host.raw(), host.dtype(), f.data<float>(), static_cast<size_t>(host.numel()));
  if (dtype == DType::kF32) return f;
  NUCLEUS_CHECK(dtype == DType::kBF16, "host_as {}", dtype_name(dtype));
  Tensor b = Tensor::empty(host.shape(), DType::kBF16);
  for (int64_t i = 0; i < f.numel(); ++i) b.data<uint16_t>()[i] = f32_to_bf16(f.data<float>()[i]);
  return b;
}

class CudaWeightBackend : public WeightBackend {
 public:
  Device device() const override { return Device::kCuda; }
  StatusOr<Tensor> embedding(const std::string&, const Tensor& host) override {
    return to_device(host_as(host, DType::kBF16));
  }
  StatusOr<Tensor> vector(const std::string&, const Tensor& host) override {
    return to_device(host_as(host, DType::kF32));
  }
  StatusOr<Tensor> router(const std::string&, const Tensor& host) override {
    return to_device(host_as(host, DType::kBF16));
  }

  StatusOr<LinearWeight> linear(const std::string& name, const Tensor& weight, const Tensor& scale_inv,
                                int64_t block_n, int64_t block_k) override {
    LinearWeight lw;
    lw.name = name;
    lw.out_features = weight.dim(0);
    lw.in_features = weight.dim(1);
    if (weight.dtype() == DType::kF8E4M3) {
      lw.weight = to_device(weight);
      Tensor scale = scale_inv;
      if (scale_inv.dtype() == DType::kU8) {  // E8M0 exponents -> f32
        scale = Tensor::empty(scale_inv.shape(), DType::kF32);
        for (int64_t i = 0; i < scale.numel(); ++i)
          scale.data<float>()[i] = e8m0_to_f32(scale_inv.data<uint8_t>()[i]);
      }
      lw.scale_inv = to_device(scale);
      lw.block_n = block_n;
      lw.block_k = block_k;
      if (lw.out_features % block_n != 0) {  // kept for concat_rows' bf16 fallback
        host_scales_[name] = scale;
        host_fp8_[name] = weight;
      }
    } else {
      lw.weight = to_device(host_as(weight, DType::kBF16));
    }
    return lw;
  }

  StatusOr<LinearWeight> concat_rows(const std::string& name, const LinearWeight& a,
                                     const LinearWeight& b) override {
    NUCLEUS_CHECK(a.in_features == b.in_features && a.fp8() == b.fp8(), "concat_rows {} {}", a.name, b.name);
    LinearWeight lw;
    lw.name = name;
    lw.out_features = a.out_features + b.out_features;
    lw.in_features = a.in_features;
    cudaStream_t stream = cuda::context().stream;
    if (a.fp8() && a.out_features % a.block_n != 0) {
      // The seam would fall inside a scale block: dequantize both to bf16.
      Tensor w = Tensor::empty({lw.out_features, lw.in_features}, DType::kBF16);
      size_t off = 0;
      for (const LinearWeight* part : {&a, &b}) {
        const Tensor& q = host_fp8_.at(part->name);
        const Tensor& s = host_scales_.at(part->name);
        std::vector<float> f(static_cast<size_t>(q.numel()));
        kernels::dequantize_fp8_block_ref(q.data<uint8_t>(), s.data<float>(), part->out_features, part->in_features,
                                          part->block_n, part->block_k, f.data());
        for (size_t i = 0; i < f.size(); ++i) w.data<uint16_t>()[off + i] = f32_to_bf16(f[i]);
        off += f.size();
      }
      lw.weight = to_device(w);
      return lw;
    }
    lw.weight = Tensor::empty({lw.out_features, lw.in_features}, a.weight.dtype(), Device::kCuda);
    NUCLEUS_CUDA_CHECK(cudaMemcpyAsync(lw.weight.raw(), a.weight.raw(), a.weight.nbytes(), cudaMemcpyDeviceToDevice,
                                       stream));
    NUCLEUS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(lw.weight.raw()) + a.weight.nbytes(), b.weight.raw(),
                                       b.weight.nbytes(), cudaMemcpyDeviceToDevice, stream));
    if (a.fp8()) {
      lw.block_n = a.block_n;
      lw.block_k = a.block_k;
      lw.scale_inv = Tensor::empty({a.scale_inv.dim(0) + b.scale_inv.dim(0), a.scale_inv.dim(1)}, DType::kF32,
                                   Device::kCuda);
      NUCLEUS_CUDA_CHECK(cudaMemcpyAsync(lw.scale_inv.raw(), a.scale_inv.raw(), a.scale_inv.nbytes(),
                                         cudaMemcpyDeviceToDevice, stream));
      NUCLEUS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(lw.scale_inv.raw()) + a.scale_inv.nbytes(),
                                         b.scale_inv.raw(), b.scale_inv.nbytes(), cudaMemcpyDeviceToDevice, stream));
    }
    NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));  // the parts are freed by the caller
    host_fp8_.erase(a.name);
    host_fp8_.erase(b.name);
    host_scales_.erase(a.name);
    host_scales_.erase(b.name);
    return lw;
  }

 private:
  std::map<std::string, Tensor> host_scales_;  // FP8 scales (f32) by weight name, until concatenated
  std::map<std::string, Tensor> host_fp8_;      // FP8 weights (host views) by name, until concatenated
};

}  // namespace

std::unique_ptr<WeightBackend> make_cuda_weight_backend() { return std::make_unique<CudaWeightBackend>(); }

}  // namespace nucleus
#else
namespace nucleus {
std::unique_ptr<WeightBackend> make_cuda_weight_backend() { return nullptr; }
}  // namespace nucleus
#endif
