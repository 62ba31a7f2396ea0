// Plain CUDA MLA attention kernels (semantics: mla_attention_ref.h). They are
// the always-available fallback behind the attention dispatch and favour
// clarity over speed: the absorbed form reads the cache once per head.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/weight_view.cuh"

namespace nucleus::kernels {

struct MlaShape {
  int num_heads = 0;
  int qk_nope = 0;  // 128
  int qk_rope = 0;  // 64
  int v_head = 0;   // 128
  int kv_lora = 0;  // 512
  float scale = 0;  // softmax scale (ModelConfig::softmax_scale)
  __host__ __device__ int qk_head() const { return qk_nope + qk_rope; }
  __host__ __device__ int latent() const { return kv_lora + qk_rope; }
};

// Absorbed-form attention for `num_rows` query rows over the paged latent
// cache. An FP8 cache's k_scale is factored out of the sums: scores
// scale * k_scale * (q . stored), o_lat = k_scale * sum_j p_j stored_j.
struct MlaAbsorbedParams {
  MlaShape s;
  const __nv_bfloat16* q = nullptr;  // [T, num_heads * qk_head], RoPE applied
  int64_t q_stride = 0;
  const int32_t* rows = nullptr;  // [num_rows] query rows to process; null: rows row_offset + i
  int64_t row_offset = 0;
  int64_t num_rows = 0;
  const int32_t* token_seq = nullptr;     // [T] sequence of each row
  const int32_t* query_start = nullptr;   // [num_seqs + 1]
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks]
  int max_blocks = 0;
  int block_size = 0;
  // This layer: [num_slots, latent] bf16, or e4m3 bytes when cache_fp8, or
  // [num_slots, 656] bytes when cache_ds_mla.
  const void* cache = nullptr;
  bool cache_fp8 = false;       // rows read as stored * k_scale (ops/kv_cache_dtype.h)
  bool cache_ds_mla = false;    // fp8_ds_mla rows read as stored * scale[tile] (kernels/mla/ds_mla_row.h;
                                // kv_lora 512, qk_rope 64; not with cache_fp8)
  float k_scale = 1.0f;
  WeightView kv_b;                       // [num_heads * (qk_nope + v_head), kv_lora]
  float* q_lat = nullptr;                // scratch [num_rows, num_heads, kv_lora] f32 (by i, not row)
  float* o_lat = nullptr;                // scratch [num_rows, num_heads, kv_lora] f32
  __nv_bfloat16* out = nullptr;          // [T, num_heads * v_head]
  int64_t out_stride = 0;
};
cudaError_t launch_mla_absorbed_naive(const MlaAbsorbedParams& p, cudaStream_t stream);

// Expanded-form attention of one sequence's `num_q` query rows against keys
// [key_begin, key_end) (positions), given those keys' expanded K_nope / V
// (kv [key_end - key_begin, num_heads * (qk_nope + v_head)] bf16) and latent
// rows (for k_pe). Query i sits at position q_pos0 + i and sees keys <= its
// position. Results are merged into acc/lse by log-sum-exp, so a long context
// can be processed in pieces: the first piece must set `first`.
struct MlaExpandedPieceParams {
  MlaShape s;
  const __nv_bfloat16* q = nullptr;  // [num_q rows, q_stride] (this sequence's rows)
  int64_t q_stride = 0;
  int64_t num_q = 0;
  int64_t q_pos0 = 0;
  const __nv_bfloat16* kv = nullptr;      // [num_keys, num_heads * (qk_nope + v_head)]
  const __nv_bfloat16* latent = nullptr;  // [num_keys, latent]
  int64_t key_begin = 0;
  int64_t num_keys = 0;
  float* acc = nullptr;  // [num_q, num_heads, v_head] f32 running output (normalised)
  float* lse = nullptr;  // [num_q, num_heads] running log-sum-exp
  bool first = true;
};
cudaError_t launch_mla_expanded_piece_naive(const MlaExpandedPieceParams& p, cudaStream_t stream);

// out[i, h * v_head + c] = bf16(acc[i, h, c]) for num_q rows (row stride out_stride).
cudaError_t launch_mla_store_output(const float* acc, int64_t num_q, int num_heads, int v_head, __nv_bfloat16* out,
                                    int64_t out_stride, cudaStream_t stream);

}  // namespace nucleus::kernels
