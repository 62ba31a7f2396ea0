// CUDA RoPE on q_pe and k_pe fused with the latent KV-cache write
// (semantics: ops/rope_kv_cache_write.h RopeKvCacheWriteOp; math: kernels/rope/rope_ref.h).
// The cache row is stored as bf16 (c_kv copied, k_pe rotated in f32 and
// rounded once), or as FP8 e4m3 (ops/kv_cache_dtype.h): each element
// e4m3(value / k_scale) with value the bf16 c_kv or the f32 rotated k_pe, the
// division in f32 (IEEE, as the CPU reference), round to nearest even,
// saturating at +-448 (cvt.rn.satfinite); or as the tile-scaled fp8_ds_mla
// row (kernels/mla/ds_mla_row.h: the bf16 c_kv in e4m3 with one f32 scale
// per 128, the f32 rotated k_pe rounded to bf16; kv_lora 512, qk_rope 64).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

struct RopeKvCacheParams {
  __nv_bfloat16* q = nullptr;  // [num_tokens, q_stride], head h at h * (qk_nope + qk_rope); RoPE in place
  int64_t q_stride = 0;
  // Optional f32 source of q ([num_tokens, q_in_stride], a split-K GEMM's
  // output): when set, q is written whole from it (q_nope converted, q_pe
  // rotated) instead of rotated in place.
  const float* q_in = nullptr;
  int64_t q_in_stride = 0;
  const __nv_bfloat16* kv_a = nullptr;  // [num_tokens, kv_stride]: [c_kv normalised (kv_lora) | k_pe (qk_rope)]
  int64_t kv_stride = 0;
  // Optional kv_a_layernorm fused in: when set, kv_a's c_kv is not yet
  // normalised and the row stores c = bf16(rmsnorm(c_kv) * kv_norm_w) (w:
  // [kv_lora] f32 on the device, eps kv_norm_eps; kv_lora <= 1024), computed
  // as the RMSNorm kernel computes it (the same per-thread partial sums of 256
  // threads and block reduction), so the bytes equal launch_rmsnorm_inplace
  // followed by this kernel without it. kv_a itself is not written.
  const float* kv_norm_w = nullptr;
  float kv_norm_eps = 0.0f;
  const int32_t* positions = nullptr;  // [num_tokens]
  const int64_t* slot_mapping = nullptr;  // [num_tokens]; -1 writes nothing
  const float* inv_freq = nullptr;        // [qk_rope / 2] device
  float attention_factor = 1.0f;          // YaRN cos/sin multiplier
  // This layer: [num_slots, kv_lora + qk_rope] bf16, or e4m3 bytes when
  // cache_fp8, or [num_slots, 656] bytes when cache_ds_mla.
  void* cache = nullptr;
  bool cache_fp8 = false;
  bool cache_ds_mla = false;  // the tile-scaled row; k_scale unused (cudaErrorInvalidValue with cache_fp8)
  float k_scale = 1.0f;   // FP8 only (> 0): stored = e4m3(value / k_scale)
  int64_t num_tokens = 0;
  int num_heads = 0;
  int qk_nope = 0;
  int qk_rope = 0;
  int kv_lora = 0;
  // Launch as a programmatic dependent (PDL, kernels/common/pdl.cuh) of the
  // kernel before it: scheduled early, it waits for that kernel before it
  // reads or writes anything.
  bool pdl = false;
};

// One block per token; every token is written the same way whatever the
// launch's other tokens (prefill and decode rows of a token are byte-equal).
// Stream-async, graph-safe. cudaErrorInvalidValue for an FP8 cache without a
// positive k_scale, both cache layouts at once, an fp8_ds_mla row of other
// widths than 512 + 64, or kv_norm_w with kv_lora > 1024.
cudaError_t launch_rope_kv_cache_write(const RopeKvCacheParams& p, cudaStream_t stream);

}  // namespace nucleus::kernels
