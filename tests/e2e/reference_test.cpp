// The CPU reference against the Hugging Face reference outputs in
// models/ref (float32 transformers on the same checkpoints): full-prompt
// logits, last-position logits, and 32 greedy tokens decoded incrementally
// through the paged latent cache.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "runtime/model_executor.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

json load_cases() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  return json::parse(in);
}

// One sequence in a cache of 16-token blocks, blocks allocated in reverse
// order so that block-table indirection is exercised.
struct SeqState {
  std::vector<int32_t> tokens;
  int64_t cached = 0;
  std::vector<int32_t> blocks;
};

constexpr int64_t kBlockSize = 16;
constexpr int64_t kNumBlocks = 64;

StepInputs pack_step(SeqState& s, int64_t num_new, bool all_logits) {
  StepInputs in;
  const int64_t begin = s.cached;
  const int64_t needed = (begin + num_new + kBlockSize - 1) / kBlockSize;
  while (static_cast<int64_t>(s.blocks.size()) < needed)
    s.blocks.push_back(static_cast<int32_t>(kNumBlocks - 1 - s.blocks.size()));
  for (int64_t i = 0; i < num_new; ++i) {
    const int64_t pos = begin + i;
    in.token_ids.push_back(s.tokens[pos]);
    in.positions.push_back(static_cast<int32_t>(pos));
    in.slot_mapping.push_back(s.blocks[pos / kBlockSize] * kBlockSize + pos % kBlockSize);
    if (all_logits || i == num_new - 1) in.logit_indices.push_back(static_cast<int32_t>(i));
  }
  in.query_start = {0, static_cast<int32_t>(num_new)};
  in.context_lens = {static_cast<int32_t>(begin)};
  in.max_blocks_per_seq = static_cast<int32_t>(s.blocks.size());
  in.block_tables = s.blocks;
  s.cached += num_new;
  return in;
}

int32_t argmax(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return static_cast<int32_t>(best);
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceTest, LogitsAndGreedyTokens) {
  const std::string name = GetParam();
  ModelOptions opts;
  auto model = load_deepseek_model(testing::model_path(name), opts, {}, false);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  auto ref = Checkpoint::open(testing::model_path("ref"));
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  const json cases = load_cases()[name];
  const int64_t V = (*model)->config().vocab_size;
  float worst_full = 0, worst_last = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const json& c = cases[ci];
    SeqState s;
    s.tokens = c["prompt_token_ids"].get<std::vector<int32_t>>();
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    KvCache kv = (*model)->make_kv_cache(kNumBlocks, kBlockSize);
    StepInputs in = pack_step(s, n, /*all_logits=*/true);
    auto logits = (*model)->forward(in, kv);
    ASSERT_TRUE(logits.ok());
    const std::string key = name + ".prompt" + std::to_string(ci);
    if (ref->contains(key + ".logits")) {
      Tensor r = ref->view(*ref->get(key + ".logits"));
      ASSERT_EQ(r.dim(0), n);
      float m = 0;
      for (int64_t i = 0; i < n * V; ++i) m = std::max(m, std::fabs(logits->data<float>()[i] - r.data<float>()[i]));
      EXPECT_LT(m, 1e-2) << key;
      worst_full = std::max(worst_full, m);
    }
    Tensor last = ref->view(*ref->get(key + ".last_logits"));
    float m = 0;
    const float* ours = logits->data<float>() + (n - 1) * V;
    for (int64_t i = 0; i < V; ++i) m = std::max(m, std::fabs(ours[i] - last.data<float>()[i]));
    EXPECT_LT(m, 1e-2) << key;
    worst_last = std::max(worst_last, m);
    // Greedy decode, EOS ignored, one token per step through the cache.
    std::vector<int32_t> expect = c["greedy_token_ids"].get<std::vector<int32_t>>();
    std::vector<int32_t> got;
    int32_t next = argmax(ours, V);
    for (size_t step = 0; step < expect.size(); ++step) {
      got.push_back(next);
      s.tokens.push_back(next);
      StepInputs d = pack_step(s, 1, false);
      auto l = (*model)->forward(d, kv);
      ASSERT_TRUE(l.ok());
      next = argmax(l->data<float>(), V);
    }
    EXPECT_EQ(got, expect) << key;
  }
  std::printf("%s: max |logit - ref| full prompts %.3g, last positions %.3g\n", name.c_str(), worst_full, worst_last);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, ReferenceTest, ::testing::Values("tiny-dsv3", "tiny-dsv3-fp8"));

}  // namespace
}  // namespace nucleus
