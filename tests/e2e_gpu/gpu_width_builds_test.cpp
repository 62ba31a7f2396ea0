// Width builds in the decode graph (NUCLEUS_WIDTH_BUILDS; issue #11) with
// tiny-dsv3 on CUDA:
//  - with the switch on, each layer's decode front end is one mla_front node
//    (backend cuda_width_builds) whose q_full the decode attention reads; the
//    prefill graph and the switch-off decode graph keep the separate ops;
//  - decode logits and the KV cache with width builds on (fused where it
//    fits), lean-only and off agree within bf16 reordering tolerance, at
//    graph sizes (replayed and eager), between them, and above the largest
//    (the plain chain inside the op);
//  - greedy decoding through the engine with width builds on gives the
//    reference's tokens up to its first near-tie;
//  - a model the builds cannot serve (an FP8 cache) keeps the separate ops
//    with a warning, and strict mode makes that a start-up error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "gpu_test_util.h"
#include "jit/mla_front_builds.h"
#include "runtime/model_executor.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using width::WidthBuildsMode;

constexpr int64_t kBlockSize = 16, kContext = 5;
const std::vector<int64_t> kGraphSizes = {1, 2, 4, 8, 16};

StatusOr<std::unique_ptr<ModelExecutor>> try_load(WidthBuildsMode mode, std::vector<int64_t> graph_sizes,
                                                  std::optional<KvCacheDtype> cache = std::nullopt) {
  ModelOptions o;
  o.device = Device::kCuda;
  o.width_builds = mode;
  o.cuda_graph_sizes = std::move(graph_sizes);
  o.kv_cache_dtype = cache;
  return load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
}

std::unique_ptr<ModelExecutor> load(WidthBuildsMode mode, std::vector<int64_t> graph_sizes) {
  auto m = try_load(mode, std::move(graph_sizes));
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

class GpuWidthBuildsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available()) << "GPU tests need a CUDA device";
    cache_dir_ = (std::filesystem::temp_directory_path() / ("nucleus_width_e2e_" + std::to_string(::getpid()))).string();
    ::setenv("NUCLEUS_KERNEL_CACHE_DIR", cache_dir_.c_str(), 1);
    ::unsetenv("NUCLEUS_STRICT_WIDTHS");
  }
  void TearDown() override {
    ::unsetenv("NUCLEUS_STRICT_WIDTHS");
    std::filesystem::remove_all(cache_dir_);
  }
  std::string cache_dir_;
};

StepInputs decode_step(int64_t n, int64_t blocks) {
  return testing::decode_step_after_context(n, blocks, kContext, kBlockSize);
}

