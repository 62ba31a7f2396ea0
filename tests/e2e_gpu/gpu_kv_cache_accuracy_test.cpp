// The two FP8 KV-cache layouts against the bf16 cache on the CUDA backend:
// the CPU test's measurement (tests/e2e/kv_cache_accuracy_test.cpp,
// tests/kv_cache_accuracy.h) with every cache on the GPU: tiny-dsv3 and
// tiny-dsv3-fp8 over every reference prompt, 300 generated tokens a prompt,
// per 100-token window the relative L2 logit error and the top-1 agreement
// of fp8_e4m3 (per-layer k_scale) and fp8_ds_mla (a scale per 128 values,
// bf16 rope) against the GPU's bf16 cache.
// Required, as on the CPU: over all steps the tile-scaled layout's error is
// at most half the per-layer layout's (issue 19's goal; CPU: 0.49x and
// 0.44x, a thin margin for tiny-dsv3); in every window it is below the
// per-layer layout's and its agreement is not below it. The tables printed
// go to docs/perf.md "FP8 KV-cache accuracy".
#include <gtest/gtest.h>

#include "core/device.h"
#include "kv_cache_accuracy.h"

namespace nucleus {
namespace {

class GpuKvCacheAccuracy : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(cuda_available()) << "GPU tests need a CUDA device"; }
};

void check_model(const std::string& model) {
  const auto r = testing::measure_kv_cache_accuracy(model, Device::kCuda,
                                                    {KvCacheDtype::kFp8E4M3, KvCacheDtype::kFp8DsMla}, 300);
  testing::print_kv_cache_accuracy(model + ", CUDA, " + std::to_string(testing::reference_prompts(model).size()) +
                                       " prompts x 300 tokens, against the bf16 cache",
                                   r);
  const testing::LayoutAccuracy& layer = r[0];
  const testing::LayoutAccuracy& tile = r[1];
  for (size_t w = 0; w <= tile.windows.size(); ++w) {
    const bool all = w == tile.windows.size();
    const testing::AccuracyWindow& t = all ? tile.all : tile.windows[w];
    const testing::AccuracyWindow& l = all ? layer.all : layer.windows[w];
    const std::string where = model + (all ? " over all steps" : " window " + std::to_string(t.begin));
    EXPECT_GT(t.err, 0.0) << where << ": an FP8 cache cannot be exact";
    EXPECT_LE(t.err, (all ? 0.5 : 1.0) * l.err) << where;
    EXPECT_GE(t.agree, l.agree) << where;
  }
}

TEST_F(GpuKvCacheAccuracy, TileScaledLayoutHalvesThePerLayerErrorTinyDsv3) { check_model("tiny-dsv3"); }

TEST_F(GpuKvCacheAccuracy, TileScaledLayoutHalvesThePerLayerErrorTinyDsv3Fp8) { check_model("tiny-dsv3-fp8"); }

}  // namespace
}  // namespace nucleus
