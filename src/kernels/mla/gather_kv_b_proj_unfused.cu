// The unfused gather_kv_b_proj's plain steps (see gather_kv_b_proj.cuh):
// grid-stride elementwise kernels, 8 elements a thread where the widths
// allow (16-byte chunks never straddle a row part), else one.
#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/mla/ds_mla_row.h"
#include "kernels/mla/gather_kv_b_proj.cuh"

namespace nucleus::kernels {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t work) {
  return static_cast<unsigned>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, 65535 * 16));
}

__device__ __forceinline__ float cache_at(const void* cache, DType dt, int64_t e) {
  if (dt == DType::kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(cache)[e]);
  if (dt == DType::kF8E4M3) return static_cast<float>(static_cast<const __nv_fp8_e4m3*>(cache)[e]);
  return static_cast<const float*>(cache)[e];
}

// Element c of the latent row in `slot` as read: f32(stored) (* k_scale for
// F8_E4M3); for U8, the fp8_ds_mla row (e4m3 times its tile's scale; the bf16 rope part).
__device__ __forceinline__ float latent_at(const void* cache, DType dt, int width, int64_t slot, int c,
                                           float k_scale) {
  if (dt == DType::kU8) {
    const auto* row = static_cast<const unsigned char*>(cache) + slot * kDsMlaRowBytes;
    if (c >= kDsMlaLatent)
      return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row + kDsMlaRopeOffset)[c - kDsMlaLatent]);
    return static_cast<float>(reinterpret_cast<const __nv_fp8_e4m3*>(row)[c]) *
           reinterpret_cast<const float*>(row + kDsMlaScaleOffset)[c / kDsMlaTile];
  }
  return cache_at(cache, dt, slot * width + c) * (dt == DType::kF8E4M3 ? k_scale : 1.0f);
}

template <int V>
__global__ void gather_dequant_kernel(const void* cache, DType dt, int width, float k_scale, const int32_t* table,
                                      int block_size, int64_t key_begin, int64_t num_keys,
                                      __nv_bfloat16* latent) {
  const int64_t per_row = width / V, total = num_keys * per_row;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t j = i / per_row;
    const int c = static_cast<int>(i - j * per_row) * V;
    const int64_t pos = key_begin + j;
    const int64_t slot = int64_t{table[pos / block_size]} * block_size + pos % block_size;
#pragma unroll
    for (int e = 0; e < V; ++e)
      latent[j * width + c + e] = __float2bfloat16(latent_at(cache, dt, width, slot, c + e, k_scale));
  }
}

template <int V>
__global__ void split_kv_kernel(const __nv_bfloat16* kv, const __nv_bfloat16* latent, int num_heads, int qk_nope,
                                int qk_rope, int v_head, int kv_lora, int64_t num_keys, __nv_bfloat16* k,
                                __nv_bfloat16* v) {
  using Chunk = typename std::conditional<V == 8, uint4, __nv_bfloat16>::type;
  const int k_row = qk_nope + qk_rope, head_kv = qk_nope + v_head;
  const int64_t per_head = (k_row + v_head) / V, per_key = num_heads * per_head, total = num_keys * per_key;
  const int64_t n = int64_t{num_heads} * head_kv, width = kv_lora + qk_rope;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t j = i / per_key, rem = i - j * per_key, h = rem / per_head;
    const int c = static_cast<int>(rem - h * per_head) * V;  // column in [k_nope | k_pe | v]
    const __nv_bfloat16* src;
    __nv_bfloat16* dst;
    if (c < qk_nope) {
      src = kv + j * n + h * head_kv + c;
      dst = k + (j * num_heads + h) * k_row + c;
    } else if (c < k_row) {
      src = latent + j * width + kv_lora + (c - qk_nope);
      dst = k + (j * num_heads + h) * k_row + c;
    } else {
      src = kv + j * n + h * head_kv + qk_nope + (c - k_row);
      dst = v + (j * num_heads + h) * v_head + (c - k_row);
    }
    *reinterpret_cast<Chunk*>(dst) = *reinterpret_cast<const Chunk*>(src);
  }
}

