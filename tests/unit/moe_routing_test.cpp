// MoE routing against hand-computed values (kernels/moe/moe_ref.h).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/moe/moe_ref.h"

namespace nucleus::kernels {
namespace {

float logit(float p) { return std::log(p / (1.0f - p)); }

MoeRoutingParams v3_params() {
  MoeRoutingParams p;
  p.scoring = ScoringFunc::kSigmoid;
  p.method = TopkMethod::kNoauxTc;
  p.num_experts = 8;
  p.top_k = 2;
  p.n_group = 4;  // groups {0,1} {2,3} {4,5} {6,7}
  p.topk_group = 2;
  p.norm_topk_prob = true;
  p.routed_scaling_factor = 2.5f;
  return p;
}

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed route(const MoeRoutingParams& p, const std::vector<float>& logits, const std::vector<float>* bias) {
  Routed r;
  r.ids.resize(p.slots());
  r.weights.resize(p.slots());
  moe_route_ref(p, logits.data(), bias ? bias->data() : nullptr, 1, r.ids.data(), r.weights.data());
  return r;
}

// Sigmoid scores per expert; group sums (top-2 of 2): g0 1.2, g1 1.1, g2 0.2, g3 0.95.
// Expert 6 has the single best score but its group is not kept.
const std::vector<float> kScores = {0.6f, 0.6f, 0.55f, 0.55f, 0.1f, 0.1f, 0.9f, 0.05f};

std::vector<float> logits_of(const std::vector<float>& s) {
  std::vector<float> l;
  for (float p : s) l.push_back(logit(p));
  return l;
}

TEST(MoeRoutingTest, GroupLimitExcludesTheBestExpertOutsideKeptGroups) {
  std::vector<float> zero(8, 0.0f);
  Routed r = route(v3_params(), logits_of(kScores), &zero);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));  // not expert 6
  // Weights: 0.6 / (0.6 + 0.6) * 2.5 = 1.25 each.
  EXPECT_NEAR(r.weights[0], 1.25f, 1e-5);
  EXPECT_NEAR(r.weights[1], 1.25f, 1e-5);
  // Without the group limit expert 6 would win.
  MoeRoutingParams all = v3_params();
  all.topk_group = 4;
  Routed u = route(all, logits_of(kScores), &zero);
  EXPECT_EQ(u.ids[0], 6);
}

TEST(MoeRoutingTest, AllChoiceScoresNegativeStillPickFromKeptGroups) {
  // choice = s - 1 < 0 for every expert; excluded experts must not win by
  // being filled with 0.
  std::vector<float> bias(8, -1.0f);
  Routed r = route(v3_params(), logits_of(kScores), &bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.weights[0], 1.25f, 1e-5);
}

// Shared slots (the shared experts run as routed ones): after the top_k
// chosen, ids num_experts, num_experts + 1 with weight 1, not normalised or
// scaled with the routed weights.
TEST(MoeRoutingTest, SharedSlotsFollowTheChosenExperts) {
  std::vector<float> zero(8, 0.0f);
  MoeRoutingParams p = v3_params();
  p.shared_slots = 2;
  EXPECT_EQ(p.slots(), 4);
  Routed r = route(p, logits_of(kScores), &zero);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 8, 9}));
  EXPECT_NEAR(r.weights[0], 1.25f, 1e-5);  // 0.6 / 1.2 * 2.5, as without the slots
  EXPECT_NEAR(r.weights[1], 1.25f, 1e-5);
  EXPECT_EQ(r.weights[2], 1.0f);
  EXPECT_EQ(r.weights[3], 1.0f);
}

TEST(MoeRoutingTest, WeightsComeFromPlainSigmoidNotBiasedScore) {
  // Bias lifts expert 3 above expert 1: choice g0 {0.6, 0.6}, g1 {0.55, 0.75}.
  std::vector<float> bias = {0, 0, 0, 0.2f, 0, 0, 0, 0};
  Routed r = route(v3_params(), logits_of(kScores), &bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 0}));
  // Plain sigmoid weights: 0.55 and 0.6, normalised, times 2.5.
  EXPECT_NEAR(r.weights[0], 0.55f / 1.15f * 2.5f, 1e-5);
  EXPECT_NEAR(r.weights[1], 0.6f / 1.15f * 2.5f, 1e-5);
}

TEST(MoeRoutingTest, RoutedScalingFactorAppliedOnce) {
  std::vector<float> zero(8, 0.0f);
  MoeRoutingParams p = v3_params();
  Routed r = route(p, logits_of(kScores), &zero);
  EXPECT_NEAR(r.weights[0] + r.weights[1], 2.5f, 1e-5);  // normalised sum 1, times 2.5 once
  p.norm_topk_prob = false;
  r = route(p, logits_of(kScores), &zero);
  EXPECT_NEAR(r.weights[0], 0.6f * 2.5f, 1e-5);
  EXPECT_NEAR(r.weights[1], 0.6f * 2.5f, 1e-5);
}

TEST(MoeRoutingTest, V2SoftmaxGreedy) {
  MoeRoutingParams p;
  p.scoring = ScoringFunc::kSoftmax;
  p.method = TopkMethod::kGreedy;
  p.num_experts = 4;
  p.top_k = 2;
  p.norm_topk_prob = false;
  p.routed_scaling_factor = 2.0f;
  // softmax([ln 1, ln 2, ln 3, ln 4]) = [0.1, 0.2, 0.3, 0.4]
  std::vector<float> l = {std::log(1.0f), std::log(2.0f), std::log(3.0f), std::log(4.0f)};
  Routed r = route(p, l, nullptr);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 2}));
  EXPECT_NEAR(r.weights[0], 0.4f * 2.0f, 1e-6);  // not normalised: times the factor
  EXPECT_NEAR(r.weights[1], 0.3f * 2.0f, 1e-6);
  p.norm_topk_prob = true;
  r = route(p, l, nullptr);
  EXPECT_NEAR(r.weights[0], 0.4f / 0.7f, 1e-6);  // normalised: the factor is not applied
  EXPECT_NEAR(r.weights[1], 0.3f / 0.7f, 1e-6);
}

TEST(MoeRoutingTest, V2GroupLimitedGreedyUsesGroupMax) {
  MoeRoutingParams p;
  p.scoring = ScoringFunc::kSoftmax;
  p.method = TopkMethod::kGroupLimitedGreedy;
  p.num_experts = 6;
  p.top_k = 2;
  p.n_group = 3;  // {0,1} {2,3} {4,5}
  p.topk_group = 1;
  p.routed_scaling_factor = 1.0f;
  // Probabilities 0.05 0.3 | 0.2 0.2 | 0.25 0.0 (ln of them): group max keeps group 0,
  // although group 1's sum (0.4) is higher.
  std::vector<float> probs = {0.05f, 0.3f, 0.2f, 0.2f, 0.25f, 1e-9f};
  std::vector<float> l;
  for (float q : probs) l.push_back(std::log(q));
  Routed r = route(p, l, nullptr);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0}));
  float z = 0;
  for (float q : probs) z += q;
  EXPECT_NEAR(r.weights[0], 0.3f / z, 1e-5);
}

}  // namespace
}  // namespace nucleus::kernels
