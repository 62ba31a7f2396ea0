#include "kernels/rope/rope_kv_cache.cuh"

namespace nucleus::kernels {

namespace {
// One block per token: thread pairs rotate q_pe of every head and k_pe, then
// the block copies the latent row into the cache.
__global__ void rope_kv_cache_kernel(RopeKvCacheParams p) {
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(p.positions[t]);
  const int half = p.qk_rope / 2;
  const int qk_head = p.qk_nope + p.qk_rope;
  const int64_t slot = p.slot_mapping[t];
  const int total_pairs = (p.num_heads + 1) * half;  // heads' q_pe, then k_pe
  const int width = p.kv_lora + p.qk_rope;
  __nv_bfloat16* cache_row = slot >= 0 ? p.cache + slot * width : nullptr;
  for (int idx = threadIdx.x; idx < total_pairs; idx += blockDim.x) {
    const int h = idx / half, i = idx % half;
    float s, c;
    sincosf(pos * p.inv_freq[i], &s, &c);
    c *= p.attention_factor;
    s *= p.attention_factor;
    if (h < p.num_heads) {
      __nv_bfloat16* x = p.q + t * p.q_stride + h * qk_head + p.qk_nope + 2 * i;
      float a, b;
      if (p.q_in) {
        const float* xi = p.q_in + t * p.q_in_stride + h * qk_head + p.qk_nope + 2 * i;
        a = xi[0];
        b = xi[1];
      } else {
        a = __bfloat162float(x[0]);
        b = __bfloat162float(x[1]);
      }
      x[0] = __float2bfloat16(a * c - b * s);
      x[1] = __float2bfloat16(b * c + a * s);
    } else if (cache_row) {
      const __nv_bfloat16* x = p.kv_a + t * p.kv_stride + p.kv_lora + 2 * i;
      const float a = __bfloat162float(x[0]), b = __bfloat162float(x[1]);
      cache_row[p.kv_lora + 2 * i] = __float2bfloat16(a * c - b * s);
      cache_row[p.kv_lora + 2 * i + 1] = __float2bfloat16(b * c + a * s);
    }
  }
  if (p.q_in) {  // q_nope of every head, converted
    for (int idx = threadIdx.x; idx < p.num_heads * p.qk_nope; idx += blockDim.x) {
      const int h = idx / p.qk_nope, i = idx % p.qk_nope;
      p.q[t * p.q_stride + h * qk_head + i] = __float2bfloat16(p.q_in[t * p.q_in_stride + h * qk_head + i]);
    }
  }
  if (cache_row) {
    const __nv_bfloat16* src = p.kv_a + t * p.kv_stride;
    for (int i = threadIdx.x; i < p.kv_lora; i += blockDim.x) cache_row[i] = src[i];
  }
}
}  // namespace

cudaError_t launch_rope_kv_cache_write(const RopeKvCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  rope_kv_cache_kernel<<<static_cast<unsigned>(p.num_tokens), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
