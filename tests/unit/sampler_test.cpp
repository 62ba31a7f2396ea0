// Sampling semantics: greedy, seeds, top-k, top-p, and the sampled
// distribution against softmax.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "runtime/sampler.h"

namespace nucleus {
namespace {

const std::vector<float> kLogits = {1.0f, 3.0f, 2.0f, 0.5f, 2.5f};

SamplingParams params(float t, int k = 0, float p = 1.0f) {
  SamplingParams s;
  s.temperature = t;
  s.top_k = k;
  s.top_p = p;
  return s;
}

TEST(SamplerTest, GreedyIsArgmaxWithLowestIdOnTies) {
  EXPECT_EQ(sample_token(kLogits.data(), 5, params(0), 0, 0).token, 1);
  std::vector<float> tie = {1.0f, 4.0f, 4.0f};
  EXPECT_EQ(sample_token(tie.data(), 3, params(0), 0, 0).token, 1);
}

TEST(SamplerTest, SameSeedSameDraws) {
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(sample_token(kLogits.data(), 5, params(1.0f), 1234, i).token,
              sample_token(kLogits.data(), 5, params(1.0f), 1234, i).token);
  }
  int differ = 0;
  for (int i = 0; i < 50; ++i)
    differ += sample_token(kLogits.data(), 5, params(1.0f), 1, i).token !=
              sample_token(kLogits.data(), 5, params(1.0f), 2, i).token;
  EXPECT_GT(differ, 5);
}

TEST(SamplerTest, DistributionMatchesSoftmax) {
  const int n = 20000;
  std::vector<int> count(5, 0);
  for (int i = 0; i < n; ++i) ++count[sample_token(kLogits.data(), 5, params(1.0f), 7, i).token];
  double z = 0;
  for (float l : kLogits) z += std::exp(l);
  for (int i = 0; i < 5; ++i) {
    double p = std::exp(kLogits[i]) / z;
    double sd = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(count[i] / static_cast<double>(n), p, 5 * sd) << "token " << i;
  }
}

TEST(SamplerTest, TopKRestrictsSupport) {
  for (int i = 0; i < 500; ++i) {
    int t = sample_token(kLogits.data(), 5, params(2.0f, 2), 3, i).token;
    EXPECT_TRUE(t == 1 || t == 4) << t;  // the two largest logits
  }
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_token(kLogits.data(), 5, params(5.0f, 1), 3, i).token, 1);
}

TEST(SamplerTest, TopPRestrictsSupport) {
  // softmax probs (T=1): ids by mass 1 (0.46), 4 (0.28), 2 (0.17), 0, 3.
  // top_p 0.7: {1, 4} reach 0.74 >= 0.7.
  std::map<int, int> seen;
  for (int i = 0; i < 2000; ++i) ++seen[sample_token(kLogits.data(), 5, params(1.0f, 0, 0.7f), 9, i).token];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(1) && seen.count(4));
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_token(kLogits.data(), 5, params(1.0f, 0, 0.01f), 9, i).token, 1);
}

TEST(SamplerTest, LogprobsAreOfTheRawDistribution) {
  SamplingParams s = params(0);
  s.logprobs = 2;
  SampleResult r = sample_token(kLogits.data(), 5, s, 0, 0);
  double z = 0;
  for (float l : kLogits) z += std::exp(l);
  EXPECT_NEAR(r.logprob, 3.0 - std::log(z), 1e-5);
  ASSERT_EQ(r.top_logprobs.size(), 2u);
  EXPECT_EQ(r.top_logprobs[0].first, 1);
  EXPECT_EQ(r.top_logprobs[1].first, 4);
  EXPECT_NEAR(r.top_logprobs[1].second, 2.5 - std::log(z), 1e-5);
}

TEST(SamplerTest, ParamsValidationNamesTheField) {
  SamplingParams s;
  s.temperature = -1;
  EXPECT_NE(s.validate().message().find("temperature"), std::string::npos);
  s = SamplingParams();
  s.top_p = 0;
  EXPECT_NE(s.validate().message().find("top_p"), std::string::npos);
  s = SamplingParams();
  s.max_tokens = 0;
  EXPECT_NE(s.validate().message().find("max_tokens"), std::string::npos);
  EXPECT_TRUE(SamplingParams().validate().ok());
}

}  // namespace
}  // namespace nucleus
