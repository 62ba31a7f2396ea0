// The skinny decode GEMM switches end to end on the GPU: `nucleus generate`
// on the shipped tiny model (bf16) with NUCLEUS_SKINNY=1 (every bf16 decode
// GEMM at m <= 8 on the skinny kernel, launched with PDL), with NUCLEUS_PDL=0
// and NUCLEUS_PDL=gemms (the norm, SwiGLU, RoPE and routing kernels launched
// normally) too, and NUCLEUS_SKINNY=0 (cuBLASLt); and the same for the FP8 tiny model
// with NUCLEUS_SKINNY_FP8 (FP8 decode GEMMs at m <= 16 on the FP8 skinny
// kernel, or on cuBLASLt FP8 / the own FP8 kernels); and on both with
// NUCLEUS_MOE_DECODE=0 (the routed experts on cuda_grouped, the default,
// instead of the fused decode kernel, cuda_decode, which the other runs turn on),
// there also with NUCLEUS_MOE_ALIGN_FREE=0 (one-token steps through the align
// kernel, not the default align-free path):
//  - the decode graph reports cuda_skinny (cuda_skinny_fp8) exactly when it is
//    on, and the graphs report cuda_decode exactly when the MoE decode kernel is
//    (NUCLEUS_DUMP_GRAPH's backend column);
//  - greedy tokens of the eight reference prompts, run together (decode at
//    m = 8) and one by one (m = 1), on and off, equal the Hugging Face
//    reference up to the first step whose reference top-2 margin is below
//    0.05 (as gpu_reference_test; past it, f32 sums in another order may
//    pick the other token).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "gpu_test_util.h"
#include "nucleus_cli.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using testing::RunResult;

constexpr float kMarginThreshold = 0.05f;

using testing::json_lines;

RunResult run(const std::string& args, const std::string& env, const std::string& dir) {
  return testing::run_nucleus(args, env, dir);
}

struct Config {
  const char* key;  // "on", "on, no PDL", "off", "moe decode off"
  const char* env;
  bool skinny;      // whether the decode graph must report `backend`
  bool moe_decode;  // whether the graphs must report cuda_decode
};

// Greedy tokens of `model`'s reference prompts under each of `configs` (keys
// "on", "on, no PDL", "off"), batched and one by one, against each other and
// the Hugging Face reference; the decode graph reports `backend` exactly in
// the configs that turn it on.
void check_switch(const std::string& model, const std::vector<Config>& configs, const std::string& backend) {
  ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device";
  std::ifstream in(testing::model_path("ref/cases.json"));
  const json cases = json::parse(in)[model];
  const std::string dir = testing::make_temp_dir("nucleus_skinny");
  {
    std::ofstream f(dir + "/prompts.jsonl");
    for (const json& c : cases) f << json{{"prompt_token_ids", c["prompt_token_ids"]}}.dump() << "\n";
  }
  const std::string base = "generate --device cuda --model " + testing::model_path(model) +
                           " --max-tokens 32 --ignore-eos --temperature 0 --json";
  std::map<std::string, std::vector<std::vector<int>>> tokens;  // "on batch", "off single", ...
  for (const Config& cfg : configs) {
    const std::string env = cfg.env;
    RunResult batch = run(base + " --prompts " + dir + "/prompts.jsonl", env + " NUCLEUS_DUMP_GRAPH=1", dir);
    ASSERT_EQ(batch.status, 0) << batch.err;
    const bool reports_skinny = batch.err.find(backend) != std::string::npos;
    EXPECT_EQ(reports_skinny, cfg.skinny) << env << ": the decode graph's backends";
    const bool reports_moe_decode = batch.err.find("cuda_decode") != std::string::npos;
    EXPECT_EQ(reports_moe_decode, cfg.moe_decode) << env << ": the graphs' moe_experts backend";
    const std::string key = cfg.key;
    for (const json& line : json_lines(batch.out)) tokens[key + " batch"].push_back(line["token_ids"]);
    for (size_t i = 0; i < cases.size(); ++i) {
      std::ofstream(dir + "/one.jsonl") << json{{"prompt_token_ids", cases[i]["prompt_token_ids"]}}.dump() << "\n";
      RunResult one = run(base + " --prompts " + dir + "/one.jsonl", env, dir);
      ASSERT_EQ(one.status, 0) << one.err;
      tokens[key + " single"].push_back(json_lines(one.out).at(0)["token_ids"]);
    }
  }
  for (const char* mode : {" batch", " single"}) {
    for (const Config& cfg : configs) {
      const auto& got = tokens[std::string(cfg.key) + mode];
      ASSERT_EQ(got.size(), cases.size()) << cfg.key << mode;
      for (size_t i = 0; i < cases.size(); ++i) {
        const auto greedy = cases[i]["greedy_token_ids"].get<std::vector<int>>();
        const auto margins = cases[i]["greedy_top2_margins"].get<std::vector<float>>();
        size_t s = 0;
        for (; s < greedy.size() && s < got[i].size() && margins[s] >= kMarginThreshold; ++s)
          EXPECT_EQ(got[i][s], greedy[s]) << "case " << i << mode << " step " << s << " (" << cfg.key << ")";
        std::printf("case %zu%s %s: %zu steps compared\n", i, mode, cfg.key, s);
      }
    }
  }
}

