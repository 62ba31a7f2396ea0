// gather_kv_b_proj on CUDA (semantics: gather_kv_b_proj_ref.h).
//   fused:   one launch: gather latent rows through the block table,
//            dequantize them, multiply by kv_b_proj on the tensor cores
//            (mma.sync bf16, f32 accumulation; FP8 weights converted exactly
//            to bf16 in registers, their scales applied in f32), write k (with
//            k_pe broadcast to each head) and v in place.
//   unfused: plain steps the ops layer chains with a cuBLASLt GEMM: gather +
//            dequantize to bf16, the split/concat into k and v, and the
//            one-off weight dequantization to bf16.
// All launches are stream-async and graph-safe (no allocation, no sync).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/mla/gather_kv_b_proj_ref.h"

namespace nucleus::kernels {

struct GatherKvBProjParams {
  int num_heads = 0;
  int qk_nope = 0;  // 128
  int qk_rope = 0;  // 64
  int v_head = 0;   // 128
  int kv_lora = 0;  // 512
  const void* cache = nullptr;  // [num_slots, kv_lora + qk_rope] in cache_dtype
  DType cache_dtype = DType::kBF16;  // kF32, kBF16 or kF8E4M3 (the fused kernel reads no fp8_ds_mla rows)
  float k_scale = 1.0f;              // FP8 cache only (ignored for the others)
  const int32_t* block_table = nullptr;  // this sequence's, device
  int block_size = 0;
  int64_t key_begin = 0;
  int64_t num_keys = 0;
  const void* weight = nullptr;  // [num_heads * (qk_nope + v_head), kv_lora] bf16 or f8e4m3
  const void* scale = nullptr;   // FP8: per KvBWeightFormat (f32 or E8M0 bytes); else null
  KvBWeightFormat format;
  __nv_bfloat16* k = nullptr;  // [num_keys, num_heads, qk_nope + qk_rope]
  __nv_bfloat16* v = nullptr;  // [num_keys, num_heads, v_head]
};

// The fused kernel's tile: 128 keys x 128 kv_b outputs, k steps of 64.
constexpr int kGkvFusedTileM = 128;
constexpr int kGkvFusedTileN = 128;
constexpr int kGkvFusedTileK = 64;

// Shared memory one fused CTA needs for this kv_lora (bytes).
int64_t gather_kv_b_proj_fused_smem_bytes(int kv_lora, bool fp8_weight);
// Raises the fused kernels' dynamic shared-memory limit; call once before
// launching (not a stream operation).
cudaError_t gather_kv_b_proj_fused_prepare();
// One launch. Needs: kv_lora % 64 == 0, qk_nope, v_head, qk_rope % 8 == 0,
// weight bf16 or f8e4m3; block scales with block_n % 128 == 0 and
// block_k % 64 == 0 (the ops layer checks; see supports in the ops).
cudaError_t launch_gather_kv_b_proj_fused(const GatherKvBProjParams& p, int num_sms, cudaStream_t stream);

// latent[j, :] = bf16(cache[slot(key_begin + j), :width] (* k_scale for FP8)).
//   latent: [num_keys, width] bf16, contiguous. cache_dtype kU8: fp8_ds_mla
//   rows of 656 bytes (kernels/mla/ds_mla_row.h), read as e4m3 * tile scale
//   (one rounding to bf16) and the bf16 rope part; width must be 576.
cudaError_t launch_gather_dequant_latent(const void* cache, DType cache_dtype, int width, float k_scale,
                                         const int32_t* block_table, int block_size, int64_t key_begin,
                                         int64_t num_keys, __nv_bfloat16* latent, cudaStream_t stream);

// k[j, h] = [kv[j, h * (qk_nope + v_head) + :qk_nope] | latent[j, kv_lora:]],
// v[j, h] = kv[j, h * (qk_nope + v_head) + qk_nope:], for num_keys rows.
//   kv: [num_keys, num_heads * (qk_nope + v_head)] bf16; latent: [num_keys, kv_lora + qk_rope] bf16.
cudaError_t launch_split_kv(const __nv_bfloat16* kv, const __nv_bfloat16* latent, int num_heads, int qk_nope,
                            int qk_rope, int v_head, int kv_lora, int64_t num_keys, __nv_bfloat16* k,
                            __nv_bfloat16* v, cudaStream_t stream);

// out[n, k] = bf16(weight[n, k] * scale(n, k)) (f32 product, one rounding).
cudaError_t launch_dequantize_kv_b_weight(const void* weight, const void* scale, const KvBWeightFormat& f, int64_t n,
                                          int64_t k, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace nucleus::kernels
