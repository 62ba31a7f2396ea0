#include "kernels/embedding/embedding.cuh"

namespace nucleus::kernels {

namespace {
__global__ void embedding_kernel(const __nv_bfloat16* __restrict__ table, int64_t hidden,
                                 const int32_t* __restrict__ ids, float* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const __nv_bfloat16* row = table + static_cast<int64_t>(ids[t]) * hidden;
  float* o = out + t * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __bfloat162float(row[i]);
}
}  // namespace

cudaError_t launch_embedding(const __nv_bfloat16* table, int64_t hidden, const int32_t* ids, int64_t num_tokens,
                             float* out, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  embedding_kernel<<<static_cast<unsigned>(num_tokens), 256, 0, stream>>>(table, hidden, ids, out);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
