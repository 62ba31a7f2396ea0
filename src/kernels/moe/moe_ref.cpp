#include "kernels/moe/moe_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/parallel.h"
#include "kernels/activation/silu_mul_ref.h"
#include "kernels/gemm/gemm_ref.h"

namespace nucleus::kernels {

namespace {
// Indices of the k largest values, by decreasing value, ties to lower index.
std::vector<int64_t> top_indices(const std::vector<float>& v, int64_t k) {
  std::vector<int64_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
  idx.resize(k);
  return idx;
}
}  // namespace

void moe_route_ref(const MoeRoutingParams& p, const float* logits, const float* bias, int64_t num_tokens,
                   int32_t* topk_ids, float* topk_weights) {
  const int64_t E = p.num_experts;
  NUCLEUS_CHECK(E % p.n_group == 0 && p.topk_group <= p.n_group && p.top_k <= E, "bad routing params");
  const int64_t group_size = E / p.n_group;
  std::vector<float> scores(E), choice(E), group_score(p.n_group);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* l = logits + t * E;
    if (p.scoring == ScoringFunc::kSigmoid) {
      for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-l[e]));
    } else {
      float mx = *std::max_element(l, l + E);
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        scores[e] = std::exp(l[e] - mx);
        sum += scores[e];
      }
      for (int64_t e = 0; e < E; ++e) scores[e] = static_cast<float>(scores[e] / sum);
    }
    for (int64_t e = 0; e < E; ++e) choice[e] = bias ? scores[e] + bias[e] : scores[e];
    if (p.method != TopkMethod::kGreedy && p.n_group > 1) {
      for (int64_t g = 0; g < p.n_group; ++g) {
        std::vector<float> members(choice.begin() + g * group_size, choice.begin() + (g + 1) * group_size);
        if (p.method == TopkMethod::kNoauxTc) {
          auto top = top_indices(members, std::min<int64_t>(2, group_size));
          float s = 0.0f;
          for (int64_t i : top) s += members[i];
          group_score[g] = s;
        } else {
          group_score[g] = *std::max_element(members.begin(), members.end());
        }
      }
      auto kept = top_indices(group_score, p.topk_group);
      std::vector<bool> keep(p.n_group, false);
      for (int64_t g : kept) keep[g] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / group_size]) choice[e] = -std::numeric_limits<float>::infinity();
    }
    auto chosen = top_indices(choice, p.top_k);
    int32_t* ids = topk_ids + t * p.slots();
    float* w = topk_weights + t * p.slots();
    float sum = 0.0f;
    for (int64_t k = 0; k < p.top_k; ++k) {
      ids[k] = static_cast<int32_t>(chosen[k]);
      w[k] = scores[chosen[k]];
      sum += w[k];
    }
    if (p.method == TopkMethod::kNoauxTc) {
      if (p.norm_topk_prob)
        for (int64_t k = 0; k < p.top_k; ++k) w[k] /= (sum + 1e-20f);
      for (int64_t k = 0; k < p.top_k; ++k) w[k] *= p.routed_scaling_factor;
    } else if (p.top_k > 1 && p.norm_topk_prob) {
      for (int64_t k = 0; k < p.top_k; ++k) w[k] /= (sum + 1e-20f);
    } else {
      for (int64_t k = 0; k < p.top_k; ++k) w[k] *= p.routed_scaling_factor;
    }
    for (int64_t s = 0; s < p.shared_slots; ++s) {
      ids[p.top_k + s] = static_cast<int32_t>(E + s);
      w[p.top_k + s] = 1.0f;
    }
  }
}

void moe_experts_ref(const float* x, int64_t num_tokens, int64_t hidden, int64_t inter, const int32_t* topk_ids,
                     const float* topk_weights, int64_t top_k, const ExpertWeightsRef* experts, float* out,
                     bool accumulate) {
  parallel_for(num_tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate_up(2 * inter), act(inter), y(hidden);
    std::vector<int64_t> order(top_k);
    for (int64_t t = begin; t < end; ++t) {
      const float* xt = x + t * hidden;
      float* o = out + t * hidden;
      if (!accumulate) std::fill(o, o + hidden, 0.0f);
      const int32_t* ids = topk_ids + t * top_k;
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      for (int64_t k : order) {
        const ExpertWeightsRef& e = experts[ids[k]];
        gemm_ref(xt, hidden, e.gate_up, 1, 2 * inter, hidden, gate_up.data(), 2 * inter, false);
        silu_mul_ref(gate_up.data(), 1, inter, act.data());
        gemm_ref(act.data(), inter, e.down, 1, hidden, inter, y.data(), hidden, false);
        const float w = topk_weights[t * top_k + k];
        for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[c];
      }
    }
  });
}

}  // namespace nucleus::kernels
