// Expanded-form MLA prefill attention on tensor cores (FlashAttention-2
// scheme, mma.sync m16n8k16 bf16 with f32 accumulation), for many sequences
// of different lengths in one launch. Semantics: mla_attention_ref.h
// (mla_attention_expanded_ref), given the expanded keys and values.
//
// For each sequence s of the launch, query i (row q_row0 + i, position
// q_pos0 + i) and head h:
//   visible  = { key positions j in [key_begin, key_end) : j <= q_pos0 + i }
//   S_j      = scale * q[i, h, :] . k[kv_row0 + j - key_begin, h, :]     (192 wide)
//   lse      = log(sum_{j in visible} exp(S_j))                          (natural log)
//   o[i, h]  = sum_{j in visible} exp(S_j - lse) v[kv_row0 + j - key_begin, h, :]   (128 wide)
// With `merge`, (o, lse) is combined with the values already in out / lse
// (an earlier key range of the same queries) by log-sum-exp:
//   lse' = log(exp(lse_old) + exp(lse)),  o' = exp(lse_old - lse') o_old + exp(lse - lse') o.
// A row that sees no key of this range keeps its old values (merge) or gets
// o = 0, lse = -inf (no merge).
//
// Head dims are fixed: q/k 192 = [nope 128 | rope 64], v 128.
// Tiles: a CTA handles kBlockM query rows (64 or 128, mla_prefill_block_m) of
// one sequence and one head, walking the keys in tiles of 64.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

constexpr int kMlaPrefillQkDim = 192;
constexpr int kMlaPrefillVDim = 128;

// One sequence's share of a launch.
struct MlaPrefillSeq {
  int32_t q_row0 = 0;     // its first query row in q / out / lse
  int32_t num_q = 0;      // its query rows
  int32_t q_pos0 = 0;     // position of its query 0 (= context_len [+ offset])
  int32_t kv_row0 = 0;    // row of k / v holding key position key_begin
  int32_t key_begin = 0;  // key positions [key_begin, key_end) are in k / v for this launch
  int32_t key_end = 0;
};

// One CTA's work (times num_heads): rows [q_tile * block_m, +block_m) of a sequence.
struct MlaPrefillWork {
  int32_t seq = 0;
  int32_t q_tile = 0;
};

struct MlaPrefillParams {
  const __nv_bfloat16* q = nullptr;  // [rows, q_stride]; head h at columns [h*192, +192), RoPE applied
  int64_t q_stride = 0;              // elements, multiple of 8
  const __nv_bfloat16* k = nullptr;  // [kv rows, k_stride]; head h at [h*192, +192) = [k_nope | k_pe]
  int64_t k_stride = 0;
  const __nv_bfloat16* v = nullptr;  // [kv rows, v_stride]; head h at [h*128, +128)
  int64_t v_stride = 0;
  __nv_bfloat16* out = nullptr;  // [rows, out_stride]; head h at [h*128, +128)
  int64_t out_stride = 0;
  float* lse = nullptr;  // [rows, num_heads] f32, natural log; may be null unless merge
  bool merge = false;    // combine with out / lse by log-sum-exp (see above)
  const MlaPrefillSeq* seqs = nullptr;   // [num_seqs] (device)
  const MlaPrefillWork* work = nullptr;  // [num_work] (device), heaviest first for a short tail
  int num_work = 0;
  int num_heads = 0;
  float scale = 0.0f;  // softmax scale (ModelConfig::softmax_scale); never derived here
  int block_m = 128;   // query rows per CTA: 64 or 128; work items' q_tile counts in these
  bool use_wgmma = false;  // wgmma (sm_90a warpgroup MMA) instead of mma.sync; same results up to rounding order
};

// The query tile height for a launch of `tiles_128` tiles of 128 rows (summed
// over sequences) and `num_heads` heads on `num_sms` SMs: 128 when that fills
// the GPU, else 64 (more CTAs for small launches).
int mla_prefill_block_m(int64_t tiles_128, int num_heads, int num_sms);

// Resident CTAs per SM of the variant (cudaOccupancy...; -1 on error), for benchmarks.
int mla_prefill_ctas_per_sm(int block_m, bool use_wgmma);

// Launches the attention (stream-async; capturable). Returns
// cudaErrorInvalidValue on misaligned pointers/strides or a bad block_m.
cudaError_t launch_mla_prefill(const MlaPrefillParams& p, cudaStream_t stream);

}  // namespace nucleus::kernels
