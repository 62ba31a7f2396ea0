#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/common/cuda_common.cuh"
#include "kernels/mla/ds_mla_row.h"
#include "kernels/mla/mla_attention_naive.cuh"

namespace nucleus::kernels {

namespace {
using cuda_common::warp_max;
using cuda_common::warp_sum;

constexpr int kThreads = 256;
constexpr int kKeyTile = 32;

// Element c of a cache row as stored (bf16, or the e4m3 value unscaled), or
// of an fp8_ds_mla row as read (e4m3 times its tile's scale; the bf16 rope part).
__device__ __forceinline__ float cache_elem(const void* row, bool fp8, int c, bool ds = false) {
  if (ds) {
    const auto* b = static_cast<const unsigned char*>(row);
    if (c >= kDsMlaLatent) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(b + kDsMlaRopeOffset)[c - kDsMlaLatent]);
    const __half_raw h = __nv_cvt_fp8_to_halfraw(b[c], __NV_E4M3);
    return __half2float(__half(h)) * reinterpret_cast<const float*>(b + kDsMlaScaleOffset)[c / kDsMlaTile];
  }
  if (fp8) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<const __nv_fp8_storage_t*>(row)[c], __NV_E4M3);
    return __half2float(__half(h));
  }
  return __bfloat162float(static_cast<const __nv_bfloat16*>(row)[c]);
}

// q_lat[r, h, c] = sum_i q_nope[r, h, i] * W_UK[h][i, c]
__global__ void q_absorb_kernel(MlaAbsorbedParams p) {
  const int64_t i = blockIdx.x, r = p.rows ? p.rows[i] : p.row_offset + i;
  const int h = blockIdx.y;
  const MlaShape& s = p.s;
  const __nv_bfloat16* q = p.q + r * p.q_stride + h * s.qk_head();
  const int64_t w_row0 = static_cast<int64_t>(h) * (s.qk_nope + s.v_head);
  for (int c = threadIdx.x; c < s.kv_lora; c += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < s.qk_nope; ++j) acc += __bfloat162float(q[j]) * p.kv_b.at(w_row0 + j, c);
    p.q_lat[(i * s.num_heads + h) * s.kv_lora + c] = acc;
  }
}

// One block per (row, head): online softmax over the row's visible keys.
__global__ void absorbed_attention_kernel(MlaAbsorbedParams p) {
  extern __shared__ float smem[];
  const MlaShape& s = p.s;
  const int64_t i = blockIdx.x, r = p.rows ? p.rows[i] : p.row_offset + i;
  const int h = blockIdx.y;
  float* q_full = smem;                  // [latent]: q_lat | q_pe
  float* scores = q_full + s.latent();   // [kKeyTile]
  const int seq = p.token_seq[r];
  const int64_t pos = p.context_lens[seq] + (r - p.query_start[seq]);
  const int64_t num_keys = pos + 1;
  const float* ql = p.q_lat + (i * s.num_heads + h) * s.kv_lora;
  const __nv_bfloat16* qpe = p.q + r * p.q_stride + h * s.qk_head() + s.qk_nope;
  for (int c = threadIdx.x; c < s.latent(); c += blockDim.x)
    q_full[c] = c < s.kv_lora ? ql[c] : __bfloat162float(qpe[c - s.kv_lora]);
  __syncthreads();
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
  const size_t row_bytes =
      p.cache_ds_mla ? static_cast<size_t>(kDsMlaRowBytes) : static_cast<size_t>(s.latent()) * (p.cache_fp8 ? 1 : 2);
  const float score_scale = s.scale * (p.cache_fp8 ? p.k_scale : 1.0f);
  // Each thread owns output channels c = threadIdx.x + k * blockDim.x.
  constexpr int kMaxChannels = 4;  // kv_lora <= 4 * kThreads
  float acc[kMaxChannels] = {0, 0, 0, 0};
  float m = -INFINITY, l = 0.0f;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  for (int64_t k0 = 0; k0 < num_keys; k0 += kKeyTile) {
    const int tile = static_cast<int>(num_keys - k0 < kKeyTile ? num_keys - k0 : kKeyTile);
    for (int j = warp; j < tile; j += num_warps) {
      const int64_t key = k0 + j;
      const int64_t slot = static_cast<int64_t>(table[key / p.block_size]) * p.block_size + key % p.block_size;
      const void* row = static_cast<const char*>(p.cache) + slot * row_bytes;
      float d = 0.0f;
      for (int c = lane; c < s.latent(); c += 32) d += q_full[c] * cache_elem(row, p.cache_fp8, c, p.cache_ds_mla);
      d = warp_sum(d);
      if (lane == 0) scores[j] = d * score_scale;
    }
    __syncthreads();
    float tile_max = -INFINITY;
    for (int j = 0; j < tile; ++j) tile_max = fmaxf(tile_max, scores[j]);
    const float m_new = fmaxf(m, tile_max);
    const float correction = expf(m - m_new);
    l *= correction;
#pragma unroll
    for (int k = 0; k < kMaxChannels; ++k) acc[k] *= correction;
    for (int j = 0; j < tile; ++j) {
      const float pj = expf(scores[j] - m_new);
      l += pj;
      const int64_t key = k0 + j;
      const int64_t slot = static_cast<int64_t>(table[key / p.block_size]) * p.block_size + key % p.block_size;
      const void* row = static_cast<const char*>(p.cache) + slot * row_bytes;
#pragma unroll
      for (int k = 0; k < kMaxChannels; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < s.kv_lora) acc[k] += pj * cache_elem(row, p.cache_fp8, c, p.cache_ds_mla);
      }
    }
    m = m_new;
    __syncthreads();  // scores reused by the next tile
  }
  float* ol = p.o_lat + (i * s.num_heads + h) * s.kv_lora;
  const float out_scale = p.cache_fp8 ? p.k_scale : 1.0f;
