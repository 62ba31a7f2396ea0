// Decode CUDA graphs on tiny-dsv3 (split-K in its deterministic reduction): a
// replay is bit-identical to the eager run
// of the same padded step for every batch size from 1 to the largest
// captured (captured sizes and sizes between them); pad rows write no KV
// (a sentinel-filled pool keeps the sentinel outside the real rows); and 300
// engine steps with a changing mix of requests give identical tokens with
// graphs and with the same padded steps run eagerly; so do requests with
// vLLM's logit processors (penalties, logit_bias, min_tokens, min_p); and
// the decode graphs give the same tokens with NUCLEUS_PACKED_UPLOAD on and off.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "core/device.h"
#include "runtime/model_executor.h"
#include "ops/splitk.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using testing::ScopedEnvValue;

std::unique_ptr<ModelExecutor> load(std::vector<int64_t> graph_sizes, bool eager_pad = false) {
  ModelOptions o;
  o.device = Device::kCuda;
  o.cuda_graph_sizes = std::move(graph_sizes);
  o.graph_eager_pad = eager_pad;
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// Replay equals eager bit for bit when every kernel is deterministic: the
// split-K GEMMs then reduce their splits in a fixed order (their default f32
// atomics reorder sums from run to run).
class CudaGraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available()) << "GPU tests need a CUDA device";
    set_splitk_deterministic(true);
  }
  void TearDown() override { reset_splitk_deterministic(); }
};

TEST_F(CudaGraphTest, ReplayEqualsEagerPaddedStepForEveryBatchSize) {
  const std::vector<int64_t> sizes = {1, 2, 4, 8, 16};
  auto m = load(sizes);
  const int64_t bs = 16, blocks_per_seq = 8, num_seqs = 16;
  m->set_max_blocks_per_seq(blocks_per_seq);
  m->reserve_step_buffers(1024, num_seqs);  // the prefill below has 648 tokens
  KvCache kv = m->make_kv_cache(num_seqs * blocks_per_seq + 1, bs);
  ASSERT_TRUE(m->capture_decode_graphs(kv).ok());
  // Prefill 16 sequences of different lengths (eager), sequence s in blocks
  // 1 + s * blocks_per_seq ... (block 0 is what pad rows read).
  std::vector<int64_t> lens(num_seqs);
  StepInputs pre;
  pre.query_start = {0};
  pre.max_blocks_per_seq = static_cast<int32_t>(blocks_per_seq);
  for (int64_t s = 0; s < num_seqs; ++s) {
    lens[s] = 3 + 5 * s;
    for (int64_t i = 0; i < lens[s]; ++i) {
      pre.token_ids.push_back(static_cast<int32_t>((s * 97 + i * 31) % 4000 + 3));
      pre.positions.push_back(static_cast<int32_t>(i));
      pre.slot_mapping.push_back((1 + s * blocks_per_seq + i / bs) * bs + i % bs);
    }
    pre.query_start.push_back(static_cast<int32_t>(pre.token_ids.size()));
    pre.context_lens.push_back(0);
    pre.logit_indices.push_back(pre.query_start.back() - 1);
    for (int64_t b = 0; b < blocks_per_seq; ++b) pre.block_tables.push_back(static_cast<int32_t>(1 + s * blocks_per_seq + b));
  }
  ASSERT_TRUE(m->forward(pre, kv).ok());
  for (int64_t B = 1; B <= 16; ++B) {
    StepInputs d;
    d.query_start = {0};
    d.max_blocks_per_seq = static_cast<int32_t>(blocks_per_seq);
    for (int64_t s = 0; s < B; ++s) {
      const int64_t pos = lens[s];
      d.token_ids.push_back(static_cast<int32_t>(100 + s));
      d.positions.push_back(static_cast<int32_t>(pos));
      d.slot_mapping.push_back((1 + s * blocks_per_seq + pos / bs) * bs + pos % bs);
      d.query_start.push_back(static_cast<int32_t>(s + 1));
      d.context_lens.push_back(static_cast<int32_t>(pos));
      d.logit_indices.push_back(static_cast<int32_t>(s));
      for (int64_t b = 0; b < blocks_per_seq; ++b) d.block_tables.push_back(static_cast<int32_t>(1 + s * blocks_per_seq + b));
    }
    const int64_t padded = m->graph_size_for(B);
    ASSERT_GT(padded, 0);
    const int64_t replays = m->graph_replays();
    auto graph = m->forward(d, kv);
    ASSERT_TRUE(graph.ok());
    EXPECT_EQ(m->graph_replays(), replays + 1);
    StepStats stats;  // forces the eager path
    auto eager = m->forward(pad_decode_step(d, padded, static_cast<int32_t>(blocks_per_seq)), kv, &stats);
    ASSERT_TRUE(eager.ok());
    ASSERT_EQ(graph->numel() * padded, eager->numel() * B);
    EXPECT_EQ(std::memcmp(graph->raw(), eager->raw(), graph->nbytes()), 0) << "batch " << B << " padded " << padded;
  }
}

