// Tensor parallelism of the whole model on CUDA (NCCL, one thread per GPU):
//  - world size 1 (runs on the single H200): tiny-dsv3 as a one-rank group
//    through NCCL. With the fusion off (NCCL all-reduce, then add+norm) every
//    collective is a copy, so logits equal the plain model's bit for bit;
//    the fused all-reduce + RMSNorm kernel runs the plain add+norm's row
//    code, so its logits are the plain model's bits too, and greedy decoding through the engine (CUDA graphs) gives
//    the reference's tokens.
//  - TP = 2 (and 4) when that many GPUs are visible: greedy tokens through
//    the engine equal TP = 1's up to the first low-margin step, teacher-
//    forced logits stay within the bf16 tolerance of the CPU reference,
//    fused and unfused. Skipped on one GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/cuda/context.h"
#include "core/device.h"
#include "runtime/model_executor.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

constexpr float kMarginThreshold = 0.05f;

json cases() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  return json::parse(in)["tiny-dsv3"];
}

std::unique_ptr<ModelExecutor> load(Device device, int tp, bool force_group = false, bool fuse = true) {
  ModelOptions o;
  o.device = device;
  o.tensor_parallel_size = tp;
  o.force_tp_group = force_group;
  o.fuse_allreduce_norm = fuse;
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// All-position logits of prompt + greedy tokens as one prefill step (host).
Tensor teacher_forced(ModelExecutor& m, std::vector<int32_t> tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size()), bs = 16, blocks = (n + bs - 1) / bs;
  KvCache kv = m.make_kv_cache(blocks, bs);
  StepInputs in;
  in.token_ids = tokens;
  for (int64_t i = 0; i < n; ++i) {
    in.positions.push_back(static_cast<int32_t>(i));
    in.slot_mapping.push_back(i);
    in.logit_indices.push_back(static_cast<int32_t>(i));
  }
  in.query_start = {0, static_cast<int32_t>(n)};
  in.context_lens = {0};
  in.max_blocks_per_seq = static_cast<int32_t>(blocks);
  for (int64_t b = 0; b < blocks; ++b) in.block_tables.push_back(static_cast<int32_t>(b));
  auto l = m.forward(in, kv);
  NUCLEUS_CHECK(l.ok(), "{}", l.status().to_string());
  return *l;
}

std::vector<int32_t> with_greedy(const json& c) {
  auto t = c["prompt_token_ids"].get<std::vector<int32_t>>();
  const auto g = c["greedy_token_ids"].get<std::vector<int32_t>>();
  t.insert(t.end(), g.begin(), g.end() - 1);
  return t;
}

float max_diff(const Tensor& a, const Tensor& b) {
  float m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(a.data<float>()[i] - b.data<float>()[i]));
  return m;
}

// Greedy 32 tokens for every reference prompt, batched through the engine
// (CUDA graphs for decode, token graphs for prefill).
std::map<std::string, std::vector<int32_t>> engine_greedy(std::unique_ptr<ModelExecutor> model) {
  EngineConfig ec;
  ec.block_size = 16;
  ec.num_kv_blocks = 256;
  auto e = LLMEngine::create(std::move(model), ec);
  NUCLEUS_CHECK(e.ok(), "{}", e.status().to_string());
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 32;
  sp.ignore_eos = true;
  const json cs = cases();
  for (size_t i = 0; i < cs.size(); ++i) {
    Status s = (*e)->add_request(std::to_string(i), cs[i]["prompt_token_ids"].get<std::vector<int32_t>>(), sp);
    NUCLEUS_CHECK(s.ok(), "{}", s.to_string());
  }
  std::map<std::string, std::vector<int32_t>> out;
  while ((*e)->has_unfinished())
    for (const auto& o : (*e)->step())
      out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  return out;
}

// The engine's tokens equal the reference's up to the first step whose
// reference top-2 margin is below kMarginThreshold.
void expect_reference_tokens(const std::map<std::string, std::vector<int32_t>>& got, const std::string& what) {
  const json cs = cases();
  for (size_t i = 0; i < cs.size(); ++i) {
    const auto greedy = cs[i]["greedy_token_ids"].get<std::vector<int32_t>>();
    const auto margins = cs[i]["greedy_top2_margins"].get<std::vector<float>>();
    const auto& g = got.at(std::to_string(i));
    ASSERT_EQ(g.size(), greedy.size()) << what;
    for (size_t s = 0; s < greedy.size() && margins[s] >= kMarginThreshold; ++s)
      EXPECT_EQ(g[s], greedy[s]) << what << " case " << i << " step " << s;
  }
}

class GpuTpTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(cuda_available()) << "GPU tests need a CUDA device"; }
};

// The backend chosen for node `name` of the decode graph (rank 0's).
std::string backend_of(ModelExecutor& m, const std::string& name) {
  for (const auto& n : m.graph(StepKind::kDecode).nodes())
    if (n.name == name) return n.op->backend();
  return "(no node " + name + ")";
}

TEST_F(GpuTpTest, OneRankGroupThroughNcclMatchesThePlainModel) {
  auto cpu = load(Device::kCpu, 1);
  auto plain = load(Device::kCuda, 1);
  auto unfused = load(Device::kCuda, 1, /*force_group=*/true, /*fuse=*/false);
  auto fused = load(Device::kCuda, 1, /*force_group=*/true, /*fuse=*/true);
  EXPECT_EQ(backend_of(*unfused, "layers.0.post_attention_layernorm"), "cuda");
  EXPECT_EQ(backend_of(*fused, "layers.0.post_attention_layernorm"), "cuda_allreduce_fused");
  EXPECT_EQ(backend_of(*fused, "norm"), "cuda_allreduce_fused");
  float worst_plain = 0, worst_fused = 0;
  for (const auto& c : cases()) {
    const auto tokens = with_greedy(c);
    Tensor r = teacher_forced(*cpu, tokens), p = teacher_forced(*plain, tokens),
           u = teacher_forced(*unfused, tokens), f = teacher_forced(*fused, tokens);
    EXPECT_EQ(max_diff(p, u), 0.0f) << "NCCL over one rank is a copy: the unfused group must equal the plain model";
    // The fused kernel at one rank runs the plain add+norm's row code (kernels/rmsnorm/add_rmsnorm_row.cuh).
    EXPECT_EQ(max_diff(p, f), 0.0f) << "the fused all-reduce + RMSNorm over one rank must equal the plain model";
    worst_plain = std::max(worst_plain, max_diff(r, p));
    worst_fused = std::max(worst_fused, max_diff(r, f));
  }
  std::printf("one-rank group: max |logit - cpu| plain %.4f, fused all-reduce + RMSNorm %.4f\n", worst_plain,
              worst_fused);
  EXPECT_LE(worst_fused, 1.5f * worst_plain + 0.1f);  // the bf16 yardstick of gpu_reference_test
  expect_reference_tokens(engine_greedy(std::move(fused)), "fused one-rank group");
  expect_reference_tokens(engine_greedy(std::move(unfused)), "unfused one-rank group");
}

class GpuTpSizes : public GpuTpTest, public ::testing::WithParamInterface<int> {};

TEST_P(GpuTpSizes, MatchesTpOne) {
  const int tp = GetParam();
  if (cuda::device_count() < tp) GTEST_SKIP() << "needs " << tp << " GPUs (" << cuda::device_count() << " visible)";
  auto cpu = load(Device::kCpu, 1);
  auto one = load(Device::kCuda, 1);
  float worst_one = 0;
  std::vector<Tensor> ref, gpu1;
  for (const auto& c : cases()) {
    ref.push_back(teacher_forced(*cpu, with_greedy(c)));
    gpu1.push_back(teacher_forced(*one, with_greedy(c)));
    worst_one = std::max(worst_one, max_diff(ref.back(), gpu1.back()));
  }
  for (bool fuse : {true, false}) {
    SCOPED_TRACE(fuse ? "fused" : "unfused");
    auto many = load(Device::kCuda, tp, false, fuse);
    ASSERT_EQ(many->tensor_parallel_size(), tp);
    float worst = 0, worst_vs_one = 0;
    size_t i = 0;
    for (const auto& c : cases()) {
      Tensor l = teacher_forced(*many, with_greedy(c));
      worst = std::max(worst, max_diff(ref[i], l));
      worst_vs_one = std::max(worst_vs_one, max_diff(gpu1[i], l));
      ++i;
    }
    std::printf("TP=%d %s: max |logit - cpu| %.4f (TP=1 GPU: %.4f), vs TP=1 GPU %.4f\n", tp,
                fuse ? "fused" : "unfused", worst, worst_one, worst_vs_one);
    // The same bf16 yardstick as the TP = 1 GPU test (gpu_reference_test).
    EXPECT_LE(worst, 1.5f * worst_one + 0.1f);
    expect_reference_tokens(engine_greedy(std::move(many)), "TP=" + std::to_string(tp));
  }
}

INSTANTIATE_TEST_SUITE_P(TinyDsv3, GpuTpSizes, ::testing::Values(2, 4));

}  // namespace
}  // namespace nucleus
