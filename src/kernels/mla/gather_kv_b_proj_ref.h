// gather_kv_b_proj, CPU reference (fp32 compute), and the description of
// kv_b_proj's stored weight that every implementation reads
// (semantics: ops/gather_kv_b_proj.h; design.md "Cached-prefix prefill").
//
// For keys j in [0, num_keys) at positions key_begin + j of one sequence:
//   slot      = block_table[pos / block_size] * block_size + pos % block_size
//   latent_j  = cache[slot]                  [kv_lora + qk_rope], as f32
//   latent_j *= k_scale                      (FP8 e4m3 cache only; an fp8_ds_mla
//                                             row is read with its tile scales)
//   kv_j      = W latent_j[:kv_lora]         W: [num_heads * (qk_nope + v_head), kv_lora]
//   k[j, h]   = [kv_j[h * (qk_nope + v_head) + :qk_nope] | latent_j[kv_lora:]]
//   v[j, h]   = kv_j[h * (qk_nope + v_head) + qk_nope:]
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace nucleus::kernels {

// Where kv_b_proj's FP8 scales sit.
enum class KvBScaleLayout : uint8_t {
  kNone,    // BF16 / F32 weight: W = weight
  kPerRow,  // W[n, k] = q[n, k] * scale[n]                     scale: [n] or [n, 1]
  kBlock,   // W[n, k] = q[n, k] * scale[n / block_n, k / block_k]   scale: [ceil(n/bn), ceil(k/bk)]
};

// kv_b_proj's weight as stored (ops/gather_kv_b_proj.cpp reads it off a LinearWeight).
struct KvBWeightFormat {
  DType weight_dtype = DType::kBF16;  // kF32, kBF16 or kF8E4M3
  KvBScaleLayout scale_layout = KvBScaleLayout::kNone;
  bool scale_e8m0 = false;  // scale bytes e (U8) mean 2^(e-127); otherwise f32 scales
  int64_t block_n = 0;      // kBlock only
  int64_t block_k = 0;
};

// The scale that multiplies weight element [row, col] (1 for kNone).
//   scale: the scale tensor's data (f32 or E8M0 bytes); k: in_features.
float kv_b_scale_at(const KvBWeightFormat& f, const void* scale, int64_t k, int64_t row, int64_t col);

// out[n, k] = weight[n, k] * scale(n, k) in f32.
//   weight: [n, k] in f.weight_dtype; scale: see KvBScaleLayout (null for kNone).
void dequantize_kv_b_weight_ref(const void* weight, const void* scale, const KvBWeightFormat& f, int64_t n,
                                int64_t k, float* out);

struct GatherKvBProjRefParams {
  int64_t num_heads = 0;
  int64_t qk_nope = 0;
  int64_t qk_rope = 0;
  int64_t v_head = 0;
  int64_t kv_lora = 0;
  const void* cache = nullptr;  // [num_slots, kv_lora + qk_rope] in cache_dtype, or [num_slots, 656] bytes for kU8
  // kF32, kBF16, kF8E4M3, or kU8: the fp8_ds_mla row (kernels/mla/ds_mla_row.h;
  // needs kv_lora 512 and qk_rope 64).
  DType cache_dtype = DType::kBF16;
  float k_scale = 1.0f;              // applied to an F8_E4M3 cache only
  const int32_t* block_table = nullptr;  // [>= ceil((key_begin + num_keys) / block_size)]
  int64_t block_size = 0;
  int64_t key_begin = 0;
  int64_t num_keys = 0;
  const float* weight = nullptr;  // [num_heads * (qk_nope + v_head), kv_lora] f32 (dequantized)
  float* k = nullptr;             // [num_keys, num_heads, qk_nope + qk_rope] f32
  float* v = nullptr;             // [num_keys, num_heads, v_head] f32
};

// Each output element is one fixed-order dot product, so results do not
// depend on how [key_begin, key_begin + num_keys) is split into calls.
void gather_kv_b_proj_ref(const GatherKvBProjRefParams& p);

}  // namespace nucleus::kernels
