// The decode kernel switches end to end on the GPU: `nucleus generate` on
// the shipped tiny model (bf16) with NUCLEUS_SKINNY=1 (every bf16 decode GEMM
// at m <= 8 on the skinny kernel, launched with PDL), with NUCLEUS_PDL=0
// too, NUCLEUS_SKINNY=0 (cuBLASLt), and NUCLEUS_MOE_DECODE=0 (the routed
// experts on cuda_grouped instead of the fused decode kernel, cuda_decode,
// which the other runs use by default):
//  - the graphs report cuda_skinny and cuda_decode exactly when they are on
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
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

constexpr float kMarginThreshold = 0.05f;

struct RunResult {
  int status = -1;
  std::string out, err;
};

RunResult run(const std::string& args, const std::string& env, const std::string& dir) {
  const char* bin = std::getenv("NUCLEUS_BIN");
  const std::string err_file = dir + "/stderr.txt";
  const std::string cmd = "env " + env + " " + (bin ? bin : "nucleus") + " " + args + " 2>" + err_file;
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream e(err_file);
  std::stringstream ss;
  ss << e.rdbuf();
  r.err = ss.str();
  return r;
}

std::vector<json> json_lines(const std::string& s) {
  std::vector<json> out;
  std::stringstream ss(s);
  std::string line;
  while (std::getline(ss, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

TEST(GpuSkinnySwitch, OnAndOffAgreeWithEachOtherAndTheReference) {
  ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device";
  std::ifstream in(testing::model_path("ref/cases.json"));
  const json cases = json::parse(in)["tiny-dsv3"];
  const std::string dir = testing::make_temp_dir("nucleus_skinny");
  {
    std::ofstream f(dir + "/prompts.jsonl");
    for (const json& c : cases) f << json{{"prompt_token_ids", c["prompt_token_ids"]}}.dump() << "\n";
  }
  const std::string base = "generate --device cuda --model " + testing::model_path("tiny-dsv3") +
                           " --max-tokens 32 --ignore-eos --temperature 0 --json";
  std::map<std::string, std::vector<std::vector<int>>> tokens;  // "on batch", "off single", ...
  struct Config {
    const char* key;
    const char* env;
    bool skinny;
    bool moe_decode;
  };
  for (const Config& cfg : {Config{"on", "NUCLEUS_SKINNY=1", true, true},
                            Config{"on, no PDL", "NUCLEUS_SKINNY=1 NUCLEUS_PDL=0", true, true},
                            Config{"off", "NUCLEUS_SKINNY=0", false, true},
                            Config{"moe decode off", "NUCLEUS_SKINNY=1 NUCLEUS_MOE_DECODE=0", true, false}}) {
    const std::string env = cfg.env;
    RunResult batch = run(base + " --prompts " + dir + "/prompts.jsonl", env + " NUCLEUS_DUMP_GRAPH=1", dir);
    ASSERT_EQ(batch.status, 0) << batch.err;
    const bool reports_skinny = batch.err.find("cuda_skinny") != std::string::npos;
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
    const auto& on = tokens[std::string("on") + mode];
    const auto& no_pdl = tokens[std::string("on, no PDL") + mode];
    const auto& off = tokens[std::string("off") + mode];
    const auto& moe_off = tokens[std::string("moe decode off") + mode];
    ASSERT_EQ(on.size(), cases.size());
    ASSERT_EQ(moe_off.size(), cases.size());
    ASSERT_EQ(no_pdl.size(), cases.size());
    ASSERT_EQ(off.size(), cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
      ASSERT_EQ(on[i].size(), off[i].size()) << "case " << i << mode;
      const auto greedy = cases[i]["greedy_token_ids"].get<std::vector<int>>();
      const auto margins = cases[i]["greedy_top2_margins"].get<std::vector<float>>();
      size_t s = 0;
      for (; s < greedy.size() && s < on[i].size() && margins[s] >= kMarginThreshold; ++s) {
        EXPECT_EQ(on[i][s], greedy[s]) << "case " << i << mode << " step " << s << " (skinny on)";
        EXPECT_EQ(no_pdl[i][s], greedy[s]) << "case " << i << mode << " step " << s << " (skinny on, no PDL)";
        EXPECT_EQ(off[i][s], greedy[s]) << "case " << i << mode << " step " << s << " (skinny off)";
        EXPECT_EQ(moe_off[i][s], greedy[s]) << "case " << i << mode << " step " << s << " (MoE decode off)";
      }
      std::printf("case %zu%s: %zu steps compared\n", i, mode, s);
    }
  }
}

}  // namespace
}  // namespace nucleus
