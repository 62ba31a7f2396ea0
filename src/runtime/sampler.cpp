#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/check.h"

namespace nucleus {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

double counter_uniform(uint64_t seed, uint64_t counter) {
  uint64_t bits = splitmix64(seed ^ splitmix64(counter));
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);  // 53 bits
}

void TokenAdjustmentBuilder::build(const SamplingParams& params, const SampleHistory& history,
                                   int64_t output_index, std::vector<TokenAdjustment>* out) {
  const int64_t vocab = static_cast<int64_t>(slot_.size());
  const size_t first = out->size();
  auto entry = [&](int32_t id) -> TokenAdjustment* {
    if (id < 0 || id >= vocab) return nullptr;
    int32_t& s = slot_[id];
    if (s == 0) {
      out->push_back({id, 0, 0.0f, 0u});
      s = static_cast<int32_t>(out->size() - first);
    }
    return &(*out)[first + s - 1];
  };
  const bool penalized = params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f ||
                         params.repetition_penalty != 1.0f;
  if (penalized && history.output_counts)
    for (const auto& [id, count] : *history.output_counts)
      if (auto* e = entry(id)) e->output_count = count;
  if (params.repetition_penalty != 1.0f)
    for (int32_t id : history.prompt_ids)
      if (auto* e = entry(id)) e->flags |= kernels::kAdjustInPrompt;
  for (const auto& [id, bias] : params.logit_bias)
    if (auto* e = entry(id)) e->bias = bias;
  if (output_index < params.min_tokens) {
    for (int32_t id : history.eos_ids)
      if (auto* e = entry(id)) e->flags |= kernels::kAdjustMasked;
    for (int32_t id : params.stop_token_ids)
      if (auto* e = entry(id)) e->flags |= kernels::kAdjustMasked;
  }
  for (size_t i = first; i < out->size(); ++i) slot_[(*out)[i].id] = 0;
}

std::vector<float> adjusted_logits(const float* logits, int64_t vocab, const SamplingParams& params,
                                   std::span<const TokenAdjustment> adjustments) {
  std::vector<float> row(logits, logits + vocab);
  const kernels::PenaltyParams pen{params.repetition_penalty, params.frequency_penalty, params.presence_penalty};
  for (const TokenAdjustment& a : adjustments) row[a.id] = kernels::adjust_logit(logits[a.id], a, pen);
  if (params.min_p > 0.0f && params.temperature != 0.0f) {
    const float mx = *std::max_element(row.begin(), row.end());
    if (mx != -std::numeric_limits<float>::infinity()) {
      const double inv_t = 1.0 / params.temperature;
      for (float& l : row)
        if (!kernels::keep_min_p(l, mx, inv_t, params.min_p)) l = -std::numeric_limits<float>::infinity();
    }
  }
  return row;
}

SampleResult sample_token(const float* raw, int64_t vocab, const SamplingParams& params, uint64_t seed,
                          int64_t output_index, std::span<const TokenAdjustment> adjustments) {
  SampleResult r;
  // Logprobs come from the raw row; the draw from the adjusted one.
  std::vector<float> adjusted;
  const float* logits = raw;
  if (!adjustments.empty() || (params.min_p > 0.0f && params.temperature != 0.0f)) {
    adjusted = adjusted_logits(raw, vocab, params, adjustments);
    logits = adjusted.data();
  }
  // Raw log-softmax, for the token's logprob (computed in f32 exps with an
  // f64 sum: the full-vocabulary pass that dominates greedy sampling).
  const float mx = *std::max_element(raw, raw + vocab);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(raw[i] - mx);
  const double log_z = mx + std::log(sum);
  auto logprob = [&](int64_t i) { return static_cast<float>(raw[i] - log_z); };

  const bool none_left = logits != raw && *std::max_element(logits, logits + vocab) ==
                                              -std::numeric_limits<float>::infinity();
  if (params.temperature == 0.0f || none_left) {
    r.token = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);  // first max
  } else {
    std::vector<int32_t> cand(vocab);
    std::iota(cand.begin(), cand.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    if (params.top_k > 0 && params.top_k < vocab) {
      std::partial_sort(cand.begin(), cand.begin() + params.top_k, cand.end(), by_logit);
      cand.resize(params.top_k);
    } else {
      std::sort(cand.begin(), cand.end(), by_logit);
    }
    const double inv_t = 1.0 / params.temperature;
    const double cmax = logits[cand[0]] * inv_t;
    std::vector<double> p(cand.size());
    double total = 0.0;
    for (size_t i = 0; i < cand.size(); ++i) {
      p[i] = std::exp(logits[cand[i]] * inv_t - cmax);
      total += p[i];
    }
    // Top-p over the candidates in decreasing-probability order.
    size_t keep = cand.size();
    if (params.top_p < 1.0f) {
      double cum = 0.0;
      for (size_t i = 0; i < cand.size(); ++i) {
        cum += p[i] / total;
        if (cum >= params.top_p) {
          keep = i + 1;
          break;
        }
      }
    }
    double kept_total = 0.0;
    for (size_t i = 0; i < keep; ++i) kept_total += p[i];
    const double u = counter_uniform(seed, static_cast<uint64_t>(output_index)) * kept_total;
    double cum = 0.0;
    r.token = cand[0];  // u * kept_total rounding up to kept_total: the last candidate with mass
    for (size_t i = 0; i < keep; ++i)
      if (p[i] > 0.0) r.token = cand[i];
    for (size_t i = 0; i < keep; ++i) {
      cum += p[i];
      if (u < cum) {
        r.token = cand[i];
        break;
      }
    }
  }
  r.logprob = logprob(r.token);
  if (params.logprobs > 0) {
    const int64_t n = std::min<int64_t>(params.logprobs, vocab);
    std::vector<int32_t> idx(vocab);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int32_t a, int32_t b) {
      return raw[a] > raw[b] || (raw[a] == raw[b] && a < b);
    });
    for (int64_t i = 0; i < n; ++i) r.top_logprobs.emplace_back(idx[i], logprob(idx[i]));
  }
  return r;
}

}  // namespace nucleus