#pragma unroll
  for (int k = 0; k < kMaxChannels; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c < s.kv_lora) ol[c] = acc[k] / l * out_scale;
  }
}

// out[r, h, o] = sum_c W_UV[h][o, c] * o_lat[r, h, c]; one warp per output.
__global__ void v_absorb_kernel(MlaAbsorbedParams p) {
  const MlaShape& s = p.s;
  const int64_t i = blockIdx.x, r = p.rows ? p.rows[i] : p.row_offset + i;
  const int h = blockIdx.y;
  const float* ol = p.o_lat + (i * s.num_heads + h) * s.kv_lora;
  const int64_t w_row0 = static_cast<int64_t>(h) * (s.qk_nope + s.v_head) + s.qk_nope;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  for (int o = warp; o < s.v_head; o += num_warps) {
    float acc = 0.0f;
    for (int c = lane; c < s.kv_lora; c += 32) acc += p.kv_b.at(w_row0 + o, c) * ol[c];
    acc = warp_sum(acc);
    if (lane == 0) p.out[r * p.out_stride + h * s.v_head + o] = __float2bfloat16(acc);
  }
}

// One block per (query, head) of a piece: scores against the piece's keys,
// then a log-sum-exp merge into acc/lse.
__global__ void expanded_piece_kernel(MlaExpandedPieceParams p) {
  extern __shared__ float smem[];
  const MlaShape& s = p.s;
  const int64_t i = blockIdx.x;
  const int h = blockIdx.y;
  const int64_t pos = p.q_pos0 + i;
  const int64_t visible = p.num_keys < pos + 1 - p.key_begin ? p.num_keys : pos + 1 - p.key_begin;  // keys of this piece it sees
  float* q = smem;                   // [qk_head]
  float* scores = q + s.qk_head();   // [num_keys]
  const __nv_bfloat16* qr = p.q + i * p.q_stride + h * s.qk_head();
  for (int c = threadIdx.x; c < s.qk_head(); c += blockDim.x) q[c] = __bfloat162float(qr[c]);
  __syncthreads();
  const int kv_width = s.num_heads * (s.qk_nope + s.v_head);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  for (int64_t j = warp; j < visible; j += num_warps) {
    const __nv_bfloat16* k_nope = p.kv + j * kv_width + h * (s.qk_nope + s.v_head);
    const __nv_bfloat16* k_pe = p.latent + j * s.latent() + s.kv_lora;
    float d = 0.0f;
    for (int c = lane; c < s.qk_nope; c += 32) d += q[c] * __bfloat162float(k_nope[c]);
    for (int c = lane; c < s.qk_rope; c += 32) d += q[s.qk_nope + c] * __bfloat162float(k_pe[c]);
    d = warp_sum(d);
    if (lane == 0) scores[j] = d * s.scale;
  }
  __syncthreads();
  float* acc = p.acc + (i * s.num_heads + h) * s.v_head;
  float* lse = p.lse + i * s.num_heads + h;
  if (visible <= 0) {  // nothing visible in this piece
    if (p.first) {
      for (int c = threadIdx.x; c < s.v_head; c += blockDim.x) acc[c] = 0.0f;
      if (threadIdx.x == 0) *lse = -INFINITY;
    }
    return;
  }
  float mx = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) mx = fmaxf(mx, scores[j]);
  float sum = 0.0f;
  for (int64_t j = 0; j < visible; ++j) sum += expf(scores[j] - mx);
  const float piece_lse = mx + logf(sum);
  const float old_lse = p.first ? -INFINITY : *lse;
  const float new_lse = fmaxf(old_lse, piece_lse) + log1pf(expf(-fabsf(old_lse - piece_lse)));
  const float w_old = p.first ? 0.0f : expf(old_lse - new_lse);
  const float w_new = expf(piece_lse - new_lse);
  for (int c = threadIdx.x; c < s.v_head; c += blockDim.x) {
    float o = 0.0f;
    for (int64_t j = 0; j < visible; ++j) {
      const __nv_bfloat16* v = p.kv + j * kv_width + h * (s.qk_nope + s.v_head) + s.qk_nope;
      o += expf(scores[j] - mx) * __bfloat162float(v[c]);
    }
    o /= sum;
    acc[c] = (p.first ? 0.0f : acc[c] * w_old) + o * w_new;
  }
  __syncthreads();
  if (threadIdx.x == 0) *lse = new_lse;
}

