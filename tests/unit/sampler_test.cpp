// Sampling semantics: greedy, seeds, top-k, top-p, the sampled distribution
// against softmax; vLLM's logit processors (repetition / frequency / presence
// penalties, logit_bias, min_tokens, min_p) against hand-computed values,
// their order, and raw logprobs under them.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <unordered_map>
#include <vector>

#include "runtime/sampler.h"
#include "runtime/sequence.h"

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


// ---- vLLM's logit processors ----

constexpr float kInf = std::numeric_limits<float>::infinity();

struct History {
  std::vector<int32_t> prompt;
  std::unordered_map<int32_t, int32_t> counts;
  std::vector<int32_t> eos;
  SampleHistory view() const { return {prompt, &counts, eos}; }
};

std::vector<TokenAdjustment> build(const SamplingParams& p, const History& h, int64_t output_index,
                                   int64_t vocab = 5) {
  TokenAdjustmentBuilder b(vocab);
  std::vector<TokenAdjustment> out;
  b.build(p, h.view(), output_index, &out);
  return out;
}

std::vector<float> adjusted(const SamplingParams& p, const History& h, int64_t output_index = 0) {
  const auto adj = build(p, h, output_index);
  return adjusted_logits(kLogits.data(), 5, p, adj);
}

SampleResult sample_with(const SamplingParams& p, const History& h, uint64_t seed, int64_t output_index,
                         const std::vector<float>& logits = kLogits) {
  const auto adj = build(p, h, output_index, static_cast<int64_t>(logits.size()));
  return sample_token(logits.data(), static_cast<int64_t>(logits.size()), p, seed, output_index, adj);
}

TEST(LogitProcessorTest, RepetitionPenaltyDividesPositiveMultipliesNegative) {
  SamplingParams p = params(0);
  p.repetition_penalty = 2.0f;
  History h;
  h.prompt = {1, 1, 3};   // 3.0 -> 1.5; repeats count once
  h.counts = {{0, 4}};    // output tokens too: 1.0 -> 0.5
  std::vector<float> l = adjusted(p, h);
  EXPECT_EQ(l, (std::vector<float>{0.5f, 1.5f, 2.0f, 0.25f, 2.5f}));
  // Negative logits are multiplied; untouched ids stay.
  const std::vector<float> neg = {-1.0f, 0.0f, -0.5f};
  const std::vector<TokenAdjustment> adj = build(p, History{{0, 1, 2}, {}, {}}, 0, 3);
  EXPECT_EQ(adjusted_logits(neg.data(), 3, p, adj), (std::vector<float>{-2.0f, 0.0f, -1.0f}));
  // Greedy: without the penalty token 1 (3.0); with it token 4 (2.5).
  EXPECT_EQ(sample_with(params(0), h, 0, 0).token, 1);
  EXPECT_EQ(sample_with(p, h, 0, 0).token, 4);
  // Below 1 it rewards repeats: 0.5 makes token 3 (0.5 -> 1.0) beat nothing, token 0 (1.0 -> 2.0).
  p.repetition_penalty = 0.5f;
  EXPECT_EQ(adjusted(p, h), (std::vector<float>{2.0f, 6.0f, 2.0f, 1.0f, 2.5f}));
}

TEST(LogitProcessorTest, FrequencyAndPresenceCountOutputTokensOnly) {
  SamplingParams p = params(0);
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  History h;
  h.prompt = {4};                  // prompt tokens are not penalized by these two
  h.counts = {{1, 2}, {2, 1}};     // 3 - 0.5*2 - 0.25 = 1.75; 2 - 0.5 - 0.25 = 1.25
  EXPECT_EQ(adjusted(p, h), (std::vector<float>{1.0f, 1.75f, 1.25f, 0.5f, 2.5f}));
  EXPECT_EQ(sample_with(p, h, 0, 0).token, 4);
  // Negative values reward repeats: -2 * 2 occurrences: 3 + 4 = 7.
  p.frequency_penalty = -2.0f;
  p.presence_penalty = 0.0f;
  EXPECT_EQ(adjusted(p, h)[1], 7.0f);
  // No penalty set: the output counts add no entries.
  EXPECT_TRUE(build(params(0), h, 3).empty());
}

TEST(LogitProcessorTest, LogitBiasAddsAndForces) {
  SamplingParams p = params(0);
  p.logit_bias = {{3, 100.0f}, {1, -100.0f}};
  EXPECT_EQ(adjusted(p, History{}), (std::vector<float>{1.0f, -97.0f, 2.0f, 100.5f, 2.5f}));
  EXPECT_EQ(sample_with(p, History{}, 0, 0).token, 3);
  // Sampled rows too: +100 leaves the others e^-98 of the mass.
  SamplingParams t = p;
  t.temperature = 1.0f;
  for (int i = 0; i < 200; ++i) EXPECT_EQ(sample_with(t, History{}, 5, i).token, 3);
  // Bias -100 on the argmax: greedy takes the next one.
  p.logit_bias = {{1, -100.0f}};
  EXPECT_EQ(sample_with(p, History{}, 0, 0).token, 4);
}