__global__ void dequantize_weight_kernel(const void* weight, const void* scale, KvBWeightFormat f, int64_t n,
                                         int64_t k, __nv_bfloat16* out) {
  const int64_t k_blocks = f.scale_layout == KvBScaleLayout::kBlock ? (k + f.block_k - 1) / f.block_k : 1;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * k; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / k, col = i - row * k;
    float w = cache_at(weight, f.weight_dtype, i);
    if (f.scale_layout != KvBScaleLayout::kNone) {
      const int64_t si = f.scale_layout == KvBScaleLayout::kPerRow ? row : (row / f.block_n) * k_blocks + col / f.block_k;
      float s;
      if (f.scale_e8m0) {
        const uint32_t e = static_cast<const uint8_t*>(scale)[si];
        s = e == 0xffu ? __int_as_float(0x7fc00000)
                       : (e == 0 ? __int_as_float(0x00400000) : __int_as_float(static_cast<int>(e << 23)));
      } else {
        s = static_cast<const float*>(scale)[si];
      }
      w *= s;
    }
    out[i] = __float2bfloat16(w);
  }
}

}  // namespace

cudaError_t launch_gather_dequant_latent(const void* cache, DType cache_dtype, int width, float k_scale,
                                         const int32_t* block_table, int block_size, int64_t key_begin,
                                         int64_t num_keys, __nv_bfloat16* latent, cudaStream_t stream) {
  if (num_keys <= 0) return cudaSuccess;
  if (cache_dtype == DType::kU8 && width != kDsMlaLatent + kDsMlaRope) return cudaErrorInvalidValue;
  if (width % 8 == 0)
    gather_dequant_kernel<8><<<grid_for(num_keys * width / 8), kThreads, 0, stream>>>(
        cache, cache_dtype, width, k_scale, block_table, block_size, key_begin, num_keys, latent);
  else
    gather_dequant_kernel<1><<<grid_for(num_keys * width), kThreads, 0, stream>>>(
        cache, cache_dtype, width, k_scale, block_table, block_size, key_begin, num_keys, latent);
  return cudaGetLastError();
}

cudaError_t launch_split_kv(const __nv_bfloat16* kv, const __nv_bfloat16* latent, int num_heads, int qk_nope,
                            int qk_rope, int v_head, int kv_lora, int64_t num_keys, __nv_bfloat16* k,
                            __nv_bfloat16* v, cudaStream_t stream) {
  if (num_keys <= 0) return cudaSuccess;
  const int64_t elems = num_keys * num_heads * (qk_nope + qk_rope + v_head);
  // 16-byte chunks need every row part and row start 8-element aligned.
  if (qk_nope % 8 == 0 && qk_rope % 8 == 0 && v_head % 8 == 0 && kv_lora % 8 == 0)
    split_kv_kernel<8><<<grid_for(elems / 8), kThreads, 0, stream>>>(kv, latent, num_heads, qk_nope, qk_rope, v_head,
                                                                     kv_lora, num_keys, k, v);
  else
    split_kv_kernel<1><<<grid_for(elems), kThreads, 0, stream>>>(kv, latent, num_heads, qk_nope, qk_rope, v_head,
                                                                 kv_lora, num_keys, k, v);
  return cudaGetLastError();
}

cudaError_t launch_dequantize_kv_b_weight(const void* weight, const void* scale, const KvBWeightFormat& f, int64_t n,
                                          int64_t k, __nv_bfloat16* out, cudaStream_t stream) {
  if (n * k <= 0) return cudaSuccess;
  dequantize_weight_kernel<<<grid_for(n * k), kThreads, 0, stream>>>(weight, scale, f, n, k, out);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