TEST_F(CudaGraphTest, PadRowsWriteNoKv) {
  auto m = load({8});
  const int64_t bs = 16;
  m->set_max_blocks_per_seq(4);
  m->reserve_step_buffers(64, 8);
  KvCache kv = m->make_kv_cache(16, bs);
  // Fill the pool with a sentinel (bf16 0x7b7b), then replay a 3-row step padded to 8.
  std::vector<uint8_t> sentinel(kv.data.nbytes(), 0x7b);
  copy_to_device(kv.data.raw(), sentinel.data(), sentinel.size());
  ASSERT_TRUE(m->capture_decode_graphs(kv).ok());
  StepInputs d;
  d.query_start = {0};
  d.max_blocks_per_seq = 4;
  const int64_t slots[3] = {5 * bs + 3, 7 * bs, 9 * bs + 15};
  for (int s = 0; s < 3; ++s) {
    d.token_ids.push_back(10 + s);
    d.positions.push_back(0);
    d.slot_mapping.push_back(slots[s]);
    d.query_start.push_back(s + 1);
    d.context_lens.push_back(0);
    d.logit_indices.push_back(s);
    const int32_t block = static_cast<int32_t>(slots[s] / bs);
    for (int32_t b : {block, -1, -1, -1}) d.block_tables.push_back(b);
  }
  // Positions 0 only see their own row (slot), which lives in `block`.
  d.slot_mapping = {5 * bs, 7 * bs, 9 * bs};
  ASSERT_TRUE(m->forward(d, kv).ok());
  EXPECT_EQ(m->graph_replays(), 1);
  Tensor host = to_host(kv.data);
  const int64_t width = kv.width, row_bytes = width * 2;
  std::set<int64_t> written = {5 * bs, 7 * bs, 9 * bs};
  int64_t changed_outside = 0;
  for (int64_t l = 0; l < kv.num_layers; ++l)
    for (int64_t slot = 0; slot < kv.num_slots(); ++slot) {
      const uint8_t* row = static_cast<const uint8_t*>(host.raw()) + (l * kv.num_slots() + slot) * row_bytes;
      bool intact = true;
      for (int64_t i = 0; i < row_bytes; ++i) intact &= row[i] == 0x7b;
      if (written.count(slot)) EXPECT_FALSE(intact) << "layer " << l << " slot " << slot << " not written";
      else changed_outside += !intact;
    }
  EXPECT_EQ(changed_outside, 0);
}