std::vector<float> host_floats(const Tensor& t) {
  Tensor h = t.device() == Device::kCpu ? t : to_host(t);
  if (h.dtype() == DType::kBF16) {
    std::vector<uint16_t> bits(h.numel());
    std::memcpy(bits.data(), h.raw(), bits.size() * 2);
    return testing::from_bf16(bits);
  }
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

TEST_F(GpuWidthBuildsTest, DecodeGraphRunsTheFrontEndAsOneOp) {
  auto on = load(WidthBuildsMode::kOn, kGraphSizes);
  auto off = load(WidthBuildsMode::kOff, kGraphSizes);
  int fronts = 0, attn_with_q_full = 0, separate = 0;
  for (const Node& n : on->graph(StepKind::kDecode).nodes()) {
    const std::string kind = n.op->kind();
    if (kind == "mla_front") {
      ++fronts;
      EXPECT_EQ(n.op->backend(), "cuda_width_builds") << n.name;
    }
    if (kind == "mla_decode" && n.inputs.size() == 2) ++attn_with_q_full;
    if (kind == "rope_kv_cache_write" || n.name.find("q_a_proj") != std::string::npos) ++separate;
  }
  EXPECT_EQ(fronts, 4);
  EXPECT_EQ(attn_with_q_full, 4);
  EXPECT_EQ(separate, 0);
  EXPECT_EQ(on->graph(StepKind::kPrefill).dump("prefill").find("mla_front"), std::string::npos);
  EXPECT_EQ(off->graph(StepKind::kDecode).dump("decode").find("mla_front"), std::string::npos);
}

// Decode logits and caches of on, lean-only and off: at graph sizes (replay
// and eager), between them (padded), and above the largest (the op's plain
// chain). Each size twice (a stale barrier or buffer would show).
TEST_F(GpuWidthBuildsTest, OnLeanAndOffAgree) {
  const int64_t blocks = (kContext + 1 + kBlockSize - 1) / kBlockSize, max_seqs = 24;
  std::map<std::string, std::unique_ptr<ModelExecutor>> models;
  std::map<std::string, KvCache> caches;
  models["off"] = load(WidthBuildsMode::kOff, kGraphSizes);
  models["on"] = load(WidthBuildsMode::kOn, kGraphSizes);
  models["lean"] = load(WidthBuildsMode::kLeanOnly, kGraphSizes);
  for (auto& [name, m] : models) {
    m->set_max_blocks_per_seq(blocks);
    m->reserve_step_buffers(max_seqs, max_seqs);
    caches[name] = m->make_kv_cache(1 + max_seqs * blocks, kBlockSize);
    ASSERT_TRUE(m->capture_decode_graphs(caches[name]).ok()) << name;
  }
  // Every graph size is served by the build asked for (none left to the plain chain).
  for (const auto& [name, variant] :
       {std::pair<std::string, width::BuildVariant>{"on", width::BuildVariant::kFused}, {"lean", width::BuildVariant::kLean}}) {
    ASSERT_NE(models[name]->width_builds(), nullptr) << name;
    for (const width::WidthChoice& ch : models[name]->width_builds()->choices())
      EXPECT_EQ(ch.served, variant) << name << ": " << ch.log_line();
  }
  const int64_t launches_before = models["on"]->width_builds()->launches();
  double worst = 0, worst_cache = 0;
  int64_t differing = 0, compared = 0;
  for (bool eager : {false, true}) {
    for (int64_t n : {1, 1, 3, 8, 16, 16, 24, 24}) {
      SCOPED_TRACE(std::string(eager ? "eager" : "graph") + " batch " + std::to_string(n));
      StepInputs d = decode_step(n, blocks);
      std::map<std::string, std::vector<float>> logits, cache;
      for (auto& [name, m] : models) {
        testing::fill_cache_pattern(caches[name]);
        StepStats stats;  // forces the eager path
        auto l = m->forward(d, caches[name], eager ? &stats : nullptr);
        ASSERT_TRUE(l.ok()) << name << ": " << l.status().to_string();
        logits[name] = host_floats(*l);
        cache[name] = host_floats(caches[name].data);
      }
      for (const char* name : {"on", "lean"}) {
        SCOPED_TRACE(name);
        ASSERT_EQ(logits[name].size(), logits["off"].size());
        // Another summation order than cuBLASLt's moves bf16 roundings by an ulp, which the next layers carry.
        EXPECT_TRUE(testing::all_close(logits[name], logits["off"], 0.05f, 0.02f, 4096));
        EXPECT_TRUE(testing::all_close(cache[name], cache["off"], 0.02f, 0.02f, 576));
        for (size_t i = 0; i < logits[name].size(); ++i) {
          const double d = std::fabs(logits[name][i] - logits["off"][i]);
          worst = std::max(worst, d);
          differing += d > 0;
          ++compared;
        }
        for (size_t i = 0; i < cache[name].size(); ++i)
          if (!std::isnan(cache["off"][i])) worst_cache = std::max<double>(worst_cache, std::fabs(cache[name][i] - cache["off"][i]));
      }
    }
  }
  // The eager steps of up to 16 rows ran a build (graph replays are not counted; 24 rows run the plain chain).
  EXPECT_GE(models["on"]->width_builds()->launches() - launches_before, 4 * 6);
  EXPECT_GE(models["lean"]->width_builds()->launches(), 4 * 6);
  std::printf("width builds on / lean vs off: max |logit difference| %.3g (%lld of %lld logits differ), max |cache "
              "difference| %.3g\n",
              worst, static_cast<long long>(differing), static_cast<long long>(compared), worst_cache);
}

TEST_F(GpuWidthBuildsTest, GreedyThroughTheEngineGivesTheReferenceTokens) {
  std::ifstream in(testing::model_path("ref/cases.json"));
  const json cases = json::parse(in)["tiny-dsv3"];
  for (WidthBuildsMode mode : {WidthBuildsMode::kOn, WidthBuildsMode::kLeanOnly}) {
    SCOPED_TRACE(width::width_builds_mode_name(mode));
    EngineConfig ec;
    ec.block_size = 16;
    ec.num_kv_blocks = 256;
    ec.max_num_seqs = 8;
    auto e = LLMEngine::create(load(mode, {1, 2, 4, 8}), ec);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    SamplingParams sp;
    sp.temperature = 0;
    sp.max_tokens = 32;
    sp.ignore_eos = true;
    for (size_t i = 0; i < cases.size(); ++i)
      ASSERT_TRUE((*e)->add_request(std::to_string(i), cases[i]["prompt_token_ids"].get<std::vector<int32_t>>(), sp)
                      .ok());
    std::map<std::string, std::vector<int32_t>> out;
    while ((*e)->has_unfinished())
      for (const auto& o : (*e)->step())
        out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto greedy = cases[i]["greedy_token_ids"].get<std::vector<int32_t>>();
      const auto margins = cases[i]["greedy_top2_margins"].get<std::vector<float>>();
      const auto& g = out.at(std::to_string(i));
      ASSERT_EQ(g.size(), greedy.size());
      for (size_t s = 0; s < greedy.size() && margins[s] >= 0.05f; ++s)
        EXPECT_EQ(g[s], greedy[s]) << "case " << i << " step " << s;
    }
  }
}

TEST_F(GpuWidthBuildsTest, UnsupportedModelKeepsTheSeparateOpsOrFailsInStrictMode) {
  auto relaxed = try_load(WidthBuildsMode::kOn, kGraphSizes, KvCacheDtype::kFp8E4M3);
  ASSERT_TRUE(relaxed.ok()) << relaxed.status().to_string();
  EXPECT_EQ((*relaxed)->graph(StepKind::kDecode).dump("decode").find("mla_front"), std::string::npos);
  ::setenv("NUCLEUS_STRICT_WIDTHS", "1", 1);
  auto strict = try_load(WidthBuildsMode::kOn, kGraphSizes, KvCacheDtype::kFp8E4M3);
  ASSERT_FALSE(strict.ok());
  EXPECT_EQ(strict.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(strict.status().message().find("bf16 KV cache"), std::string::npos) << strict.status().message();
}

}  // namespace
}  // namespace nucleus
