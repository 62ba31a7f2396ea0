#include "kernels/rope/rope_ref.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace nucleus::kernels {

namespace {
double correction_dim(double num_rotations, double dim, double base, double max_pos) {
  return (dim * std::log(max_pos / (num_rotations * 2.0 * M_PI))) / (2.0 * std::log(base));
}
}  // namespace

std::vector<float> rope_inv_freq(const RopeParams& rs) {
  const int64_t d = rs.rope_dim, half = d / 2;
  std::vector<float> inv(half);
  double low = 0, high = 0;
  if (rs.yarn) {
    auto L0 = static_cast<double>(rs.original_max_position_embeddings);
    low = std::max(0.0, std::floor(correction_dim(rs.beta_fast, d, rs.theta, L0)));
    high = std::min(static_cast<double>(d - 1), std::ceil(correction_dim(rs.beta_slow, d, rs.theta, L0)));
    if (low == high) high += 0.001;
  }
  for (int64_t i = 0; i < half; ++i) {
    // f32 like the reference implementations: pos_freqs = theta ** (2i / d) in f32.
    float pos_freq = static_cast<float>(std::pow(rs.theta, static_cast<double>(2 * i) / d));
    float extra = 1.0f / pos_freq;
    if (!rs.yarn) {
      inv[i] = extra;
      continue;
    }
    float inter = 1.0f / (static_cast<float>(rs.factor) * pos_freq);
    float ramp = static_cast<float>(std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0));
    float extra_weight = 1.0f - ramp;
    inv[i] = inter * (1.0f - extra_weight) + extra * extra_weight;
  }
  return inv;
}

RopeTable make_rope_table(const RopeParams& params, int64_t max_positions) {
  RopeTable t;
  t.rope_dim = params.rope_dim;
  t.max_positions = max_positions;
  t.inv_freq = rope_inv_freq(params);
  const auto factor = static_cast<float>(params.attention_factor);
  t.attention_factor = factor;
  const int64_t half = t.rope_dim / 2;
  t.cos.resize(max_positions * half);
  t.sin.resize(max_positions * half);
  for (int64_t p = 0; p < max_positions; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      float angle = static_cast<float>(p) * t.inv_freq[i];  // one f32 rounding, as an f32 outer product
      t.cos[p * half + i] = static_cast<float>(std::cos(static_cast<double>(angle))) * factor;
      t.sin[p * half + i] = static_cast<float>(std::sin(static_cast<double>(angle))) * factor;
    }
  }
  return t;
}

void apply_rope_interleaved_ref(const RopeTable& table, int64_t pos, float* x) {
  NUCLEUS_CHECK(pos >= 0, "rope position {} is negative", pos);
  const int64_t half = table.rope_dim / 2;
  if (pos >= table.max_positions) {  // past the table: make_rope_table's expressions
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos) * table.inv_freq[i];
      const float c = static_cast<float>(std::cos(static_cast<double>(angle))) * table.attention_factor;
      const float s = static_cast<float>(std::sin(static_cast<double>(angle))) * table.attention_factor;
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * c - b * s;
      x[2 * i + 1] = b * c + a * s;
    }
    return;
  }
  const float* c = table.cos.data() + pos * half;
  const float* s = table.sin.data() + pos * half;
  for (int64_t i = 0; i < half; ++i) {
    float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c[i] - b * s[i];
    x[2 * i + 1] = b * c[i] + a * s[i];
  }
}

}  // namespace nucleus::kernels
