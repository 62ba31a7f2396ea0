// CUDA-graph step padding on the host (no GPU needed): graph sizes, token
// graph buckets, and the padded step metadata (pad rows write no KV, read
// only block 0, and sit in their own sequences).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "runtime/model_executor.h"

namespace nucleus {
namespace {

StepInputs decode_step(int64_t n, int32_t width) {
  StepInputs d;
  d.query_start = {0};
  d.max_blocks_per_seq = width;
  for (int64_t s = 0; s < n; ++s) {
    d.token_ids.push_back(static_cast<int32_t>(10 + s));
    d.positions.push_back(static_cast<int32_t>(5 + s));
    d.slot_mapping.push_back(100 + s);
    d.query_start.push_back(static_cast<int32_t>(s + 1));
    d.context_lens.push_back(static_cast<int32_t>(5 + s));
    d.logit_indices.push_back(static_cast<int32_t>(s));
    for (int32_t b = 0; b < width; ++b) d.block_tables.push_back(static_cast<int32_t>(s * width + b + 1));
  }
  return d;
}

TEST(GraphPaddingTest, DefaultDecodeGraphSizes) {
  auto sizes = default_cuda_graph_sizes(256);
  EXPECT_EQ(sizes.front(), 1);
  EXPECT_EQ(sizes.back(), 256);
  EXPECT_EQ((std::vector<int64_t>(sizes.begin(), sizes.begin() + 10)),
            (std::vector<int64_t>{1, 2, 4, 8, 16, 24, 32, 48, 64, 96}));
  // Capped by max_num_seqs, which is always captured.
  EXPECT_EQ(default_cuda_graph_sizes(20), (std::vector<int64_t>{1, 2, 4, 8, 16, 20}));
  EXPECT_EQ(default_cuda_graph_sizes(1024).back(), 512);
}

TEST(GraphPaddingTest, TokenGraphBuckets) {
  unsetenv("NUCLEUS_TOKEN_GRAPH_SIZES");
  EXPECT_EQ(*token_graph_sizes_from_env(8192), (std::vector<int64_t>{256, 512, 1024, 2048, 3072}));
  EXPECT_EQ(*token_graph_sizes_from_env(1000), (std::vector<int64_t>{256, 512}));  // capped by the budget
  setenv("NUCLEUS_TOKEN_GRAPH_SIZES", "", 1);
  EXPECT_TRUE(token_graph_sizes_from_env(8192)->empty());  // empty disables
  setenv("NUCLEUS_TOKEN_GRAPH_SIZES", "128,64,128", 1);
  EXPECT_EQ(*token_graph_sizes_from_env(8192), (std::vector<int64_t>{64, 128}));
  setenv("NUCLEUS_TOKEN_GRAPH_SIZES", "64,x", 1);
  auto bad = token_graph_sizes_from_env(8192);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'x'"), std::string::npos);
  unsetenv("NUCLEUS_TOKEN_GRAPH_SIZES");
}

TEST(GraphPaddingTest, PadDecodeStep) {
  StepInputs d = decode_step(3, 2);
  StepInputs p = pad_decode_step(d, 8, 4);
  ASSERT_EQ(p.num_tokens(), 8);
  ASSERT_EQ(p.num_seqs(), 8);
  EXPECT_TRUE(p.is_decode());
  EXPECT_EQ(p.max_blocks_per_seq, 4);
  for (int64_t s = 0; s < 3; ++s) {  // real rows unchanged, tables widened with -1
    EXPECT_EQ(p.token_ids[s], d.token_ids[s]);
    EXPECT_EQ(p.slot_mapping[s], d.slot_mapping[s]);
    EXPECT_EQ(p.context_lens[s], d.context_lens[s]);
    EXPECT_EQ(p.block_tables[s * 4], d.block_tables[s * 2]);
    EXPECT_EQ(p.block_tables[s * 4 + 1], d.block_tables[s * 2 + 1]);
    EXPECT_EQ(p.block_tables[s * 4 + 2], -1);
  }
  for (int64_t s = 3; s < 8; ++s) {  // pad rows: slot -1, no context, block 0 only, own logit row
    EXPECT_EQ(p.slot_mapping[s], -1);
    EXPECT_EQ(p.positions[s], 0);
    EXPECT_EQ(p.context_lens[s], 0);
    EXPECT_EQ(p.query_start[s + 1], s + 1);
    EXPECT_EQ(p.block_tables[s * 4], 0);
    EXPECT_EQ(p.block_tables[s * 4 + 1], -1);
    EXPECT_EQ(p.logit_indices[s], s);
  }
  EXPECT_EQ(pad_decode_step(d, 3, 2).num_tokens(), 3);  // already at size
}

TEST(GraphPaddingTest, PadPrefillStepAddsOnePadSequence) {
  StepInputs in;
  in.token_ids = {1, 2, 3, 4, 5};
  in.positions = {7, 8, 9, 0, 1};
  in.slot_mapping = {20, 21, 22, 30, 31};
  in.query_start = {0, 3, 5};
  in.context_lens = {7, 0};
  in.max_blocks_per_seq = 2;
  in.block_tables = {3, 4, 5, -1};
  in.logit_indices = {2, 4};
  StepInputs p = pad_prefill_step(in, 8);
  ASSERT_EQ(p.num_tokens(), 8);
  ASSERT_EQ(p.num_seqs(), 3);
  EXPECT_EQ(p.query_start, (std::vector<int32_t>{0, 3, 5, 8}));
  EXPECT_EQ(p.logit_indices, in.logit_indices);  // pad rows yield no logits
  for (int i = 5; i < 8; ++i) {
    EXPECT_EQ(p.slot_mapping[i], -1);
    EXPECT_EQ(p.token_ids[i], 0);
  }
  EXPECT_EQ(p.context_lens.back(), 0);
  EXPECT_EQ(p.block_tables[4], 0);
  EXPECT_EQ(p.block_tables[5], -1);
  EXPECT_EQ(pad_prefill_step(in, 5).num_seqs(), 2);  // nothing to pad
}

TEST(GraphPaddingTest, AsDecodeRowsGivesEachTokenItsOwnSequence) {
  StepInputs in;  // sequence 0: 3 tokens at 7..9; sequence 1: 2 tokens at 0..1
  in.token_ids = {1, 2, 3, 4, 5};
  in.positions = {7, 8, 9, 0, 1};
  in.slot_mapping = {20, 21, 22, 30, 31};
  in.query_start = {0, 3, 5};
  in.context_lens = {7, 0};
  in.max_blocks_per_seq = 2;
  in.block_tables = {3, 4, 5, -1};
  in.logit_indices = {0, 1, 2, 3, 4};
  const StepInputs d = as_decode_rows(in);
  EXPECT_TRUE(d.is_decode());
  EXPECT_EQ(d.token_ids, in.token_ids);
  EXPECT_EQ(d.positions, in.positions);
  EXPECT_EQ(d.slot_mapping, in.slot_mapping);
  EXPECT_EQ(d.logit_indices, in.logit_indices);
  EXPECT_EQ(d.query_start, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(d.context_lens, (std::vector<int32_t>{7, 8, 9, 0, 1}));  // each row sees the rows before it
  EXPECT_EQ(d.max_blocks_per_seq, 2);
  EXPECT_EQ(d.block_tables, (std::vector<int32_t>{3, 4, 3, 4, 3, 4, 5, -1, 5, -1}));
}

// A step of 2-3 tokens a sequence gives the same logits as decode rows
// (multi_token_decode, the default) and on the prefill path (off): the CPU
// reference's absorbed decode attention against its expanded prefill form.
TEST(GraphPaddingTest, DecodeRowsEqualThePrefillPath) {
  const std::string dir = std::string(std::getenv("NUCLEUS_MODELS_DIR") ? std::getenv("NUCLEUS_MODELS_DIR")
                                                                       : NUCLEUS_SOURCE_DIR "/models") +
                          "/tiny-dsv3";
  std::vector<Tensor> logits;
  std::vector<int64_t> steps;
  for (bool rows : {true, false}) {
    ModelOptions o;
    o.multi_token_decode = rows;
    auto m = load_deepseek_model(dir, o, {}, false);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    KvCache kv = (*m)->make_kv_cache(4, 16);
    // Prefill: sequence 0 has 9 tokens in blocks {0, 1}, sequence 1 has 5 in block {2}.
    StepInputs pre;
    pre.query_start = {0};
    pre.max_blocks_per_seq = 2;
    auto add = [](StepInputs& in, std::vector<int32_t> toks, int32_t first, std::vector<int32_t> table) {
      for (size_t i = 0; i < toks.size(); ++i) {
        const int32_t pos = first + static_cast<int32_t>(i);
        in.token_ids.push_back(toks[i]);
        in.positions.push_back(pos);
        in.slot_mapping.push_back(static_cast<int64_t>(table[pos / 16]) * 16 + pos % 16);
        in.logit_indices.push_back(static_cast<int32_t>(in.token_ids.size() - 1));
      }
      in.query_start.push_back(static_cast<int32_t>(in.token_ids.size()));
      in.context_lens.push_back(first);
      in.block_tables.insert(in.block_tables.end(), table.begin(), table.end());
    };
    add(pre, {11, 12, 13, 14, 15, 16, 17, 18, 19}, 0, {0, 1});
    add(pre, {21, 22, 23, 24, 25}, 0, {2, -1});
    ASSERT_TRUE((*m)->forward(pre, kv).ok());
    StepInputs step;  // a verify-like step: 3 tokens of sequence 0 (crossing no block), 2 of sequence 1
    step.query_start = {0};
    step.max_blocks_per_seq = 2;
    add(step, {31, 32, 33}, 9, {0, 1});
    add(step, {41, 42}, 5, {2, -1});
    auto l = (*m)->forward(step, kv);
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    logits.push_back(*l);
    steps.push_back((*m)->multi_token_decode_steps());
  }
  EXPECT_EQ(steps[0], 1);  // the multi-token step; the prefill of 9 tokens is not one
  EXPECT_EQ(steps[1], 0);
  ASSERT_EQ(logits[0].shape(), logits[1].shape());
  double num = 0, den = 0;
  const float* a = logits[0].data<float>();
  const float* b = logits[1].data<float>();
  for (int64_t i = 0; i < logits[0].numel(); ++i) {
    num += (a[i] - b[i]) * double(a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  // f32 on both paths: only the order of the sums differs.
  EXPECT_LT(std::sqrt(num / den), 1e-5);
}

// On the CPU (no graphs captured), no step size maps to a graph: every step
// runs eagerly.
TEST(GraphPaddingTest, CpuModelRunsEverythingEagerly) {
  auto m = load_deepseek_model(std::string(std::getenv("NUCLEUS_MODELS_DIR") ? std::getenv("NUCLEUS_MODELS_DIR")
                                                                           : NUCLEUS_SOURCE_DIR "/models") +
                                   "/tiny-dsv3",
                               ModelOptions{}, {}, false);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)->graph_size_for(1), 0);
  EXPECT_EQ((*m)->token_bucket_for(100), 0);
  KvCache kv = (*m)->make_kv_cache(4, 16);
  EXPECT_TRUE((*m)->capture_decode_graphs(kv).ok());  // a no-op on the CPU
  EXPECT_EQ((*m)->graph_size_for(1), 0);
}

}  // namespace
}  // namespace nucleus
