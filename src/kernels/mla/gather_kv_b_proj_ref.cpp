#include "kernels/mla/gather_kv_b_proj_ref.h"

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/mla/ds_mla_row.h"

namespace nucleus::kernels {

float kv_b_scale_at(const KvBWeightFormat& f, const void* scale, int64_t k, int64_t row, int64_t col) {
  int64_t i = 0;
  switch (f.scale_layout) {
    case KvBScaleLayout::kNone:
      return 1.0f;
    case KvBScaleLayout::kPerRow:
      i = row;
      break;
    case KvBScaleLayout::kBlock:
      i = (row / f.block_n) * ((k + f.block_k - 1) / f.block_k) + col / f.block_k;
      break;
  }
  return f.scale_e8m0 ? e8m0_to_f32(static_cast<const uint8_t*>(scale)[i]) : static_cast<const float*>(scale)[i];
}

void dequantize_kv_b_weight_ref(const void* weight, const void* scale, const KvBWeightFormat& f, int64_t n,
                                int64_t k, float* out) {
  convert_to_f32(weight, f.weight_dtype, out, static_cast<size_t>(n * k));
  if (f.scale_layout == KvBScaleLayout::kNone) return;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) out[r * k + c] *= kv_b_scale_at(f, scale, k, r, c);
}

void gather_kv_b_proj_ref(const GatherKvBProjRefParams& p) {
  const int64_t width = p.kv_lora + p.qk_rope;             // latent row
  const int64_t head_kv = p.qk_nope + p.v_head;           // kv_b output per head
  const int64_t n = p.num_heads * head_kv;
  const int64_t k_row = p.qk_nope + p.qk_rope;            // k per head
  const bool scaled = p.cache_dtype == DType::kF8E4M3;    // a bf16/f32 cache is never scaled
  const size_t elem = dtype_size(p.cache_dtype);
  const bool ds_mla = p.cache_dtype == DType::kU8;        // the tile-scaled 656-byte row
  NUCLEUS_CHECK(!ds_mla || (p.kv_lora == kDsMlaLatent && p.qk_rope == kDsMlaRope),
                "gather_kv_b_proj_ref: an fp8_ds_mla cache needs kv_lora 512 and qk_rope 64 (got {}, {})", p.kv_lora,
                p.qk_rope);
  // Rows in pieces so scratch stays small; rows are independent.
  constexpr int64_t kPiece = 256;
  std::vector<float> latent(std::min(kPiece, p.num_keys) * width), kv(std::min(kPiece, p.num_keys) * n);
  for (int64_t j0 = 0; j0 < p.num_keys; j0 += kPiece) {
    const int64_t rows = std::min(kPiece, p.num_keys - j0);
    for (int64_t r = 0; r < rows; ++r) {  // latent [rows, width]
      const int64_t pos = p.key_begin + j0 + r;
      const int64_t slot = static_cast<int64_t>(p.block_table[pos / p.block_size]) * p.block_size + pos % p.block_size;
      NUCLEUS_CHECK(slot >= 0, "gather_kv_b_proj_ref: negative slot for position {}", pos);
      float* row = latent.data() + r * width;
      if (ds_mla) {
        decode_ds_mla_row_ref(static_cast<const uint8_t*>(p.cache) + slot * kDsMlaRowBytes, row);
        continue;
      }
      convert_to_f32(static_cast<const char*>(p.cache) + slot * width * elem, p.cache_dtype, row,
                     static_cast<size_t>(width));
      if (scaled)
        for (int64_t c = 0; c < width; ++c) row[c] *= p.k_scale;
    }
    gemm_ref(latent.data(), width, p.weight, rows, n, p.kv_lora, kv.data(), n, false);  // kv [rows, n]
    for (int64_t r = 0; r < rows; ++r) {
      const float* kv_row = kv.data() + r * n;
      const float* pe = latent.data() + r * width + p.kv_lora;
      for (int64_t h = 0; h < p.num_heads; ++h) {
        float* k = p.k + ((j0 + r) * p.num_heads + h) * k_row;
        float* v = p.v + ((j0 + r) * p.num_heads + h) * p.v_head;
        std::copy_n(kv_row + h * head_kv, p.qk_nope, k);
        std::copy_n(pe, p.qk_rope, k + p.qk_nope);
        std::copy_n(kv_row + h * head_kv + p.qk_nope, p.v_head, v);
      }
    }
  }
}

}  // namespace nucleus::kernels
