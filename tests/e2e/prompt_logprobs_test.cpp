// Prompt logprobs (vLLM's prompt_logprobs) from LLMEngine on the CPU
// reference with tiny-dsv3 against the Hugging Face reference: the logits of
// every prompt position in models/ref (float32 transformers) give
// log_softmax(logits[p])[prompt[p + 1]], which the engine must return for
// every p however the prefill is chunked, whether the prompt's blocks are in
// the prefix cache and when the request is preempted; requests beside it
// keep their reference greedy tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "runtime/model_executor.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

struct RefCase {
  std::vector<int32_t> prompt;
  std::vector<int32_t> greedy;
  std::vector<double> prompt_logprobs;  // [len - 1]: from the reference logits; empty when models/ref has none
  std::vector<int32_t> argmax;          // [len - 1]: the reference's most likely token at each position
};

std::vector<RefCase> ref_cases() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  const json j = json::parse(in);
  auto ref = Checkpoint::open(testing::model_path("ref"));
  NUCLEUS_CHECK(ref.ok(), "{}", ref.status().to_string());
  std::vector<RefCase> out;
  for (size_t ci = 0; ci < j["tiny-dsv3"].size(); ++ci) {
    const json& c = j["tiny-dsv3"][ci];
    RefCase r{c["prompt_token_ids"].get<std::vector<int32_t>>(), c["greedy_token_ids"].get<std::vector<int32_t>>(),
              {}, {}};
    const std::string key = "tiny-dsv3.prompt" + std::to_string(ci) + ".logits";
    if (ref->contains(key)) {
      Tensor logits = ref->view(*ref->get(key));  // [len, vocab] f32
      const int64_t vocab = logits.dim(1);
      for (size_t p = 0; p + 1 < r.prompt.size(); ++p) {
        const float* row = logits.data<float>() + p * vocab;
        double mx = row[0], sum = 0;
        int32_t best = 0;
        for (int64_t v = 0; v < vocab; ++v)
          if (row[v] > mx) mx = row[v], best = static_cast<int32_t>(v);
        for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - mx);
        r.prompt_logprobs.push_back(row[r.prompt[p + 1]] - mx - std::log(sum));
        r.argmax.push_back(best);
      }
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::unique_ptr<ModelExecutor> load() {
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), ModelOptions{}, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

EngineConfig config(int64_t budget, int64_t blocks = 256) {
  EngineConfig c;
  c.block_size = 16;
  c.num_kv_blocks = blocks;
  c.max_num_batched_tokens = budget;
  return c;
}

SamplingParams greedy(int n, std::optional<int32_t> prompt_logprobs) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = n;
  p.ignore_eos = true;
  p.prompt_logprobs = prompt_logprobs;
  return p;
}

struct Result {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> prompt_logprobs;
  int prompt_logprob_outputs = 0;  // outputs that carried prompt logprobs
};

