#include "kernels/activation/silu_mul.cuh"
#include "kernels/common/cuda_common.cuh"
#include "kernels/common/pdl.cuh"

namespace nucleus::kernels {

namespace {
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

template <typename In>
__global__ void silu_mul_kernel(const In* __restrict__ gate_up, int64_t rows, int64_t width,
                                __nv_bfloat16* __restrict__ out) {
  pdl::launch_dependents();  // a skinny down projection after it may start streaming its weights
  pdl::wait_for_inputs();    // launched as a dependent: the kernel before has finished
  const int64_t n = rows * width;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / width, i = idx % width;
    const float g = to_f32(gate_up[r * 2 * width + i]);
    const float u = to_f32(gate_up[r * 2 * width + width + i]);
    out[idx] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
  }
}

template <typename In>
cudaError_t launch(const In* gate_up, int64_t rows, int64_t width, __nv_bfloat16* out, cudaStream_t stream,
                   bool dependent) {
  const int64_t n = rows * width;
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 132 * 16));
  const cudaError_t e = pdl::launch(silu_mul_kernel<In>, blocks, 256, 0, dependent, stream, gate_up, rows, width, out);
  return e != cudaSuccess ? e : cudaGetLastError();
}
}  // namespace

cudaError_t launch_silu_mul(const __nv_bfloat16* gate_up, int64_t rows, int64_t width, __nv_bfloat16* out,
                            cudaStream_t stream, bool dependent) {
  return launch(gate_up, rows, width, out, stream, dependent);
}

cudaError_t launch_silu_mul(const float* gate_up, int64_t rows, int64_t width, __nv_bfloat16* out,
                            cudaStream_t stream, bool dependent) {
  return launch(gate_up, rows, width, out, stream, dependent);
}

}  // namespace nucleus::kernels