TEST_F(CudaGraphTest, ThreeHundredStepsGraphsEqualEagerPadded) {
  std::ifstream in(testing::model_path("ref/cases.json"));
  json cases = json::parse(in)["tiny-dsv3"];
  EngineConfig ec;
  ec.block_size = 16;
  ec.num_kv_blocks = 512;
  ec.max_num_seqs = 16;
  ec.max_model_len = 1024;
  const std::vector<int64_t> sizes = {1, 2, 4, 8, 16};
  auto run = [&](bool eager_pad) {
    auto e = LLMEngine::create(load(sizes, eager_pad), ec);
    NUCLEUS_CHECK(e.ok(), "{}", e.status().to_string());
    std::map<std::string, std::vector<int32_t>> out;
    int64_t steps = 0, added = 0;
    // A request arrives every 7 steps with a different length, so the
    // batch size keeps changing as others finish.
    while (steps < 300) {
      if (steps % 7 == 0) {
        SamplingParams sp;
        sp.temperature = 0;
        sp.ignore_eos = true;
        sp.max_tokens = 20 + static_cast<int32_t>((added * 13) % 60);
        const auto& c = cases[added % cases.size()];
        NUCLEUS_CHECK_OK((*e)->add_request("r" + std::to_string(added), c["prompt_token_ids"].get<std::vector<int32_t>>(), sp));
        ++added;
      }
      for (const auto& o : (*e)->step())
        out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
      ++steps;
    }
    return std::make_pair(out, (*e)->model().graph_replays());
  };
  auto [graphs, replays] = run(false);
  auto [eager, eager_replays] = run(true);
  EXPECT_GT(replays, 150);
  EXPECT_EQ(eager_replays, 0);
  EXPECT_EQ(graphs, eager);
}

// vLLM's logit processors on the CUDA path (device sampler after the graph
// replay): a batch mixing greedy and sampled requests with logit_bias,
// min_tokens, penalties and min_p gives the same tokens with graphs and with
// the same padded steps run eagerly, and each parameter does what it says.
TEST_F(CudaGraphTest, LogitProcessorsUnderGraphs) {
  std::ifstream in(testing::model_path("ref/cases.json"));
  json cases = json::parse(in)["tiny-dsv3"];
  EngineConfig ec;
  ec.block_size = 16;
  ec.num_kv_blocks = 512;
  ec.max_num_seqs = 16;
  ec.max_model_len = 1024;
  ec.enable_prefix_caching = false;  // the same prompt in every request: no request may reuse another's rows
  const std::vector<int64_t> sizes = {1, 2, 4, 8, 16};
  auto prompt = [&](int i) { return cases[i % cases.size()]["prompt_token_ids"].get<std::vector<int32_t>>(); };
  auto base = [](int n) {
    SamplingParams sp;
    sp.temperature = 0;
    sp.ignore_eos = true;
    sp.max_tokens = n;
    return sp;
  };
  std::map<std::string, SamplingParams> reqs;
  reqs["plain"] = base(24);
  reqs["bias"] = base(12);
  reqs["bias"].logit_bias = {{42, 100.0f}};
  reqs["bias_sampled"] = reqs["bias"];
  reqs["bias_sampled"].temperature = 1.0f;
  reqs["bias_sampled"].seed = 3;
  reqs["eos_first"] = base(16);
  reqs["eos_first"].ignore_eos = false;
  reqs["eos_first"].logit_bias = {{1, 100.0f}};
  reqs["min_tokens"] = reqs["eos_first"];
  reqs["min_tokens"].min_tokens = 6;
  reqs["repetition"] = base(24);
  reqs["repetition"].repetition_penalty = 3.0f;
  reqs["freq_presence"] = base(24);
  reqs["freq_presence"].frequency_penalty = 2.0f;
  reqs["freq_presence"].presence_penalty = 2.0f;
  reqs["min_p_one"] = base(24);
  reqs["min_p_one"].temperature = 1.5f;
  reqs["min_p_one"].min_p = 1.0f;
  reqs["min_p_one"].seed = 5;
  reqs["sampled_all"] = base(24);
  reqs["sampled_all"].temperature = 0.8f;
  reqs["sampled_all"].top_k = 50;
  reqs["sampled_all"].min_p = 0.05f;
  reqs["sampled_all"].repetition_penalty = 1.2f;
  reqs["sampled_all"].frequency_penalty = 0.5f;
  reqs["sampled_all"].logit_bias = {{7, 3.0f}, {8, -3.0f}};
  reqs["sampled_all"].seed = 11;
  auto run = [&](bool eager_pad) {
    auto e = LLMEngine::create(load(sizes, eager_pad), ec);
    NUCLEUS_CHECK(e.ok(), "{}", e.status().to_string());
    std::map<std::string, std::vector<int32_t>> out;
    for (const auto& [name, sp] : reqs)  // one prompt, so outputs compare; all prefilled in the first step
      NUCLEUS_CHECK_OK((*e)->add_request(name, name == "sampled_all" ? prompt(3) : prompt(0), sp));
    while ((*e)->has_unfinished())
      for (const auto& o : (*e)->step())
        out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
    return std::make_pair(out, (*e)->model().graph_replays());
  };
  auto [graphs, replays] = run(false);
  auto [eager, eager_replays] = run(true);
  EXPECT_GT(replays, 10);
  EXPECT_EQ(eager_replays, 0);
  EXPECT_EQ(graphs, eager);
  EXPECT_EQ(graphs["bias"], std::vector<int32_t>(12, 42));
  EXPECT_EQ(graphs["bias_sampled"], std::vector<int32_t>(12, 42));
  EXPECT_EQ(graphs["eos_first"], std::vector<int32_t>{1});
  ASSERT_EQ(graphs["min_tokens"].size(), 7u);
  for (int i = 0; i < 6; ++i) EXPECT_NE(graphs["min_tokens"][i], 1) << i;
  EXPECT_EQ(graphs["min_tokens"][6], 1);
  EXPECT_NE(graphs["repetition"], graphs["plain"]);
  EXPECT_NE(graphs["freq_presence"], graphs["plain"]);
  EXPECT_EQ(graphs["min_p_one"], graphs["plain"]);  // only the argmax survives min_p 1
  EXPECT_EQ(graphs["sampled_all"].size(), 24u);
}

