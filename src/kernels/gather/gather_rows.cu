#include "kernels/gather/gather_rows.cuh"

#include <cuda_bf16.h>

namespace nucleus::kernels {

namespace {
__global__ void gather_rows_kernel(const uint32_t* __restrict__ in, const int32_t* __restrict__ index,
                                   int64_t words, uint32_t* __restrict__ out) {
  const uint32_t* src = in + static_cast<int64_t>(index[blockIdx.x]) * words;
  uint32_t* dst = out + static_cast<int64_t>(blockIdx.x) * words;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}

template <typename T>
__global__ void gather_rows_f32_kernel(const T* __restrict__ in, const int32_t* __restrict__ index, int64_t width,
                                       float* __restrict__ out) {
  const T* src = in + static_cast<int64_t>(index[blockIdx.x]) * width;
  float* dst = out + static_cast<int64_t>(blockIdx.x) * width;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) dst[i] = static_cast<float>(src[i]);
}
}  // namespace

cudaError_t launch_gather_rows_f32(const void* in, bool in_bf16, const int32_t* index, int64_t num_rows,
                                   int64_t width, float* out, cudaStream_t stream) {
  if (num_rows < 0 || width < 1) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(num_rows);
  if (in_bf16)
    gather_rows_f32_kernel<<<grid, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(in), index, width, out);
  else
    gather_rows_f32_kernel<<<grid, 256, 0, stream>>>(static_cast<const float*>(in), index, width, out);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const void* in, const int32_t* index, int64_t num_rows, int64_t row_bytes, void* out,
                               cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  if (row_bytes % 4 != 0) return cudaErrorInvalidValue;
  gather_rows_kernel<<<static_cast<unsigned>(num_rows), 256, 0, stream>>>(
      static_cast<const uint32_t*>(in), index, row_bytes / 4, static_cast<uint32_t*>(out));
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
