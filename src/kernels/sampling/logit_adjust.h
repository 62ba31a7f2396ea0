// vLLM's logit processors before temperature, as one per-token formula shared
// by the CPU sampler (runtime/sampler.cpp) and the CUDA kernel
// (kernels/sampling/sampling.cu), so both compute the same f32 values.
//
// Order (vLLM V1 Sampler.forward): min_tokens mask and logit_bias, then the
// repetition penalty (tokens of the prompt or the output), then the frequency
// and presence penalties (tokens of the output):
//   l = logit + bias                              (logit_bias, clamped to [-100, 100])
//   l = -inf                                      (min_tokens: EOS / stop ids not yet allowed)
//   l = l > 0 ? l / rp : l * rp                   (repetition_penalty rp, prompt or output token)
//   l = (l - frequency * count) - presence        (output token, count > 0 occurrences)
// then, for sampled rows, temperature, min_p (keep_min_p below), top-k, top-p.
// A row lists only the tokens with an entry; the others are unchanged.
// Framework-free: no CUDA runtime, usable from host and device code.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define NUCLEUS_HD __host__ __device__
#else
#define NUCLEUS_HD
#endif

namespace nucleus::kernels {

constexpr uint32_t kAdjustInPrompt = 1u;  // the token is in the prompt (repetition_penalty)
constexpr uint32_t kAdjustMasked = 2u;    // masked to -inf (min_tokens)

// One token's entry in a row's sparse adjustment list (16 bytes). Ids are
// distinct within a row.
struct TokenAdjustment {
  int32_t id;            // token id in [0, vocab)
  int32_t output_count;  // occurrences among the generated tokens (0: none)
  float bias;            // logit_bias for the id (0: none)
  uint32_t flags;        // kAdjustInPrompt | kAdjustMasked
};

// The row's penalties (vLLM's defaults: 1, 0, 0 leave logits unchanged).
struct PenaltyParams {
  float repetition;  // > 0
  float frequency;   // [-2, 2]
  float presence;    // [-2, 2]
};

// Each f32 operation rounded once, on both sides: nvcc would otherwise fuse
// `l - f * c` into an FMA and differ from the CPU in the last bit.
NUCLEUS_HD inline float adjust_logit(float l, const TokenAdjustment& a, const PenaltyParams& p) {
#ifdef __CUDA_ARCH__
  l = __fadd_rn(l, a.bias);
  if (a.flags & kAdjustMasked) l = -INFINITY;
  if (p.repetition != 1.0f && (a.output_count > 0 || (a.flags & kAdjustInPrompt)))
    l = l > 0.0f ? __fdiv_rn(l, p.repetition) : __fmul_rn(l, p.repetition);
  if (a.output_count > 0) {
    l = __fsub_rn(l, __fmul_rn(p.frequency, static_cast<float>(a.output_count)));
    l = __fsub_rn(l, p.presence);
  }
#else
  l = l + a.bias;
  if (a.flags & kAdjustMasked) l = -INFINITY;
  if (p.repetition != 1.0f && (a.output_count > 0 || (a.flags & kAdjustInPrompt)))
    l = l > 0.0f ? l / p.repetition : l * p.repetition;
  if (a.output_count > 0) {
    const float f = p.frequency * static_cast<float>(a.output_count);
    l = l - f;
    l = l - p.presence;
  }
#endif
  return l;
}

// min_p (vLLM's MinPLogitsProcessor, after temperature T): a token stays when
// p / p_max >= min_p, i.e. exp(l / T - l_max / T) >= min_p, computed in f64
// as the sampler's probabilities are (cmax = l_max / T, inv_t = 1 / T).
NUCLEUS_HD inline bool keep_min_p(float l, double inv_t, double cmax, float min_p) {
  return exp(static_cast<double>(l) * inv_t - cmax) >= static_cast<double>(min_p);
}

}  // namespace nucleus::kernels