// NUCLEUS_PACKED_UPLOAD (read when the model's executors are created): decode
// graphs captured and replayed with the step's metadata packed in one copy
// give the same greedy tokens as with a copy a region at capacity offsets,
// one request alone (graph 1) and three at once (graph 4, then 2 and 1 as
// the shorter ones finish).
TEST_F(CudaGraphTest, PackedUploadOnAndOffAgree) {
  std::ifstream in(testing::model_path("ref/cases.json"));
  json cases = json::parse(in)["tiny-dsv3"];
  EngineConfig ec;
  ec.block_size = 16;
  ec.num_kv_blocks = 256;
  ec.max_num_seqs = 4;
  ec.max_model_len = 1024;
  auto run = [&](const char* packed, int num_requests) {
    ScopedEnvValue env("NUCLEUS_PACKED_UPLOAD", packed);
    auto e = LLMEngine::create(load({1, 2, 4}), ec);
    NUCLEUS_CHECK(e.ok(), "{}", e.status().to_string());
    for (int i = 0; i < num_requests; ++i) {
      SamplingParams sp;
      sp.temperature = 0;
      sp.ignore_eos = true;
      sp.max_tokens = 8 + 6 * i;
      NUCLEUS_CHECK_OK((*e)->add_request("r" + std::to_string(i),
                                         cases[i % cases.size()]["prompt_token_ids"].get<std::vector<int32_t>>(), sp));
    }
    std::map<std::string, std::vector<int32_t>> out;
    while ((*e)->has_unfinished())
      for (const auto& o : (*e)->step())
        out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
    return std::make_pair(out, (*e)->model().graph_replays());
  };
  for (int n : {1, 3}) {
    SCOPED_TRACE("requests " + std::to_string(n));
    auto [packed, packed_replays] = run("1", n);
    auto [nine, nine_replays] = run("0", n);
    EXPECT_GT(packed_replays, 0);
    EXPECT_EQ(packed_replays, nine_replays);
    ASSERT_EQ(packed.size(), static_cast<size_t>(n));
    EXPECT_EQ(packed, nine);
  }
}

}  // namespace
}  // namespace nucleus
