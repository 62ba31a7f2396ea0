// The two FP8 KV-cache layouts against the bf16 cache on the CPU reference,
// tiny-dsv3 and tiny-dsv3-fp8 over every reference prompt (models/ref/cases.json),
// 300 generated tokens a prompt (measurement: tests/kv_cache_accuracy.h):
// per 100-token window the relative L2 logit error and the top-1 agreement of
//   fp8_e4m3    one per-layer k_scale (the checkpoint's, else 1.0), and
//   fp8_ds_mla  one f32 scale per 128 latent values, the rope part in bf16.
// Required: over all steps (every window, every prompt pooled) the
// tile-scaled layout's error is at most half the per-layer layout's (issue
// 19's goal); in every window it is below the per-layer layout's and its
// agreement is not below it. Measured (2026-12-02, this test; the table is
// docs/perf.md "FP8 KV-cache accuracy"): overall 0.49x (tiny-dsv3) and
// 0.44x (tiny-dsv3-fp8) of the per-layer error; per window 0.27-0.77x, so
// the goal read per window is not met in one window of each model (0.77x,
// 0.59x): both layouts round the latent c_kv to e4m3 with the same relative
// step (2^-4; a per-tile scale only spares small tiles the subnormals and
// large ones the saturation, which RMS-normalised c_kv rarely needs); the
// other difference is the rope part, bf16 here.
// Also the setting through the binary: `--kv-cache-dtype fp8_ds_mla`
// generates, logs 656-byte rows (4 layers: 2624 B/token) and refuses
// --kv-scale naming the layout.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include <sys/wait.h>

#include "kv_cache_accuracy.h"

namespace nucleus {
namespace {

void check_model(const std::string& model) {
  const auto r = testing::measure_kv_cache_accuracy(model, Device::kCpu,
                                                    {KvCacheDtype::kFp8E4M3, KvCacheDtype::kFp8DsMla}, 300);
  testing::print_kv_cache_accuracy(model + ", CPU reference, " + std::to_string(testing::reference_prompts(model).size()) +
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

// Runs the binary with `args`, stdout and stderr; (exit status, output).
std::pair<int, std::string> run_binary(const std::string& args) {
  const char* bin = std::getenv("NUCLEUS_BIN");
  std::string cmd = std::string(bin ? bin : "nucleus") + " " + args + " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, out};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

TEST(KvCacheDsMlaCli, GeneratesLogsItsRowBytesAndRefusesKvScale) {
  ASSERT_NE(std::getenv("NUCLEUS_BIN"), nullptr) << "run through ctest (NUCLEUS_BIN)";
  const std::string base = "generate --device cpu --model " + testing::model_path("tiny-dsv3") +
                           " --prompt 'def f(x):' --max-tokens 12 --ignore-eos --json --kv-cache-dtype fp8_ds_mla";
  auto [status, out] = run_binary(base);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("fp8_ds_mla cache, 2624 B/token"), std::string::npos) << out;
  EXPECT_NE(out.find("token_ids"), std::string::npos) << out;
  auto [bad_status, bad] = run_binary(base + " --kv-scale 0.5");
  EXPECT_EQ(bad_status, 1) << bad;
  EXPECT_NE(bad.find("fp8_ds_mla keeps one scale per 128 latent values"), std::string::npos) << bad;
}

TEST(KvCacheAccuracy, TileScaledLayoutHalvesThePerLayerErrorTinyDsv3) { check_model("tiny-dsv3"); }

TEST(KvCacheAccuracy, TileScaledLayoutHalvesThePerLayerErrorTinyDsv3Fp8) { check_model("tiny-dsv3-fp8"); }

}  // namespace
}  // namespace nucleus
