#include <cuda_fp8.h>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/mla/ds_mla_row.h"
#include "kernels/rope/rope_kv_cache.cuh"

namespace nucleus::kernels {

namespace {

// What a cache element holds for value v: bf16(v), or e4m3(v / k_scale).
template <bool kFp8>
struct CacheStore;

template <>
struct CacheStore<false> {
  using T = __nv_bfloat16;
  __device__ static void put(T* row, int i, float v, float) { row[i] = __float2bfloat16(v); }
  __device__ static void copy(T* row, int i, __nv_bfloat16 v, float) { row[i] = v; }
};

template <>
struct CacheStore<true> {
  using T = __nv_fp8_storage_t;
  __device__ static void put(T* row, int i, float v, float k_scale) {
    row[i] = __nv_cvt_float_to_fp8(v / k_scale, __NV_SATFINITE, __NV_E4M3);
  }
  __device__ static void copy(T* row, int i, __nv_bfloat16 v, float k_scale) {
    put(row, i, __bfloat162float(v), k_scale);
  }
};

// The fp8_ds_mla row (kernels/mla/ds_mla_row.h): the rope part is bf16 at
// byte kDsMlaRopeOffset; the latent is written by encode_ds_mla_latent.
struct DsMlaRopeStore {
  __device__ static void put(uint8_t* row, int i, float v, float) {
    reinterpret_cast<__nv_bfloat16*>(row + kDsMlaRopeOffset)[i - kDsMlaLatent] = __float2bfloat16(v);
  }
};

// Warp w < 4 of the block encodes latent tile w of one token: amax over the
// tile's finite values (a warp max), scale = amax / 448, then
// e4m3(x / scale) (x itself in a tile of scale 0), saturating; lane 0 stores the scale.
__device__ void encode_ds_mla_latent(const __nv_bfloat16* src, uint8_t* row) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= kDsMlaScales) return;
  constexpr int kPerLane = kDsMlaTile / 32;
  float x[kPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    x[k] = __bfloat162float(src[warp * kDsMlaTile + k * 32 + lane]);
    if (isfinite(x[k])) amax = fmaxf(amax, fabsf(x[k]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = amax / 448.0f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k)
    row[warp * kDsMlaTile + k * 32 + lane] =
        __nv_cvt_float_to_fp8(scale > 0.0f ? x[k] / scale : x[k], __NV_SATFINITE, __NV_E4M3);
  if (lane == 0) reinterpret_cast<float*>(row + kDsMlaScaleOffset)[warp] = scale;
}

// kBf16, kFp8 (per-layer k_scale) or kDsMla (the tile-scaled row).
enum class CacheKind { kBf16, kFp8, kDsMla };

constexpr int kThreads = 256;
constexpr int kNormPerThread = 4;  // the fused kv_a_layernorm: kv_lora <= 1024

// The fused kv_a_layernorm (RopeKvCacheParams::kv_norm_w): token t's c_kv
// normalised into c (shared memory, bf16), exactly as rmsnorm_kernel
// (kernels/rmsnorm/rmsnorm.cu) computes it for a row: thread i's partial sum
// of squares over columns i, i + 256, ... in that order (the RMSNorm kernel's
// further terms are zeros, which change no float sum), block_sum, one rsqrt,
// then bf16(x * inv * w). Every thread of the block calls it.
__device__ void normalise_c_kv(const RopeKvCacheParams& p, int64_t t, __nv_bfloat16* c, float* scratch) {
  const __nv_bfloat16* row = p.kv_a + t * p.kv_stride;
  float v[kNormPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    v[j] = i < p.kv_lora ? __bfloat162float(row[i]) : 0.0f;
    ss += v[j] * v[j];
  }
  ss = cuda_common::block_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(p.kv_lora) + p.kv_norm_eps);
#pragma unroll
  for (int j = 0; j < kNormPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < p.kv_lora) c[i] = __float2bfloat16(v[j] * inv * p.kv_norm_w[i]);
  }
  __syncthreads();  // c complete before any thread stores it
}