// Adds every (id, case, prompt_logprobs) and steps to the end.
std::map<std::string, Result> run(LLMEngine& e,
                                  const std::vector<std::tuple<std::string, RefCase, std::optional<int32_t>>>& reqs) {
  for (const auto& [id, c, plp] : reqs) {
    Status s = e.add_request(id, c.prompt, greedy(8, plp));
    NUCLEUS_CHECK(s.ok(), "{}", s.to_string());
  }
  std::map<std::string, Result> out;
  while (e.has_unfinished())
    for (const auto& o : e.step()) {
      Result& r = out[o.request_id];
      r.tokens.insert(r.tokens.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (!o.prompt_logprobs.empty()) {
        r.prompt_logprobs = o.prompt_logprobs;
        ++r.prompt_logprob_outputs;
      }
    }
  return out;
}

// Checks `got` against the case's reference; returns the largest difference.
double expect_prompt_logprobs(const Result& got, const RefCase& c, int32_t top_n, const std::string& what) {
  EXPECT_EQ(got.prompt_logprob_outputs, 1) << what;
  EXPECT_EQ(got.tokens, std::vector<int32_t>(c.greedy.begin(), c.greedy.begin() + 8)) << what;
  if (got.prompt_logprobs.size() != c.prompt.size() - 1) {
    ADD_FAILURE() << what << ": " << got.prompt_logprobs.size() << " prompt logprobs for " << c.prompt.size()
                  << " prompt tokens";
    return 1e9;
  }
  double worst = 0;
  for (size_t p = 0; p < got.prompt_logprobs.size(); ++p) {
    const TokenLogprobs& t = got.prompt_logprobs[p];
    EXPECT_EQ(t.token, c.prompt[p + 1]) << what << " position " << p;
    EXPECT_EQ(static_cast<int32_t>(t.top.size()), top_n) << what << " position " << p;
    if (!t.top.empty()) {
      EXPECT_GE(t.top[0].second, t.logprob) << what << " position " << p;
      EXPECT_EQ(t.rank == 1, t.top[0].first == t.token) << what << " position " << p;
    }
    EXPECT_GE(t.rank, 1);
    if (c.prompt_logprobs.empty()) continue;
    const double d = std::fabs(t.logprob - c.prompt_logprobs[p]);
    EXPECT_LT(d, 2e-2) << what << " position " << p << ": " << t.logprob << " vs reference " << c.prompt_logprobs[p];
    worst = std::max(worst, d);
  }
  return worst;
}

TEST(PromptLogprobsTest, MatchReferenceWholeAndChunked) {
  const auto cases = ref_cases();
  ASSERT_FALSE(cases[0].prompt_logprobs.empty());
  ASSERT_FALSE(cases[1].prompt_logprobs.empty());
  double worst = 0;
  for (int64_t budget : {8192, 64, 7, 1}) {
    auto e = LLMEngine::create(load(), config(budget));
    ASSERT_TRUE(e.ok());
    // Two prompts with reference logits (17 and 86 tokens), top-3, and a
    // plain request between them.
    auto got = run(**e, {{"a", cases[0], 3}, {"plain", cases[2], std::nullopt}, {"b", cases[1], 3}});
    const std::string what = "budget " + std::to_string(budget);
    worst = std::max(worst, expect_prompt_logprobs(got["a"], cases[0], 3, what + " a"));
    worst = std::max(worst, expect_prompt_logprobs(got["b"], cases[1], 3, what + " b"));
    EXPECT_EQ(got["plain"].tokens, std::vector<int32_t>(cases[2].greedy.begin(), cases[2].greedy.begin() + 8));
    EXPECT_EQ(got["plain"].prompt_logprob_outputs, 0);
    // The top entries are the reference's most likely tokens where its
    // margin is clear.
    const TokenLogprobs& first = got["b"].prompt_logprobs[0];
    EXPECT_EQ(first.top[0].first, cases[1].argmax[0]) << what;
  }
  std::printf("prompt logprobs: max |logprob - HF reference| %.3g\n", worst);
}

TEST(PromptLogprobsTest, PrefixCacheIsNotUsedForTheScoredPositions) {
  const auto cases = ref_cases();
  auto e = LLMEngine::create(load(), config(8192));
  ASSERT_TRUE(e.ok());
  run(**e, {{"warm", cases[1], std::nullopt}});  // the 86-token prompt's 5 full blocks are now cached
  const int64_t hits = (*e)->stats().prefix_hit_tokens;
  auto got = run(**e, {{"b", cases[1], 0}});
  EXPECT_EQ((*e)->stats().prefix_hit_tokens, hits);
  expect_prompt_logprobs(got["b"], cases[1], 0, "after a cached run");
  // A plain request still hits.
  run(**e, {{"again", cases[1], std::nullopt}});
  EXPECT_EQ((*e)->stats().prefix_hit_tokens, hits + 80);
}

TEST(PromptLogprobsTest, PreemptionKeepsThem) {
  const auto cases = ref_cases();
  // 7 blocks of 16 tokens, 32 tokens a step: the 86-token prompt is chunked,
  // and its 4th chunk needs a 6th block while the 17-token request holds 2:
  // it is preempted with 77 prompt logprobs computed, and readmitted it
  // reuses only cached blocks below those (4 blocks, 64 tokens).
  EngineConfig c = config(32, 7);
  auto e = LLMEngine::create(load(), c);
  ASSERT_TRUE(e.ok());
  auto got = run(**e, {{"a", cases[0], 1}, {"b", cases[1], 1}, {"plain", cases[6], std::nullopt}});
  EXPECT_GT((*e)->stats().num_preemptions, 0);
  expect_prompt_logprobs(got["a"], cases[0], 1, "a");
  expect_prompt_logprobs(got["b"], cases[1], 1, "b");
  EXPECT_EQ(got["plain"].tokens, std::vector<int32_t>(cases[6].greedy.begin(), cases[6].greedy.begin() + 8));
  EXPECT_EQ((*e)->stats().prefix_hit_tokens, 64);  // b's readmission, below its 77 scored positions
}

}  // namespace
}  // namespace nucleus
