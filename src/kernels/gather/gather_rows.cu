#include "kernels/gather/gather_rows.cuh"

namespace nucleus::kernels {

namespace {
__global__ void gather_rows_kernel(const uint32_t* __restrict__ in, const int32_t* __restrict__ index,
                                   int64_t words, uint32_t* __restrict__ out) {
  const uint32_t* src = in + static_cast<int64_t>(index[blockIdx.x]) * words;
  uint32_t* dst = out + static_cast<int64_t>(blockIdx.x) * words;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}
}  // namespace

cudaError_t launch_gather_rows(const void* in, const int32_t* index, int64_t num_rows, int64_t row_bytes, void* out,
                               cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  if (row_bytes % 4 != 0) return cudaErrorInvalidValue;
  gather_rows_kernel<<<static_cast<unsigned>(num_rows), 256, 0, stream>>>(
      static_cast<const uint32_t*>(in), index, row_bytes / 4, static_cast<uint32_t*>(out));
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