// One block per token: thread pairs rotate q_pe of every head and k_pe, then
// the block stores the latent row into the cache.
template <CacheKind kKind>
__global__ void rope_kv_cache_kernel(RopeKvCacheParams p) {
  pdl::launch_dependents();  // the decode attention's absorption kernel may start streaming W_UK
  pdl::wait_for_inputs();    // launched as a dependent: the kernel before has finished
  constexpr bool kDs = kKind == CacheKind::kDsMla;
  using Store = CacheStore<kKind == CacheKind::kFp8>;
  using T = typename Store::T;
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(p.positions[t]);
  const int half = p.qk_rope / 2;
  const int qk_head = p.qk_nope + p.qk_rope;
  const int64_t slot = p.slot_mapping[t];
  const int total_pairs = (p.num_heads + 1) * half;  // heads' q_pe, then k_pe
  const int width = p.kv_lora + p.qk_rope;
  T* cache_row = !kDs && slot >= 0 ? static_cast<T*>(p.cache) + slot * width : nullptr;
  uint8_t* ds_row = kDs && slot >= 0 ? static_cast<uint8_t*>(p.cache) + slot * kDsMlaRowBytes : nullptr;
  // c_kv as stored: kv_a's own columns, or (fused kv_a_layernorm) normalised here.
  __shared__ __nv_bfloat16 c_norm[kThreads * kNormPerThread];
  __shared__ float scratch[32];
  const __nv_bfloat16* c_kv = p.kv_a + t * p.kv_stride;
  if (p.kv_norm_w) {
    normalise_c_kv(p, t, c_norm, scratch);
    c_kv = c_norm;
  }
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
    } else if (cache_row || ds_row) {
      const __nv_bfloat16* x = p.kv_a + t * p.kv_stride + p.kv_lora + 2 * i;
      const float a = __bfloat162float(x[0]), b = __bfloat162float(x[1]);
      if constexpr (kDs) {
        DsMlaRopeStore::put(ds_row, p.kv_lora + 2 * i, a * c - b * s, 0.0f);
        DsMlaRopeStore::put(ds_row, p.kv_lora + 2 * i + 1, b * c + a * s, 0.0f);
      } else {
        Store::put(cache_row, p.kv_lora + 2 * i, a * c - b * s, p.k_scale);
        Store::put(cache_row, p.kv_lora + 2 * i + 1, b * c + a * s, p.k_scale);
      }
    }
  }
  if (p.q_in) {  // q_nope of every head, converted
    for (int idx = threadIdx.x; idx < p.num_heads * p.qk_nope; idx += blockDim.x) {
      const int h = idx / p.qk_nope, i = idx % p.qk_nope;
      p.q[t * p.q_stride + h * qk_head + i] = __float2bfloat16(p.q_in[t * p.q_in_stride + h * qk_head + i]);
    }
  }
  if constexpr (kDs) {
    if (ds_row) encode_ds_mla_latent(c_kv, ds_row);
  } else if (cache_row) {
    for (int i = threadIdx.x; i < p.kv_lora; i += blockDim.x) Store::copy(cache_row, i, c_kv[i], p.k_scale);
  }
}
}  // namespace

cudaError_t launch_rope_kv_cache_write(const RopeKvCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.cache_fp8 && p.cache_ds_mla) return cudaErrorInvalidValue;
  if (p.cache_fp8 && !(p.k_scale > 0.0f)) return cudaErrorInvalidValue;
  if (p.cache_ds_mla && (p.kv_lora != kDsMlaLatent || p.qk_rope != kDsMlaRope)) return cudaErrorInvalidValue;
  if (p.kv_norm_w && p.kv_lora > kThreads * kNormPerThread) return cudaErrorInvalidValue;
  const auto grid = static_cast<unsigned>(p.num_tokens);
  const cudaError_t e =
      p.cache_ds_mla ? pdl::launch(rope_kv_cache_kernel<CacheKind::kDsMla>, grid, kThreads, 0, p.pdl, stream, p)
      : p.cache_fp8  ? pdl::launch(rope_kv_cache_kernel<CacheKind::kFp8>, grid, kThreads, 0, p.pdl, stream, p)
                     : pdl::launch(rope_kv_cache_kernel<CacheKind::kBf16>, grid, kThreads, 0, p.pdl, stream, p);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace nucleus::kernels
