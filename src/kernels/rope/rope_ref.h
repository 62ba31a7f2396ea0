// Rotary position embedding on interleaved pairs (GPT-J style; what Hugging
// Face calls rope_interleave=True for DeepSeek): elements (2i, 2i+1) of a
// rope_dim-wide vector rotate by angle pos * inv_freq[i]:
//   y[2i]   = x[2i] * cos - x[2i+1] * sin
//   y[2i+1] = x[2i+1] * cos + x[2i] * sin
// with cos/sin multiplied by the YaRN attention factor
// mscale(factor, mscale) / mscale(factor, mscale_all_dim).
// YaRN frequencies (DeepSeek-V2 modeling code, yarn_find_correction_range):
//   extra[i] = theta^(-2i/d), inter[i] = extra[i] / factor,
//   low = floor(d ln(L0 / (2 pi beta_fast)) / (2 ln theta)),
//   high = ceil(d ln(L0 / (2 pi beta_slow)) / (2 ln theta)), clamped to [0, d-1],
//   ramp[i] = clamp((i - low) / (high - low), 0, 1),
//   inv_freq[i] = inter[i] * ramp[i] + extra[i] * (1 - ramp[i]).
#pragma once

#include <cstdint>
#include <vector>

namespace nucleus::kernels {

// What the RoPE math needs of a model config (config.json's names; built from
// a ModelConfig by rope_params in model/deepseek/kernel_params.h).
struct RopeParams {
  int64_t rope_dim = 0;        // qk_rope_head_dim (even)
  double theta = 10000.0;      // rope_theta
  bool yarn = false;           // rope_scaling type yarn; false: plain RoPE, the fields below unused
  double factor = 1.0;         // rope_scaling.factor
  int64_t original_max_position_embeddings = 0;  // L0
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // The YaRN cos/sin multiplier mscale(factor, mscale) / mscale(factor,
  // mscale_all_dim) (yarn_get_mscale, io/hf_config.h); 1 without YaRN.
  double attention_factor = 1.0;
};

// Per-position cos/sin table for one model: [max_positions, rope_dim / 2]
// each. Later positions are computed when asked, to the same f32 values, so
// a model with a long context (max_position_embeddings up to 2^24) keeps a
// bounded table.
struct RopeTable {
  int64_t rope_dim = 0;
  int64_t max_positions = 0;    // positions held in cos / sin
  std::vector<float> inv_freq;  // [rope_dim / 2]
  float attention_factor = 1.0f;
  std::vector<float> cos;       // [max_positions, rope_dim / 2], attention factor applied
  std::vector<float> sin;
};

// Inverse frequencies [rope_dim / 2] (plain RoPE or YaRN), f32.
std::vector<float> rope_inv_freq(const RopeParams& params);
// Builds the table for positions [0, max_positions).
RopeTable make_rope_table(const RopeParams& params, int64_t max_positions);

// Rotates x[0:rope_dim] in place at position `pos` (>= 0; from the table when
// pos < table.max_positions, else computed).
void apply_rope_interleaved_ref(const RopeTable& table, int64_t pos, float* x);

}  // namespace nucleus::kernels