TEST(LogitProcessorTest, MinTokensMasksEosAndStopIdsUntilReached) {
  SamplingParams p = params(0);
  p.min_tokens = 2;
  p.stop_token_ids = {4};
  History h;
  h.eos = {1};
  EXPECT_EQ(adjusted(p, h, 0), (std::vector<float>{1.0f, -kInf, 2.0f, 0.5f, -kInf}));
  EXPECT_EQ(sample_with(p, h, 0, 0).token, 2);
  EXPECT_EQ(sample_with(p, h, 0, 1).token, 2);
  EXPECT_EQ(sample_with(p, h, 0, 2).token, 1);  // reached: EOS allowed again
  EXPECT_TRUE(build(p, h, 2).empty());
  // Sampled: never EOS or a stop id before min_tokens.
  p.temperature = 1.0f;
  for (int i = 0; i < 500; ++i) {
    const int32_t t = sample_with(p, h, 11, i % 2).token;
    EXPECT_TRUE(t != 1 && t != 4) << t;
  }
}

TEST(LogitProcessorTest, MinPAfterTemperature) {
  // T = 1: p / p_max = exp(l - 3): ids 0 .135, 2 .368, 3 .082, 4 .607 -> min_p 0.5 keeps {1, 4}.
  SamplingParams p = params(1.0f);
  p.min_p = 0.5f;
  EXPECT_EQ(adjusted(p, History{}), (std::vector<float>{-kInf, 3.0f, -kInf, -kInf, 2.5f}));
  std::map<int, int> seen;
  for (int i = 0; i < 2000; ++i) ++seen[sample_with(p, History{}, 3, i).token];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(1) && seen.count(4));
  // T = 2: exp((l - 3) / 2): id 2 .607 stays, id 0 .368 goes -> {1, 2, 4}.
  p.temperature = 2.0f;
  EXPECT_EQ(adjusted(p, History{}), (std::vector<float>{-kInf, 3.0f, 2.0f, -kInf, 2.5f}));
  // min_p 1: only the maximum; greedy rows ignore min_p.
  p.min_p = 1.0f;
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_with(p, History{}, 3, i).token, 1);
  SamplingParams g = params(0);
  g.min_p = 0.9f;
  EXPECT_EQ(adjusted(g, History{}), kLogits);
}

TEST(LogitProcessorTest, OrderIsBiasThenRepetitionThenFrequencyPresence) {
  SamplingParams p = params(0);
  p.logit_bias = {{0, 2.0f}, {3, -1.0f}};
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  History h;
  h.prompt = {3};
  h.counts = {{0, 1}};
  // id 0: (1 + 2) / 2 = 1.5 (not 1 / 2 + 2 = 2.5), then - 0.5 - 0.25 = 0.75.
  // id 3: 0.5 - 1 = -0.5, * 2 = -1.0 (in the prompt: no frequency/presence).
  EXPECT_EQ(adjusted(p, h), (std::vector<float>{0.75f, 3.0f, 2.0f, -1.0f, 2.5f}));
  // min_p then works on the adjusted row: T = 1, min_p 0.5 against max 3.0.
  SamplingParams s = p;
  s.temperature = 1.0f;
  s.min_p = 0.5f;
  EXPECT_EQ(adjusted(s, h), (std::vector<float>{-kInf, 3.0f, -kInf, -kInf, 2.5f}));
  // A masked id stays masked whatever the penalties and bias.
  p.min_tokens = 1;
  h.eos = {0};
  EXPECT_EQ(adjusted(p, h)[0], -kInf);
}

TEST(LogitProcessorTest, LogprobsStayRaw) {
  SamplingParams p = params(0);
  p.logprobs = 2;
  p.logit_bias = {{3, 100.0f}};
  p.repetition_penalty = 3.0f;
  History h;
  h.prompt = {1};
  const SampleResult r = sample_with(p, h, 0, 0);
  double z = 0;
  for (float l : kLogits) z += std::exp(l);
  EXPECT_EQ(r.token, 3);
  EXPECT_NEAR(r.logprob, 0.5 - std::log(z), 1e-5);
  ASSERT_EQ(r.top_logprobs.size(), 2u);
  EXPECT_EQ(r.top_logprobs[0].first, 1);  // the raw ranking
  EXPECT_NEAR(r.top_logprobs[0].second, 3.0 - std::log(z), 1e-5);
  EXPECT_EQ(r.top_logprobs[1].first, 4);
}

