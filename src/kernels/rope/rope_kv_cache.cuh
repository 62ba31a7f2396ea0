// CUDA RoPE on q_pe and k_pe fused with the latent KV-cache write
// (semantics: ops/mla_ops.h RopeKvCacheWriteOp; math: kernels/rope/rope_ref.h).
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
  const int32_t* positions = nullptr;  // [num_tokens]
  const int64_t* slot_mapping = nullptr;  // [num_tokens]; -1 writes nothing
  const float* inv_freq = nullptr;        // [qk_rope / 2] device
  float attention_factor = 1.0f;          // YaRN cos/sin multiplier
  __nv_bfloat16* cache = nullptr;         // this layer: [num_slots, kv_lora + qk_rope]
  int64_t num_tokens = 0;
  int num_heads = 0;
  int qk_nope = 0;
  int qk_rope = 0;
  int kv_lora = 0;
};

// Stream-async, graph-safe.
cudaError_t launch_rope_kv_cache_write(const RopeKvCacheParams& p, cudaStream_t stream);

}  // namespace nucleus::kernels