__global__ void store_output_kernel(const float* __restrict__ acc, int num_heads, int v_head,
                                    __nv_bfloat16* __restrict__ out, int64_t out_stride) {
  const int64_t i = blockIdx.x;
  for (int c = threadIdx.x; c < num_heads * v_head; c += blockDim.x)
    out[i * out_stride + c] = __float2bfloat16(acc[i * num_heads * v_head + c]);
}

}  // namespace

cudaError_t launch_mla_absorbed_naive(const MlaAbsorbedParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  if (p.s.kv_lora > 4 * kThreads) return cudaErrorInvalidValue;
  if (p.cache_ds_mla && (p.cache_fp8 || p.s.kv_lora != kDsMlaLatent || p.s.qk_rope != kDsMlaRope))
    return cudaErrorInvalidValue;
  dim3 grid(static_cast<unsigned>(p.num_rows), p.s.num_heads);
  q_absorb_kernel<<<grid, kThreads, 0, stream>>>(p);
  const size_t smem = (p.s.latent() + kKeyTile) * sizeof(float);
  absorbed_attention_kernel<<<grid, kThreads, smem, stream>>>(p);
  v_absorb_kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_mla_expanded_piece_naive(const MlaExpandedPieceParams& p, cudaStream_t stream) {
  if (p.num_q == 0) return cudaSuccess;
  const size_t smem = (p.s.qk_head() + p.num_keys) * sizeof(float);
  if (smem > 200 * 1024) return cudaErrorInvalidValue;  // pieces are bounded by the caller
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(expanded_piece_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  dim3 grid(static_cast<unsigned>(p.num_q), p.s.num_heads);
  expanded_piece_kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_mla_store_output(const float* acc, int64_t num_q, int num_heads, int v_head, __nv_bfloat16* out,
                                    int64_t out_stride, cudaStream_t stream) {
  if (num_q == 0) return cudaSuccess;
  store_output_kernel<<<static_cast<unsigned>(num_q), kThreads, 0, stream>>>(acc, num_heads, v_head, out,
                                                                            out_stride);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