TEST(LogitProcessorTest, BuilderMergesIdsAndSkipsOutOfVocab) {
  SamplingParams p = params(0);
  p.repetition_penalty = 1.5f;
  p.presence_penalty = 1.0f;
  p.logit_bias = {{2, 5.0f}, {7, 1.0f}};  // 7 is past the vocabulary of 5: skipped
  p.min_tokens = 3;
  p.stop_token_ids = {2, 9};
  History h;
  h.prompt = {2, 2, 0};
  h.counts = {{2, 3}};
  h.eos = {1};
  const auto adj = build(p, h, 1);
  ASSERT_EQ(adj.size(), 3u);  // ids 2, 0, 1
  std::map<int32_t, TokenAdjustment> by_id;
  for (const auto& a : adj) EXPECT_TRUE(by_id.emplace(a.id, a).second) << "id " << a.id << " twice";
  EXPECT_EQ(by_id.at(2).output_count, 3);
  EXPECT_EQ(by_id.at(2).bias, 5.0f);
  EXPECT_EQ(by_id.at(2).flags, kernels::kAdjustInPrompt | kernels::kAdjustMasked);
  EXPECT_EQ(by_id.at(0).flags, kernels::kAdjustInPrompt);
  EXPECT_EQ(by_id.at(1).flags, kernels::kAdjustMasked);
  // The scratch is reset: a second build of other params starts clean.
  EXPECT_TRUE(build(params(0), h, 0).empty());
  TokenAdjustmentBuilder b(5);
  std::vector<TokenAdjustment> out;
  b.build(p, h.view(), 1, &out);
  b.build(p, h.view(), 1, &out);  // appended, not merged with the first row's
  EXPECT_EQ(out.size(), 6u);
}

TEST(LogitProcessorTest, EveryIdMaskedGivesTokenZero) {
  const std::vector<float> two = {1.0f, 2.0f};
  SamplingParams p = params(1.0f);
  p.min_tokens = 1;
  p.stop_token_ids = {0};
  History h;
  h.eos = {1};
  EXPECT_EQ(sample_with(p, h, 1, 0, two).token, 0);
  p.temperature = 0.0f;
  EXPECT_EQ(sample_with(p, h, 1, 0, two).token, 0);
}

TEST(LogitProcessorTest, SequenceCountsOutputTokensIncrementally) {
  Sequence s;
  s.prompt_token_ids = {5, 6};
  for (int32_t t : {3, 4, 3, 3}) {
    SampleResult r;
    r.token = t;
    s.append_output(r);
  }
  EXPECT_EQ(s.output_token_ids, (std::vector<int32_t>{3, 4, 3, 3}));
  EXPECT_EQ(s.output_samples.size(), 4u);
  EXPECT_EQ(s.output_token_counts.at(3), 3);
  EXPECT_EQ(s.output_token_counts.at(4), 1);
  const std::vector<int32_t> eos = {1};
  const SampleHistory h = s.sample_history(eos);
  EXPECT_EQ(h.prompt_ids.size(), 2u);
  EXPECT_EQ(h.output_counts, &s.output_token_counts);
  EXPECT_EQ(h.eos_ids.size(), 1u);
}

TEST(SamplerTest, NewParamsValidationNamesTheField) {
  auto message = [](auto set) {
    SamplingParams s;
    set(s);
    return s.validate().message();
  };
  EXPECT_NE(message([](SamplingParams& s) { s.presence_penalty = 2.5f; }).find("presence_penalty"), std::string::npos);
  EXPECT_NE(message([](SamplingParams& s) { s.frequency_penalty = -2.5f; }).find("frequency_penalty"),
            std::string::npos);
  EXPECT_NE(message([](SamplingParams& s) { s.repetition_penalty = 0.0f; }).find("repetition_penalty"),
            std::string::npos);
  EXPECT_NE(message([](SamplingParams& s) { s.min_p = 1.5f; }).find("min_p"), std::string::npos);
  EXPECT_NE(message([](SamplingParams& s) { s.min_tokens = -1; }).find("min_tokens"), std::string::npos);
  EXPECT_NE(message([](SamplingParams& s) { s.min_tokens = 17; }).find("min_tokens"), std::string::npos);
  EXPECT_NE(message([](SamplingParams& s) { s.logit_bias = {{3, 101.0f}}; }).find("logit_bias"), std::string::npos);
  EXPECT_NE(message([](SamplingParams& s) { s.logit_bias = {{3, 1.0f}, {3, 2.0f}}; }).find("logit_bias"),
            std::string::npos);
  EXPECT_NE(message([](SamplingParams& s) { s.logit_bias = {{-1, 1.0f}}; }).find("logit_bias"), std::string::npos);
  SamplingParams ok;
  ok.presence_penalty = -2.0f;
  ok.frequency_penalty = 2.0f;
  ok.repetition_penalty = 1e-3f;
  ok.min_p = 1.0f;
  ok.min_tokens = 16;
  ok.logit_bias = {{0, -100.0f}, {1, 100.0f}};
  EXPECT_TRUE(ok.validate().ok()) << ok.validate().to_string();
}

}  // namespace
}  // namespace nucleus
