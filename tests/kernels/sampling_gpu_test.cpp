// DeviceSampler (kernels/sampling) against the CPU sampler (sample_token):
// the counter-based uniform bit for bit, greedy, seeded draws over
// temperature / top-k / top-p combinations (top_k 1, > vocab, top_p tiny,
// temperature 1e-3), ties and -inf masks, the empirical distribution,
// log-probabilities, mixed batches and edge shapes; vLLM's logit processors
// (repetition / frequency / presence penalties, logit_bias, min_tokens,
// min_p) each alone and mixed, greedy and sampled, with raw logprobs. A draw
// may differ from the CPU's only where u lies within 1e-5 of a CDF boundary
// (summation order).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "core/device.h"
#include "gpu_test_util.h"
#include "kernels/sampling/sampling.cuh"
#include "runtime/device_sampler.h"
#include "runtime/sampler.h"

namespace nucleus {
namespace {

using testing::device_copy;

class DeviceSamplerTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
};

// [n] normal(0, sd) values, all distinct.
std::vector<float> distinct_logits(int64_t n, float sd, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::set<float> seen;
  std::vector<float> v(n);
  for (auto& x : v) {
    float y = d(rng);
    while (!seen.insert(y).second) y = std::nextafter(y, 1e30f);
    x = y;
  }
  return v;
}

SamplingParams cpu_params(const DeviceSampleRequest& q) {
  SamplingParams sp;
  sp.temperature = q.temperature;
  sp.top_k = q.top_k;
  sp.top_p = q.top_p;
  sp.logprobs = q.num_logprobs;
  sp.min_p = q.min_p;
  sp.repetition_penalty = q.penalties.repetition;
  sp.frequency_penalty = q.penalties.frequency;
  sp.presence_penalty = q.penalties.presence;
  return sp;
}

// Distance from u to the nearest boundary the CPU's draw depends on: the
// normalised CDF of the kept candidates, and the top-p cut.
double boundary_distance(const float* raw, int64_t vocab, const DeviceSampleRequest& q) {
  const std::vector<float> adjusted = adjusted_logits(raw, vocab, cpu_params(q), q.adjustments);
  const float* l = adjusted.data();
  const double u = counter_uniform(q.seed, static_cast<uint64_t>(q.output_index));
  std::vector<int32_t> cand(vocab);
  std::iota(cand.begin(), cand.end(), 0);
  std::sort(cand.begin(), cand.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  if (q.top_k > 0 && q.top_k < vocab) cand.resize(q.top_k);
  const double inv_t = 1.0 / q.temperature, cmax = l[cand[0]] * inv_t;
  std::vector<double> p(cand.size());
  double total = 0;
  for (size_t i = 0; i < cand.size(); ++i) total += p[i] = std::exp(l[cand[i]] * inv_t - cmax);
  double dist = 1e30, cum = 0;
  size_t keep = cand.size();
  if (q.top_p < 1.0f) {
    for (size_t i = 0; i < cand.size(); ++i) {
      cum += p[i] / total;
      dist = std::min(dist, std::fabs(cum - q.top_p));
      if (cum >= q.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += p[i];
  cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += p[i];
    dist = std::min(dist, std::fabs(cum / kept - u));
  }
  return dist;
}

bool close_logprob(float got, float want) { return got == want || std::fabs(got - want) <= 1e-4f; }

struct Tally {
  int rows = 0, boundary = 0, failures = 0;
  std::string first_failure;
  void fail(const std::string& why) {
    if (failures++ == 0) first_failure = why;
  }
};

// Checks one row's device result against sample_token().
void check_row(const float* l, int64_t vocab, const DeviceSampleRequest& q, const SampleResult& got, int64_t row,
               Tally* t) {
  ++t->rows;
  const SampleResult want = sample_token(l, vocab, cpu_params(q), q.seed, q.output_index, q.adjustments);
  std::ostringstream where;
  where << "row " << row << " (vocab " << vocab << ", T " << q.temperature << ", top_k " << q.top_k << ", top_p "
        << q.top_p << ", seed " << q.seed << ", index " << q.output_index << ", min_p " << q.min_p << ", rep "
        << q.penalties.repetition << ", freq " << q.penalties.frequency << ", pres " << q.penalties.presence << ", "
        << q.adjustments.size() << " adjustments): ";
  if (got.token != want.token) {
    const double d = q.temperature == 0.0f ? 0.0 : boundary_distance(l, vocab, q);
    if (d < 1e-5) {
      ++t->boundary;
    } else {
      t->fail(where.str() + "token " + std::to_string(got.token) + ", CPU " + std::to_string(want.token) +
              " (u is " + std::to_string(d) + " from a boundary)");
      return;
    }
  } else if (!close_logprob(got.logprob, want.logprob)) {
    t->fail(where.str() + "logprob " + std::to_string(got.logprob) + ", CPU " + std::to_string(want.logprob));
    return;
  }
  if (got.top_logprobs.size() != want.top_logprobs.size()) {
    t->fail(where.str() + std::to_string(got.top_logprobs.size()) + " top logprobs, CPU " +
            std::to_string(want.top_logprobs.size()));
    return;
  }
  for (size_t j = 0; j < got.top_logprobs.size(); ++j) {
    if (got.top_logprobs[j].first != want.top_logprobs[j].first ||
        !close_logprob(got.top_logprobs[j].second, want.top_logprobs[j].second)) {
      t->fail(where.str() + "top logprob " + std::to_string(j) + ": (" + std::to_string(got.top_logprobs[j].first) +
              ", " + std::to_string(got.top_logprobs[j].second) + "), CPU (" +
              std::to_string(want.top_logprobs[j].first) + ", " + std::to_string(want.top_logprobs[j].second) + ")");
      return;
    }
  }
}

// Samples rows of `logits` ([rows, vocab] row-major) on the device and checks each against the CPU.
Tally run_and_check(const std::vector<float>& logits, int64_t vocab, const std::vector<DeviceSampleRequest>& reqs) {
  const int64_t rows = static_cast<int64_t>(reqs.size());
  auto sampler = DeviceSampler::create(rows, vocab);
  EXPECT_TRUE(sampler.ok()) << sampler.status().to_string();
  Tally t;
  if (!sampler.ok()) return t;
  Tensor d = device_copy(logits, DType::kF32);
  const std::vector<SampleResult> got = (*sampler)->sample(d.data<float>(), reqs);
  EXPECT_EQ(static_cast<int64_t>(got.size()), rows);
  for (int64_t r = 0; r < rows && r < static_cast<int64_t>(got.size()); ++r)
    check_row(logits.data() + r * vocab, vocab, reqs[r], got[r], r, &t);
  return t;
}

::testing::AssertionResult all_match(const Tally& t, const char* what) {
  std::printf("%s: %d rows compared, %d boundary draws differ, %d failures\n", what, t.rows, t.boundary,
              t.failures);
  if (t.failures) return ::testing::AssertionFailure() << t.failures << " failures; first: " << t.first_failure;
  if (t.boundary * 100 > t.rows) return ::testing::AssertionFailure() << t.boundary << " boundary draws of " << t.rows;
  return ::testing::AssertionSuccess();
}

std::vector<float> stack_rows(int64_t rows, int64_t vocab, uint64_t seed, float sd_a, float sd_b) {
  std::vector<float> all;
  all.reserve(rows * vocab);
  for (int64_t r = 0; r < rows; ++r) {
    const auto row = distinct_logits(vocab, r % 2 ? sd_b : sd_a, seed + r);
    all.insert(all.end(), row.begin(), row.end());
  }
  return all;
}

TEST_F(DeviceSamplerTest, CounterUniformIsBitExact) {
  std::mt19937_64 rng(3);
  std::vector<uint64_t> seeds, counters;
  for (uint64_t s : {0ull, 1ull, ~0ull, 0x9e3779b97f4a7c15ull})
    for (uint64_t c : {0ull, 1ull, 2ull, ~0ull}) seeds.push_back(s), counters.push_back(c);
  for (int i = 0; i < 4000; ++i) seeds.push_back(rng()), counters.push_back(rng() % 100000);
  Tensor ds = device_copy(seeds, DType::kI64), dc = device_copy(counters, DType::kI64);
  Tensor dout = Tensor::empty({static_cast<int64_t>(seeds.size())}, DType::kI64, Device::kCuda);  // f64 bits
  ASSERT_EQ(kernels::launch_counter_uniform(ds.data<uint64_t>(), dc.data<uint64_t>(), seeds.size(), dout.data<double>(),
                                            nullptr),
            cudaSuccess);
  const auto got = testing::host_copy<double>(dout);
  for (size_t i = 0; i < seeds.size(); ++i) {
    const double want = counter_uniform(seeds[i], counters[i]);
    ASSERT_EQ(std::memcmp(&got[i], &want, sizeof(double)), 0)
        << "seed " << seeds[i] << " counter " << counters[i] << ": " << got[i] << " vs " << want;
  }
}

TEST_F(DeviceSamplerTest, GreedyMatchesCpu) {
  for (int64_t vocab : {4096, 129280, 4093, 1, 7}) {
    const int64_t rows = vocab >= 100000 ? 16 : 64;
    auto logits = stack_rows(rows, vocab, 100 + vocab, 1.0f, 4.0f);
    if (vocab >= 4096) {  // repeated maxima: the lower id wins
      float* r0 = logits.data();
      r0[17] = r0[vocab - 1] = r0[5] = 100.0f;
      float* r1 = logits.data() + vocab;
      std::fill(r1, r1 + vocab, -3.0f);
    }
    std::vector<DeviceSampleRequest> reqs(rows);
    for (auto& q : reqs) q.temperature = 0.0f;
    EXPECT_TRUE(all_match(run_and_check(logits, vocab, reqs), "greedy")) << "vocab " << vocab;
  }
}

// Every combination of the listed temperatures, top_k and top_p, cycled over rows.
std::vector<DeviceSampleRequest> sampled_requests(int64_t rows, int64_t vocab, uint64_t seed) {
  const float temps[] = {1e-3f, 0.6f, 1.0f, 1.5f};
  const int32_t ks[] = {0, 1, 5, 50, 4096, 5000, static_cast<int32_t>(vocab) + 10};
  const float ps[] = {1.0f, 0.9f, 0.5f, 1e-6f, 0.99f};
  std::mt19937_64 rng(seed);
  std::vector<DeviceSampleRequest> reqs(rows);
  for (int64_t r = 0; r < rows; ++r) {
    auto& q = reqs[r];
    q.temperature = temps[r % 4];
    q.top_k = ks[(r / 4) % 7];
    q.top_p = ps[(r / 28) % 5];
    q.seed = rng();
    q.output_index = static_cast<int64_t>(rng() % 100000);
  }
  return reqs;
}

TEST_F(DeviceSamplerTest, SampledMatchesCpuSmallVocab) {
  for (int64_t vocab : {4096, 4093}) {
    const int64_t rows = 560;
    auto logits = stack_rows(rows, vocab, 7 * vocab, 1.0f, 4.0f);
    EXPECT_TRUE(all_match(run_and_check(logits, vocab, sampled_requests(rows, vocab, vocab)), "sampled"))
        << "vocab " << vocab;
  }
}

TEST_F(DeviceSamplerTest, SampledMatchesCpuLargeVocab) {
  const int64_t vocab = 129280, rows = 140;
  auto logits = stack_rows(rows, vocab, 11, 1.0f, 4.0f);
  EXPECT_TRUE(all_match(run_and_check(logits, vocab, sampled_requests(rows, vocab, 5)), "sampled, vocab 129280"));
}

TEST_F(DeviceSamplerTest, TiesAndMasksMatchCpu) {
  for (int64_t vocab : {129280, 5000}) {
    const int64_t rows = vocab > 100000 ? 56 : 280;
    auto logits = stack_rows(rows, vocab, 23, 2.0f, 2.0f);
    std::mt19937_64 rng(9);
    for (int64_t r = 0; r < rows; ++r) {
      float* l = logits.data() + r * vocab;
      switch (r % 3) {
        case 0:  // few distinct values: ties far larger than the candidate buffer
          for (int64_t i = 0; i < vocab; ++i) l[i] = 0.5f * std::round(l[i] * 0.5f);
          break;
        case 1:  // ties among neighbours
          for (int64_t i = 0; i < vocab; ++i) l[i] = std::round(l[i] * 8.0f) / 8.0f;
          break;
        default:  // two thirds masked to -inf
          for (int64_t i = 1; i < vocab; ++i)
            if (rng() % 3 != 0) l[i] = -INFINITY;
      }
    }
    auto reqs = sampled_requests(rows, vocab, 77);
    for (int64_t r = 0; r < rows; ++r) reqs[r].num_logprobs = static_cast<int32_t>(r % 21);
    EXPECT_TRUE(all_match(run_and_check(logits, vocab, reqs), "ties and masks")) << "vocab " << vocab;
  }
}

TEST_F(DeviceSamplerTest, LogprobsMatchCpu) {
  for (int64_t vocab : {4096, 129280}) {
    const int64_t rows = 48;
    auto logits = stack_rows(rows, vocab, 31, 1.0f, 3.0f);
    std::vector<DeviceSampleRequest> reqs(rows);
    const int32_t ns[] = {1, 5, 20};
    for (int64_t r = 0; r < rows; ++r) {
      reqs[r].temperature = r % 2 ? 0.0f : 0.8f;
      reqs[r].top_k = r % 4 == 0 ? 40 : 0;
      reqs[r].num_logprobs = ns[r % 3];
      reqs[r].seed = 1000 + r;
      reqs[r].output_index = r;
    }
    EXPECT_TRUE(all_match(run_and_check(logits, vocab, reqs), "logprobs")) << "vocab " << vocab;
  }
}

TEST_F(DeviceSamplerTest, MixedBatchMatchesCpu) {
  const int64_t vocab = 129280, rows = 64;
  auto logits = stack_rows(rows, vocab, 57, 2.0f, 5.0f);
  std::vector<DeviceSampleRequest> reqs(rows);
  for (int64_t r = 0; r < rows; ++r) {
    auto& q = reqs[r];
    switch (r % 4) {
      case 0: q.temperature = 0.0f; break;
      case 1: q.temperature = 0.7f, q.top_k = 50; break;
      case 2: q.temperature = 0.6f, q.top_p = 0.95f; break;
      default: q.temperature = 1.0f, q.top_k = 100, q.top_p = 0.9f;
    }
    q.num_logprobs = r % 5 == 0 ? 3 : 0;
    q.seed = 42 + r;
    q.output_index = 3 * r;
  }
  EXPECT_TRUE(all_match(run_and_check(logits, vocab, reqs), "mixed batch"));
}

// 20000 draws (one per output_index) of one small distribution: the
// frequencies match the renormalised softmax within 5 sigma.
TEST_F(DeviceSamplerTest, EmpiricalDistributionMatchesSoftmax) {
  const std::vector<float> base = {1.0f, 3.0f, 2.0f, 0.5f, 2.5f, -1.0f, 1.5f, 0.0f};
  const int64_t vocab = static_cast<int64_t>(base.size()), n = 20000;
  struct Case {
    float temperature;
    int32_t top_k;
    float top_p;
  };
  for (const Case c : {Case{1.0f, 0, 1.0f}, Case{0.7f, 3, 1.0f}, Case{1.3f, 0, 0.8f}}) {
    std::vector<float> logits;
    for (int64_t i = 0; i < n; ++i) logits.insert(logits.end(), base.begin(), base.end());
    std::vector<DeviceSampleRequest> reqs(n);
    for (int64_t i = 0; i < n; ++i) reqs[i] = {c.temperature, c.top_k, c.top_p, 12345, i, 0};
    auto sampler = DeviceSampler::create(n, vocab);
    ASSERT_TRUE(sampler.ok()) << sampler.status().to_string();
    Tensor d = device_copy(logits, DType::kF32);
    const auto got = (*sampler)->sample(d.data<float>(), reqs);
    std::vector<int> count(vocab, 0);
    for (const auto& r : got) {
      ASSERT_GE(r.token, 0);
      ASSERT_LT(r.token, vocab);
      ++count[r.token];
    }
    // Expected: softmax(l / T) over the kept set (top-k, then the top-p prefix).
    std::vector<int> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return base[a] > base[b]; });
    const int64_t k = c.top_k > 0 ? c.top_k : vocab;
    std::vector<double> p(vocab, 0.0);
    double z = 0;
    for (int64_t i = 0; i < k; ++i) z += p[order[i]] = std::exp(base[order[i]] / c.temperature);
    double cum = 0, kept = 0;
    for (int64_t i = 0; i < k; ++i) {
      if (cum >= c.top_p) p[order[i]] = 0;
      cum += p[order[i]] / z;
      kept += p[order[i]];
    }
    for (int64_t i = 0; i < vocab; ++i) {
      const double want = p[i] / kept, freq = count[i] / static_cast<double>(n);
      const double sd = std::sqrt(std::max(want * (1 - want), 1e-12) / n);
      EXPECT_NEAR(freq, want, 5 * sd + (want == 0 ? 0 : 1e-12))
          << "token " << i << " (T " << c.temperature << ", top_k " << c.top_k << ", top_p " << c.top_p << ")";
    }
  }
}

TEST_F(DeviceSamplerTest, EdgeShapesAndRefusals) {
  auto sampler = DeviceSampler::create(4, 16);
  ASSERT_TRUE(sampler.ok());
  EXPECT_TRUE((*sampler)->sample(nullptr, {}).empty());
  EXPECT_EQ(DeviceSampler::create(0, 16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DeviceSampler::create(4, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DeviceSampler::create(4, (int64_t{1} << 24) + 1).status().code(), StatusCode::kInvalidArgument);
  // vocab 1: every request returns token 0 with logprob 0.
  std::vector<float> one = {0.25f, -2.0f, 7.0f};
  std::vector<DeviceSampleRequest> reqs = {{0.0f, 0, 1.0f, 1, 0, 1}, {1.0f, 5, 0.5f, 2, 9, 3}, {0.5f, 0, 1.0f, 3, 1, 0}};
  EXPECT_TRUE(all_match(run_and_check(one, 1, reqs), "vocab 1"));
}


// ---- vLLM's logit processors: the adjusted row on the device vs the CPU ----

enum class Proc { kRepetition, kFrequency, kPresence, kBias, kMinTokens, kMinP, kAll };

const char* proc_name(Proc p) {
  switch (p) {
    case Proc::kRepetition: return "repetition_penalty";
    case Proc::kFrequency: return "frequency_penalty";
    case Proc::kPresence: return "presence_penalty";
    case Proc::kBias: return "logit_bias";
    case Proc::kMinTokens: return "min_tokens";
    case Proc::kMinP: return "min_p";
    default: return "all";
  }
}

// Requests over `rows` with the processor `proc` set (kAll: all of them, with
// values varying per row); every third row has none (a mixed batch). The
// adjustment lists live in *lists (one per row).
std::vector<DeviceSampleRequest> processor_requests(Proc proc, int64_t rows, int64_t vocab, const float* logits,
                                                    uint64_t seed, std::vector<std::vector<TokenAdjustment>>* lists) {
  std::mt19937_64 rng(seed);
  auto uni = [&](double lo, double hi) { return lo + (hi - lo) * (rng() >> 11) * (1.0 / 9007199254740992.0); };
  const auto base = sampled_requests(rows, vocab, seed);
  TokenAdjustmentBuilder builder(vocab);
  lists->assign(rows, {});
  std::vector<DeviceSampleRequest> reqs(rows);
  const std::vector<int32_t> eos = {1, 2};
  for (int64_t r = 0; r < rows; ++r) {
    SamplingParams sp;
    sp.temperature = r % 4 == 3 ? 0.0f : base[r].temperature;  // a quarter greedy
    sp.top_k = base[r].top_k;
    sp.top_p = base[r].top_p;
    sp.logprobs = static_cast<int32_t>(r % 4);
    // History: a prompt, and generated tokens drawn from the row's likely ones
    // (the top of the row) and from anywhere, with repeats.
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    const float* l = logits + r * vocab;
    const int64_t top = std::min<int64_t>(vocab, 64);
    std::partial_sort(order.begin(), order.begin() + top, order.end(),
                      [&](int32_t a, int32_t b) { return l[a] > l[b]; });
    std::vector<int32_t> prompt;
    std::unordered_map<int32_t, int32_t> counts;
    for (int i = 0; i < 40; ++i) prompt.push_back(i % 2 ? order[rng() % top] : static_cast<int32_t>(rng() % vocab));
    for (int i = 0; i < 30; ++i) ++counts[i % 3 ? order[rng() % top] : static_cast<int32_t>(rng() % vocab)];
    const bool none = r % 3 == 2;
    const bool all = proc == Proc::kAll;
    if (!none) {
      if (all || proc == Proc::kRepetition) sp.repetition_penalty = static_cast<float>(uni(0.3, 3.0));
      if (all || proc == Proc::kFrequency) sp.frequency_penalty = static_cast<float>(uni(-2.0, 2.0));
      if (all || proc == Proc::kPresence) sp.presence_penalty = static_cast<float>(uni(-2.0, 2.0));
      if (all || proc == Proc::kBias)
        for (int i = 0; i < 12; ++i) {
          const int32_t id = i % 2 ? order[rng() % top] : static_cast<int32_t>(rng() % vocab);
          bool dup = false;
          for (const auto& [k, v] : sp.logit_bias) dup = dup || k == id;
          if (!dup) sp.logit_bias.emplace_back(id, static_cast<float>(i == 0 ? 100.0 * (r % 2 ? 1 : -1) : uni(-5, 5)));
        }
      if (all || proc == Proc::kMinTokens) {
        sp.min_tokens = 5;
        sp.stop_token_ids = {order[0], order[1]};  // the two likeliest: the mask matters
      }
      if (all || proc == Proc::kMinP) sp.min_p = static_cast<float>(r % 2 ? uni(0.0, 0.3) : uni(0.3, 1.0));
    }
    const int64_t output_index = static_cast<int64_t>(rng() % 8);  // below and past min_tokens
    SampleHistory h{prompt, &counts, eos};
    builder.build(sp, h, output_index, &(*lists)[r]);
    reqs[r] = make_device_sample_request(sp, base[r].seed, output_index);
  }
  for (int64_t r = 0; r < rows; ++r) reqs[r].adjustments = (*lists)[r];
  return reqs;
}

TEST_F(DeviceSamplerTest, EachLogitProcessorMatchesCpu) {
  for (int64_t vocab : {129280, 4093}) {
    const int64_t rows = vocab > 100000 ? 84 : 280;
    auto logits = stack_rows(rows, vocab, 91 + vocab, 1.0f, 4.0f);
    for (Proc proc : {Proc::kRepetition, Proc::kFrequency, Proc::kPresence, Proc::kBias, Proc::kMinTokens,
                      Proc::kMinP, Proc::kAll}) {
      std::vector<std::vector<TokenAdjustment>> lists;
      auto reqs = processor_requests(proc, rows, vocab, logits.data(), 1000 + static_cast<int>(proc), &lists);
      EXPECT_TRUE(all_match(run_and_check(logits, vocab, reqs), proc_name(proc)))
          << proc_name(proc) << ", vocab " << vocab;
    }
  }
}

// logit_bias +100 forces its token on every row, greedy or sampled, whatever
// the rest; the reported logprob is the raw row's.
TEST_F(DeviceSamplerTest, LogitBiasForcesTheToken) {
  const int64_t vocab = 129280, rows = 32;
  auto logits = stack_rows(rows, vocab, 5, 2.0f, 5.0f);
  auto reqs = sampled_requests(rows, vocab, 17);
  std::vector<std::vector<TokenAdjustment>> lists(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t id = static_cast<int32_t>((r * 7919) % vocab);
    lists[r] = {{id, 0, 100.0f, 0u}};
    reqs[r].adjustments = lists[r];
    reqs[r].top_k = 0;  // top_k / top_p keep the forced token anyway; keep the test about the bias
    reqs[r].temperature = r % 2 ? 1.0f : 0.0f;
    reqs[r].num_logprobs = 1;
  }
  auto sampler = DeviceSampler::create(rows, vocab);
  ASSERT_TRUE(sampler.ok());
  Tensor d = device_copy(logits, DType::kF32);
  const auto got = (*sampler)->sample(d.data<float>(), reqs);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(got[r].token, lists[r][0].id) << "row " << r;
    const SampleResult want = sample_token(logits.data() + r * vocab, vocab, cpu_params(reqs[r]), reqs[r].seed,
                                           reqs[r].output_index, reqs[r].adjustments);
    EXPECT_TRUE(close_logprob(got[r].logprob, want.logprob)) << got[r].logprob << " vs " << want.logprob;
    ASSERT_EQ(got[r].top_logprobs.size(), 1u);
    EXPECT_EQ(got[r].top_logprobs[0].first, want.top_logprobs[0].first);  // the raw argmax, not the forced id
  }
}

// min_p on a small row: the empirical distribution is softmax over the kept set.
TEST_F(DeviceSamplerTest, MinPEmpiricalDistribution) {
  const std::vector<float> base = {1.0f, 3.0f, 2.0f, 0.5f, 2.5f, -1.0f, 1.5f, 0.0f};
  const int64_t vocab = static_cast<int64_t>(base.size()), n = 20000;
  std::vector<float> logits;
  for (int64_t i = 0; i < n; ++i) logits.insert(logits.end(), base.begin(), base.end());
  std::vector<DeviceSampleRequest> reqs(n);
  for (int64_t i = 0; i < n; ++i) {
    reqs[i] = {1.3f, 0, 1.0f, 4242, i, 0};
    reqs[i].min_p = 0.4f;  // keeps exp((l - 3) / 1.3) >= 0.4: l >= 1.81 -> ids 1, 2, 4
  }
  auto sampler = DeviceSampler::create(n, vocab);
  ASSERT_TRUE(sampler.ok());
  Tensor d = device_copy(logits, DType::kF32);
  const auto got = (*sampler)->sample(d.data<float>(), reqs);
  std::vector<int> count(vocab, 0);
  for (const auto& r : got) ++count[r.token];
  double z = 0;
  for (int id : {1, 2, 4}) z += std::exp(base[id] / 1.3);
  for (int64_t i = 0; i < vocab; ++i) {
    const bool kept = i == 1 || i == 2 || i == 4;
    const double want = kept ? std::exp(base[i] / 1.3) / z : 0.0, freq = count[i] / static_cast<double>(n);
    if (!kept) {
      EXPECT_EQ(count[i], 0) << "token " << i;
      continue;
    }
    EXPECT_NEAR(freq, want, 5 * std::sqrt(want * (1 - want) / n)) << "token " << i;
  }
}

// The scratch and upload buffers grow between calls; a row with every id
// masked yields token 0 (as on the CPU).
TEST_F(DeviceSamplerTest, AdjustmentBuffersGrowAndFullMaskGivesTokenZero) {
  const int64_t vocab = 4096, rows = 64;
  auto logits = stack_rows(rows, vocab, 3, 1.0f, 2.0f);
  auto sampler = DeviceSampler::create(rows, vocab);
  ASSERT_TRUE(sampler.ok());
  Tensor d = device_copy(logits, DType::kF32);
  for (int64_t adjusted : {1, 8, 64}) {
    std::vector<std::vector<TokenAdjustment>> lists(rows);
    auto reqs = sampled_requests(rows, vocab, 100 + adjusted);
    for (int64_t r = 0; r < adjusted; ++r) {
      for (int32_t id = 0; id < 50 * adjusted; id += 3) lists[r].push_back({id, id % 4, 0.25f * (id % 5), 0u});
      reqs[r].adjustments = lists[r];
      reqs[r].penalties = {1.2f, 0.3f, 0.1f};
    }
    const auto got = (*sampler)->sample(d.data<float>(), reqs);
    Tally t;
    for (int64_t r = 0; r < rows; ++r) check_row(logits.data() + r * vocab, vocab, reqs[r], got[r], r, &t);
    EXPECT_TRUE(all_match(t, "growing adjustments")) << adjusted << " adjusted rows";
  }
  std::vector<TokenAdjustment> all(vocab);
  for (int32_t id = 0; id < vocab; ++id) all[id] = {id, 0, 0.0f, kernels::kAdjustMasked};
  std::vector<DeviceSampleRequest> reqs = {{0.0f, 0, 1.0f, 1, 0, 0}, {1.0f, 0, 1.0f, 2, 3, 0}};
  for (auto& q : reqs) q.adjustments = all;
  const auto got = (*sampler)->sample(d.data<float>(), reqs);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].token, 0) << r;
    EXPECT_EQ(got[r].token, sample_token(logits.data() + r * vocab, vocab, cpu_params(reqs[r]), reqs[r].seed,
                                         reqs[r].output_index, all)
                                .token);
  }
}

}  // namespace
}  // namespace nucleus
