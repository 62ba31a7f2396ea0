// The engine on the CUDA backend with tiny-dsv3: a request's greedy output
// does not depend on batching, chunked prefill, the prefix cache or
// preemption — each run agrees with the reference (and so with the others)
// token for token up to the first step whose reference top-2 margin is
// below 0.05 (bf16 numerics may legitimately flip a near-tie there).
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "runtime/model_executor.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

struct Case {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> margins;
};

std::vector<Case> load_cases() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  std::vector<Case> out;
  const json all = json::parse(in);  // (a range-for over a temporary's member would dangle)
  for (const auto& c : all["tiny-dsv3"])
    out.push_back({c["prompt_token_ids"].get<std::vector<int32_t>>(), c["greedy_token_ids"].get<std::vector<int32_t>>(),
                   c["greedy_top2_margins"].get<std::vector<float>>()});
  return out;
}

struct RunOptions {
  std::vector<int64_t> graph_sizes = {1, 2, 4, 8};  // empty: eager decode
  bool prefix_caching = true;
};

std::map<std::string, std::vector<int32_t>> run(const std::vector<Case>& cases, int64_t budget, int64_t blocks,
                                                const std::string& tag, LLMEngine* reuse = nullptr,
                                                EngineStats* stats = nullptr, const RunOptions& ro = {}) {
  std::unique_ptr<LLMEngine> own;
  LLMEngine* e = reuse;
  if (!e) {
    ModelOptions o;
    o.device = Device::kCuda;
    o.cuda_graph_sizes = ro.graph_sizes;
    auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
    NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
    EngineConfig ec;
    ec.block_size = 16;
    ec.num_kv_blocks = blocks;
    ec.max_num_batched_tokens = budget;
    ec.max_num_seqs = 8;
    ec.enable_prefix_caching = ro.prefix_caching;
    auto made = LLMEngine::create(std::move(*m), ec);
    NUCLEUS_CHECK(made.ok(), "{}", made.status().to_string());
    own = std::move(*made);
    e = own.get();
  }
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 32;
  sp.ignore_eos = true;
  for (size_t i = 0; i < cases.size(); ++i) NUCLEUS_CHECK_OK(e->add_request(tag + std::to_string(i), cases[i].prompt, sp));
  std::map<std::string, std::vector<int32_t>> out;
  while (e->has_unfinished())
    for (const auto& o : e->step())
      out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  if (stats) *stats = e->stats();
  return out;
}

void expect_agrees(const std::map<std::string, std::vector<int32_t>>& got, const std::vector<Case>& cases,
                   const std::string& tag) {
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& g = got.at(tag + std::to_string(i));
    ASSERT_EQ(g.size(), cases[i].greedy.size());
    for (size_t s = 0; s < g.size() && cases[i].margins[s] >= 0.05f; ++s)
      EXPECT_EQ(g[s], cases[i].greedy[s]) << tag << i << " step " << s;
  }
}

class GpuEngineTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(cuda_available()) << "GPU tests need a CUDA device"; }
};

TEST_F(GpuEngineTest, AloneBatchedChunkedCachedPreempted) {
  auto cases = load_cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    auto got = run({cases[i]}, 8192, 256, "alone");
    expect_agrees(got, {cases[i]}, "alone");
  }
  for (int64_t budget : {8192, 64, 7, 1}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    expect_agrees(run(cases, budget, 256, "b"), cases, "b");
  }
  {  // a second run served from the prefix cache
    ModelOptions o;
    o.device = Device::kCuda;
    auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
    ASSERT_TRUE(m.ok());
    EngineConfig ec;
    ec.block_size = 16;
    ec.num_kv_blocks = 256;
    auto e = LLMEngine::create(std::move(*m), ec);
    ASSERT_TRUE(e.ok());
    expect_agrees(run(cases, 8192, 256, "first", e->get()), cases, "first");
    EngineStats st;
    expect_agrees(run(cases, 8192, 256, "second", e->get(), &st), cases, "second");
    EXPECT_GT(st.prefix_hit_tokens, 0);
  }
  EngineStats st;
  expect_agrees(run(cases, 8192, 11, "p", nullptr, &st), cases, "p");  // small pool: preemption
  EXPECT_GT(st.num_preemptions, 0);
}

// A budget of one token makes every prefill chunk a one-row step, which runs
// through the decode graph (absorbed attention over the cache); each variant
// separately, so a failure says which part is at fault.
TEST_F(GpuEngineTest, OneTokenBudgetEagerGraphsAndNoPrefixCache) {
  auto cases = load_cases();
  RunOptions eager;
  eager.graph_sizes = {};
  expect_agrees(run(cases, 1, 256, "eager", nullptr, nullptr, eager), cases, "eager");
  RunOptions no_prefix;
  no_prefix.prefix_caching = false;
  expect_agrees(run(cases, 1, 256, "noprefix", nullptr, nullptr, no_prefix), cases, "noprefix");
  RunOptions neither = eager;
  neither.prefix_caching = false;
  expect_agrees(run(cases, 1, 256, "neither", nullptr, nullptr, neither), cases, "neither");
  for (size_t i = 0; i < cases.size(); ++i)  // alone: no other sequence in any step
    expect_agrees(run({cases[i]}, 1, 256, "alone1_", nullptr, nullptr, neither), {cases[i]}, "alone1_");
}

}  // namespace
}  // namespace nucleus
