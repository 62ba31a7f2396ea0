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
__global__ void embedding_shard_kernel(const __nv_bfloat16* __restrict__ table, int64_t vocab_start,
                                       int64_t shard_rows, int64_t hidden, const int32_t* __restrict__ ids,
                                       float* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int64_t local = static_cast<int64_t>(ids[t]) - vocab_start;
  float* o = out + t * hidden;
  if (local < 0 || local >= shard_rows) {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = 0.0f;
    return;
  }
  const __nv_bfloat16* row = table + local * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __bfloat162float(row[i]);
}
}  // namespace

cudaError_t launch_embedding_shard(const __nv_bfloat16* table, int64_t vocab_start, int64_t shard_rows,
                                   int64_t hidden, const int32_t* ids, int64_t num_tokens, float* out,
                                   cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  embedding_shard_kernel<<<static_cast<unsigned>(num_tokens), 256, 0, stream>>>(table, vocab_start, shard_rows,
                                                                                  hidden, ids, out);
  return cudaGetLastError();
}

cudaError_t launch_embedding(const __nv_bfloat16* table, int64_t hidden, const int32_t* ids, int64_t num_tokens,
                             float* out, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  embedding_kernel<<<static_cast<unsigned>(num_tokens), 256, 0, stream>>>(table, hidden, ids, out);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
