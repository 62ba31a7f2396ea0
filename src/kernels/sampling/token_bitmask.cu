#include <climits>

#include "kernels/sampling/token_bitmask.cuh"

namespace nucleus::kernels {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// grid (ceil(vocab / kThreads), num_masked): one thread per (mask, token).
__global__ void apply_token_bitmask_kernel(float* __restrict__ logits, int vocab, int words,
                                           const int32_t* __restrict__ bitmask, const int32_t* __restrict__ rows) {
  const int t = blockIdx.x * kThreads + threadIdx.x;
  if (t >= vocab) return;
  const int m = blockIdx.y;
  const uint32_t word = static_cast<uint32_t>(bitmask[static_cast<int64_t>(m) * words + (t >> 5)]);
  if (!((word >> (t & 31)) & 1u)) logits[static_cast<int64_t>(rows[m]) * vocab + t] = -INFINITY;
}

}  // namespace

cudaError_t launch_apply_token_bitmask(float* logits, int64_t vocab, const int32_t* bitmask, const int32_t* rows,
                                       int64_t num_masked, cudaStream_t stream) {
  if (vocab < 1 || vocab > INT_MAX || num_masked < 0) return cudaErrorInvalidValue;
  const int words = static_cast<int>((vocab + 31) / 32);
  // grid.y is at most 65535: larger batches take several launches.
  for (int64_t first = 0; first < num_masked; first += kMaxGridY) {
    const int64_t count = num_masked - first < kMaxGridY ? num_masked - first : kMaxGridY;
    const dim3 grid(static_cast<unsigned>((vocab + kThreads - 1) / kThreads), static_cast<unsigned>(count));
    apply_token_bitmask_kernel<<<grid, kThreads, 0, stream>>>(logits, static_cast<int>(vocab), words,
                                                              bitmask + first * words, rows + first);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace nucleus::kernels
