// CPU reference multi-head latent attention (DeepSeek-V2 paper, section 2.1;
// DeepSeek-V3 modeling code) over latent KV rows [c_kv | k_pe], in both forms.
//
// Dimensions: num_heads, qk_nope (128), qk_rope (64), v_head (128),
// kv_lora (512); a latent row is kv_lora + qk_rope wide (576).
// Query row layout per head: [q_nope (qk_nope) | q_pe (qk_rope)], RoPE already
// applied to q_pe; key j's k_pe is the row's last qk_rope values (RoPE applied).
// kv_b_proj weight W: [num_heads * (qk_nope + v_head), kv_lora]; head h's rows
// [h*(qk_nope+v_head), +qk_nope) are W_UK[h], the next v_head rows W_UV[h].
//
// Query i of a sequence sits at position context_len + i and attends to keys
// 0 .. context_len + i (causal; the keys include the queries' own rows).
//   Expanded:  k_j = [W_UK c_j | k_pe_j], v_j = W_UV c_j,
//              o = sum_j softmax_j(scale * q.k_j) v_j
//   Absorbed:  q_lat = W_UK^T q_nope (kv_lora wide),
//              s_j = scale * (q_lat . c_j + q_pe . k_pe_j),
//              o = W_UV (sum_j softmax_j(s) c_j)
// The two are equal in exact arithmetic. `scale` is the model's softmax scale
// (ModelConfig::softmax_scale), never derived from a head width here.
#pragma once

#include <cstdint>

namespace nucleus::kernels {

struct MlaDims {
  int64_t num_heads = 0;
  int64_t qk_nope = 0;
  int64_t qk_rope = 0;
  int64_t v_head = 0;
  int64_t kv_lora = 0;
  float scale = 0.0f;

  int64_t qk_head() const { return qk_nope + qk_rope; }
  int64_t latent_width() const { return kv_lora + qk_rope; }
};

// Attention for one sequence.
//   q:       [num_queries, num_heads * qk_head] f32, row stride q_stride
//   latent:  [context_len + num_queries, latent_width] f32 contiguous (the
//            sequence's latent rows in position order)
//   w_kv_b:  [num_heads * (qk_nope + v_head), kv_lora] f32
//   out:     [num_queries, num_heads * v_head] f32, row stride out_stride
//   lse:     [num_queries, num_heads] natural-log sum of exp(scaled scores),
//            may be null
void mla_attention_expanded_ref(const MlaDims& dims, const float* q, int64_t q_stride, int64_t num_queries,
                                int64_t context_len, const float* latent, const float* w_kv_b, float* out,
                                int64_t out_stride, float* lse);

void mla_attention_absorbed_ref(const MlaDims& dims, const float* q, int64_t q_stride, int64_t num_queries,
                                int64_t context_len, const float* latent, const float* w_kv_b, float* out,
                                int64_t out_stride, float* lse);

}  // namespace nucleus::kernels
