// The CUDA backend on the tiny checkpoints against the Hugging Face reference
// (models/ref) and the CPU reference:
//  - teacher-forced: prompt + the reference's greedy tokens as one prefill;
//    the GPU argmax equals the reference token wherever the reference's
//    top-2 margin is >= 0.05, and logits stay within the bf16 tolerance of
//    the CPU reference;
//  - free-running greedy through the engine (expanded prefill, absorbed
//    decode through the paged cache) equals the reference token for token up
//    to the first step whose reference margin is below 0.05.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "runtime/model_executor.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

// Logit tolerance of the bf16 backend: its deviation from the f32 CPU
// reference may be at most 1.5x (+0.1) what bf16 storage alone causes, as
// measured by the CPU reference with every bf16 buffer of the CUDA backend
// rounded to bf16 after each op (ModelOptions::cpu_bf16_emulation). On the
// tiny models that yardstick is ~3.0 (tiny-dsv3) and ~2.1 (tiny-dsv3-fp8)
// at worst over all positions; the mean deviation is held the same way.
// FP8 checkpoints get a wider bound on the mean: the CUDA backend also
// quantizes every GEMM's activations per 1x128 to e4m3 (W8A8, as DeepSeek's
// own FP8 inference does), which the bf16 emulation does not model. Measured
// on the H200 (2026-11-29): mean 0.0305 against a yardstick of 0.0131 (2.3x).
constexpr float kToleranceFactor = 1.5f;
constexpr float kFp8MeanToleranceFactor = 3.0f;
constexpr float kToleranceSlack = 0.1f;
constexpr float kMarginThreshold = 0.05f;

json cases_for(const std::string& model) {
  std::ifstream in(testing::model_path("ref/cases.json"));
  return json::parse(in)[model];
}

std::unique_ptr<ModelExecutor> load(const std::string& name, Device device, bool bf16_emulation = false) {
  ModelOptions o;
  o.device = device;
  o.cpu_bf16_emulation = bf16_emulation;
  auto m = load_deepseek_model(testing::model_path(name), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// All-position logits of one sequence in one prefill step.
Tensor full_logits(ModelExecutor& m, const std::vector<int32_t>& tokens) {
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

int32_t argmax(const float* v, int64_t n) {
  int64_t b = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[b]) b = i;
  return static_cast<int32_t>(b);
}

class GpuReferenceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_TRUE(cuda_available()) << "GPU tests need a CUDA device"; }
};

TEST_P(GpuReferenceTest, TeacherForced) {
  const std::string name = GetParam();
  auto gpu = load(name, Device::kCuda);
  auto cpu = load(name, Device::kCpu);
  auto emu = load(name, Device::kCpu, /*bf16_emulation=*/true);
  const int64_t V = gpu->config().vocab_size;
  float worst = 0, emu_worst = 0;
  double sum = 0, emu_sum = 0;
  int64_t count = 0;
  int checked = 0;
  for (const auto& c : cases_for(name)) {
    std::vector<int32_t> tokens = c["prompt_token_ids"].get<std::vector<int32_t>>();
    const auto greedy = c["greedy_token_ids"].get<std::vector<int32_t>>();
    const auto margins = c["greedy_top2_margins"].get<std::vector<float>>();
    const int64_t n = static_cast<int64_t>(tokens.size());
    tokens.insert(tokens.end(), greedy.begin(), greedy.end() - 1);
    Tensor lg = full_logits(*gpu, tokens), lc = full_logits(*cpu, tokens), le = full_logits(*emu, tokens);
    for (int64_t i = 0; i < lg.numel(); ++i) {
      const float d = std::fabs(lg.data<float>()[i] - lc.data<float>()[i]);
      const float de = std::fabs(le.data<float>()[i] - lc.data<float>()[i]);
      worst = std::max(worst, d);
      emu_worst = std::max(emu_worst, de);
      sum += d;
      emu_sum += de;
      ++count;
    }
    for (size_t s = 0; s < greedy.size(); ++s) {
      if (margins[s] < kMarginThreshold) continue;
      const int64_t row = n - 1 + static_cast<int64_t>(s);
      EXPECT_EQ(argmax(lg.data<float>() + row * V, V), greedy[s]) << name << " step " << s;
      ++checked;
    }
  }
  const double mean = sum / count, emu_mean = emu_sum / count;
  std::printf("%s teacher-forced: %d positions checked; |gpu - cpu| max %.4f mean %.5f; bf16-emulated cpu: max %.4f "
              "mean %.5f\n", name.c_str(), checked, worst, mean, emu_worst, emu_mean);
  EXPECT_LE(worst, kToleranceFactor * emu_worst + kToleranceSlack);
  const bool fp8 = gpu->config().fp8;
  EXPECT_LE(mean, (fp8 ? kFp8MeanToleranceFactor : kToleranceFactor) * emu_mean + 0.01);
}

TEST_P(GpuReferenceTest, FreeRunningGreedyThroughEngine) {
  const std::string name = GetParam();
  EngineConfig ec;
  ec.block_size = 16;
  ec.num_kv_blocks = 256;
  auto engine = LLMEngine::create(load(name, Device::kCuda), ec);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  const json cases = cases_for(name);
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 32;
  sp.ignore_eos = true;
  for (size_t i = 0; i < cases.size(); ++i)
    ASSERT_TRUE((*engine)->add_request(std::to_string(i), cases[i]["prompt_token_ids"].get<std::vector<int32_t>>(), sp)
                    .ok());
  std::map<std::string, std::vector<int32_t>> out;
  while ((*engine)->has_unfinished())
    for (const auto& o : (*engine)->step())
      out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto greedy = cases[i]["greedy_token_ids"].get<std::vector<int32_t>>();
    const auto margins = cases[i]["greedy_top2_margins"].get<std::vector<float>>();
    const auto& got = out[std::to_string(i)];
    ASSERT_EQ(got.size(), greedy.size());
    size_t s = 0;
    for (; s < greedy.size() && margins[s] >= kMarginThreshold; ++s) EXPECT_EQ(got[s], greedy[s]) << name << " case " << i << " step " << s;
    std::printf("%s case %zu: %zu steps compared (first low-margin step %zu)\n", name.c_str(), i, s, s);
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, GpuReferenceTest, ::testing::Values("tiny-dsv3", "tiny-dsv3-fp8"));

}  // namespace
}  // namespace nucleus
