#include "kernels/mla/mla_attention_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/parallel.h"
#include "kernels/gemm/gemm_ref.h"

namespace nucleus::kernels {

namespace {

// Softmax of s[0:n] in place (max-subtracted, f32 exp, f64 sum); returns the
// log-sum-exp of the inputs.
float softmax_inplace(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  auto inv = static_cast<float>(1.0 / sum);
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  return mx + static_cast<float>(std::log(sum));
}

}  // namespace

void mla_attention_expanded_ref(const MlaDims& d, const float* q, int64_t q_stride, int64_t num_queries,
                                int64_t context_len, const float* latent, const float* w_kv_b, float* out,
                                int64_t out_stride, float* lse) {
  const int64_t num_keys = context_len + num_queries;
  const int64_t kv_width = d.qk_nope + d.v_head;
  // kv[j, h*(kv_width) + :] = W_kv_b c_j : [num_keys, num_heads * kv_width]
  std::vector<float> kv(num_keys * d.num_heads * kv_width);
  gemm_ref(latent, d.latent_width(), w_kv_b, num_keys, d.num_heads * kv_width, d.kv_lora, kv.data(),
           d.num_heads * kv_width, /*accumulate=*/false);
  parallel_for(num_queries * d.num_heads, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> s(num_keys);
    for (int64_t qh = begin; qh < end; ++qh) {
      const int64_t i = qh / d.num_heads, h = qh % d.num_heads;
      const float* qi = q + i * q_stride + h * d.qk_head();
      const int64_t n = context_len + i + 1;
      for (int64_t j = 0; j < n; ++j) {
        const float* k_nope = kv.data() + (j * d.num_heads + h) * kv_width;
        const float* k_pe = latent + j * d.latent_width() + d.kv_lora;
        s[j] = (dot_ref(qi, k_nope, d.qk_nope) + dot_ref(qi + d.qk_nope, k_pe, d.qk_rope)) * d.scale;
      }
      float l = softmax_inplace(s.data(), n);
      if (lse) lse[i * d.num_heads + h] = l;
      float* o = out + i * out_stride + h * d.v_head;
      std::fill(o, o + d.v_head, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float* v = kv.data() + (j * d.num_heads + h) * kv_width + d.qk_nope;
        for (int64_t c = 0; c < d.v_head; ++c) o[c] += s[j] * v[c];
      }
    }
  });
}

void mla_attention_absorbed_ref(const MlaDims& d, const float* q, int64_t q_stride, int64_t num_queries,
                                int64_t context_len, const float* latent, const float* w_kv_b, float* out,
                                int64_t out_stride, float* lse) {
  const int64_t num_keys = context_len + num_queries;
  const int64_t kv_width = d.qk_nope + d.v_head;
  parallel_for(num_queries * d.num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(num_keys), q_lat(d.kv_lora), o_lat(d.kv_lora);
    for (int64_t qh = begin; qh < end; ++qh) {
      const int64_t i = qh / d.num_heads, h = qh % d.num_heads;
      const float* qi = q + i * q_stride + h * d.qk_head();
      const float* w_uk = w_kv_b + h * kv_width * d.kv_lora;  // [qk_nope, kv_lora]
      const float* w_uv = w_uk + d.qk_nope * d.kv_lora;        // [v_head, kv_lora]
      // q_lat[c] = sum_r q_nope[r] * W_UK[r, c]
      std::fill(q_lat.begin(), q_lat.end(), 0.0f);
      for (int64_t r = 0; r < d.qk_nope; ++r)
        for (int64_t c = 0; c < d.kv_lora; ++c) q_lat[c] += qi[r] * w_uk[r * d.kv_lora + c];
      const int64_t n = context_len + i + 1;
      for (int64_t j = 0; j < n; ++j) {
        const float* row = latent + j * d.latent_width();
        s[j] = (dot_ref(q_lat.data(), row, d.kv_lora) + dot_ref(qi + d.qk_nope, row + d.kv_lora, d.qk_rope)) *
               d.scale;
      }
      float l = softmax_inplace(s.data(), n);
      if (lse) lse[i * d.num_heads + h] = l;
      std::fill(o_lat.begin(), o_lat.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float* row = latent + j * d.latent_width();
        for (int64_t c = 0; c < d.kv_lora; ++c) o_lat[c] += s[j] * row[c];
      }
      float* o = out + i * out_stride + h * d.v_head;
      for (int64_t r = 0; r < d.v_head; ++r) o[r] = dot_ref(w_uv + r * d.kv_lora, o_lat.data(), d.kv_lora);
    }
  });
}

}  // namespace nucleus::kernels