TEST(GpuSkinnySwitch, OnAndOffAgreeWithEachOtherAndTheReference) {
  check_switch("tiny-dsv3",
               {Config{"on", "NUCLEUS_SKINNY=1 NUCLEUS_MOE_DECODE=16", true, true},
                Config{"on, no PDL", "NUCLEUS_SKINNY=1 NUCLEUS_PDL=0 NUCLEUS_MOE_DECODE=16", true, true},
                Config{"on, PDL gemms", "NUCLEUS_SKINNY=1 NUCLEUS_PDL=gemms NUCLEUS_MOE_DECODE=16", true, true},
                Config{"off", "NUCLEUS_SKINNY=0 NUCLEUS_MOE_DECODE=16", false, true},
                Config{"moe decode off", "NUCLEUS_SKINNY=1 NUCLEUS_MOE_DECODE=0", true, false},
                Config{"moe align at m = 1", "NUCLEUS_SKINNY=1 NUCLEUS_MOE_DECODE=0 NUCLEUS_MOE_ALIGN_FREE=0", true,
                       false}},
               "cuda_skinny");
}

// The FP8 skinny GEMM on the FP8 tiny model: every FP8 decode linear whose k
// is a multiple of 128 (all but the shared expert's down_proj, k = 192, a
// decode linear only with NUCLEUS_MOE_FUSE_SHARED=0: by default on CUDA the
// shared experts run in the routed experts' op) on cuda_skinny_fp8 when on;
// the stream scheme runs at m = 1 by default (NUCLEUS_SKINNY_FP8_STREAM=auto),
// at m <= 2 with =1 and never with =0.
TEST(GpuSkinnySwitch, Fp8OnAndOffAgreeWithEachOtherAndTheReference) {
  check_switch("tiny-dsv3-fp8",
               {Config{"on", "NUCLEUS_SKINNY_FP8=1 NUCLEUS_MOE_DECODE=16", true, true},
                Config{"on, no PDL", "NUCLEUS_SKINNY_FP8=1 NUCLEUS_PDL=0 NUCLEUS_MOE_DECODE=16", true, true},
                Config{"on, PDL gemms", "NUCLEUS_SKINNY_FP8=1 NUCLEUS_PDL=gemms NUCLEUS_MOE_DECODE=16", true, true},
                Config{"on, stream to m = 2", "NUCLEUS_SKINNY_FP8=1 NUCLEUS_SKINNY_FP8_STREAM=1 NUCLEUS_MOE_DECODE=16",
                       true, true},
                Config{"on, no stream", "NUCLEUS_SKINNY_FP8=1 NUCLEUS_SKINNY_FP8_STREAM=0 NUCLEUS_MOE_DECODE=16", true,
                       true},
                Config{"off", "NUCLEUS_SKINNY_FP8=0 NUCLEUS_MOE_DECODE=16", false, true},
                Config{"moe decode off", "NUCLEUS_SKINNY_FP8=1 NUCLEUS_MOE_DECODE=0", true, false},
                Config{"moe align at m = 1", "NUCLEUS_SKINNY_FP8=1 NUCLEUS_MOE_DECODE=0 NUCLEUS_MOE_ALIGN_FREE=0", true,
                       false}},
               "cuda_skinny_fp8");
}

}  // namespace
}  // namespace nucleus
