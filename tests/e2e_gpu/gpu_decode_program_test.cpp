// The MoE layers' o_proj and MoE blocks as decode programs end to end on the GPU
// (NUCLEUS_DECODE_PROGRAMS=1, ops/moe_program_op.h): `nucleus generate` on the
// shipped tiny models (bf16 and its FP8 e4m3 block-scaled copy; the MoE
// layers route 8 experts by noaux_tc in 4 groups, top-2, one shared expert):
//  - the decode graph reports cuda_program exactly when the switch is on
//    (NUCLEUS_DUMP_GRAPH's backend column), on both models (the FP8 one's
//    programs read its e4m3 weights and scales: q_a, q_b, kv_a, kv_b's W_UK
//    and W_UV, o_proj, the experts; experts of 192, a partial k block); each MoE program
//    joined with the next layer's front, each front absorbing the
//    attention's query and each MoE program merging the attention's splits
//    and applying W_UV, unless NUCLEUS_DECODE_PROGRAM_JOIN=0 /
//    NUCLEUS_DECODE_PROGRAM_ABSORB=0 / NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT=0;
//    the dense first layer's o_proj, norm and MLP as one program too (joined
//    with layer 1's front) unless NUCLEUS_DECODE_PROGRAM_DENSE=0;
//    with NUCLEUS_DECODE_PROGRAM_ATTENTION=1 the fronts also run the
//    attention (a layer is one program; also unjoined, with steps of more
//    than 4 rows back on the attention op);
//    with NUCLEUS_DECODE_PROGRAM_MAX_ROWS=2 (and the attention absorbing
//    itself) only steps of 1 or 2 rows run programs (the start-up log names
//    the widths), the rest the held ops;
//  - greedy tokens of the eight reference prompts, run together (8 rows: a
//    program of width 8), at most 5 a step (widths 8 and 4 on 5 and 3 rows:
//    pad rows), one by one (width 1), and each prompt twice (16 rows: the
//    op's separate ops), on (joined and not) and off, equal the Hugging Face
//    reference up to the first step whose reference top-2 margin is below
//    0.05 (as gpu_reference_test).
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

void expect_reference(const json& cases, const std::vector<std::vector<int>>& got, const std::string& what) {
  ASSERT_EQ(got.size() % cases.size(), 0u) << what;
  for (size_t j = 0; j < got.size(); ++j) {
    const json& c = cases[j % cases.size()];
    const auto greedy = c["greedy_token_ids"].get<std::vector<int>>();
    const auto margins = c["greedy_top2_margins"].get<std::vector<float>>();
    size_t s = 0;
    for (; s < greedy.size() && s < got[j].size() && margins[s] >= kMarginThreshold; ++s)
      EXPECT_EQ(got[j][s], greedy[s]) << what << ": prompt " << j << " step " << s;
    std::printf("%s prompt %zu: %zu steps compared\n", what.c_str(), j, s);
  }
}

void check_programs(const std::string& model) {
  ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device";
  std::ifstream in(testing::model_path("ref/cases.json"));
  const json cases = json::parse(in)[model];
  const std::string dir = testing::make_temp_dir("nucleus_programs");
  {
    std::ofstream f(dir + "/prompts.jsonl"), twice(dir + "/twice.jsonl");
    for (const json& c : cases) f << json{{"prompt_token_ids", c["prompt_token_ids"]}}.dump() << "\n";
    for (int k = 0; k < 2; ++k)
      for (const json& c : cases) twice << json{{"prompt_token_ids", c["prompt_token_ids"]}}.dump() << "\n";
  }
  const std::string base = "generate --device cuda --model " + testing::model_path(model) +
                           " --max-tokens 32 --ignore-eos --temperature 0 --json";
  for (const char* env : {"NUCLEUS_DECODE_PROGRAMS=1", "NUCLEUS_DECODE_PROGRAMS=1 NUCLEUS_DECODE_PROGRAM_ATTENTION=1",
                          "NUCLEUS_DECODE_PROGRAMS=1 NUCLEUS_DECODE_PROGRAM_ATTENTION=1 NUCLEUS_DECODE_PROGRAM_JOIN=0 "
                          "NUCLEUS_DECODE_PROGRAM_MAX_ROWS=4",
                          "NUCLEUS_DECODE_PROGRAMS=1 NUCLEUS_DECODE_PROGRAM_JOIN=0 NUCLEUS_DECODE_PROGRAM_ABSORB=0 "
                          "NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT=0 NUCLEUS_DECODE_PROGRAM_DENSE=0",
                          "NUCLEUS_DECODE_PROGRAMS=1 NUCLEUS_DECODE_PROGRAM_MAX_ROWS=2 NUCLEUS_DECODE_PROGRAM_ABSORB=0",
                          // The full kernel build and the fence counters (the switches off).
                          "NUCLEUS_DECODE_PROGRAMS=1 NUCLEUS_DECODE_PROGRAM_LEAN=0 NUCLEUS_DECODE_PROGRAM_RELEASE=0",
                          "NUCLEUS_DECODE_PROGRAMS=0"}) {
    const bool on = std::string(env).find("PROGRAMS=1") != std::string::npos;
    const bool joined = on && std::string(env).find("JOIN=0") == std::string::npos;
    const bool absorbed = on && std::string(env).find("ABSORB=0") == std::string::npos;
    const bool attention_output = on && std::string(env).find("ATTN_OUTPUT=0") == std::string::npos;
    const bool attention = on && std::string(env).find("ATTENTION=1") != std::string::npos;
    const bool dense = on && std::string(env).find("DENSE=0") == std::string::npos;
    RunResult batch = run(base + " --prompts " + dir + "/prompts.jsonl", std::string(env) + " NUCLEUS_DUMP_GRAPH=1", dir);
    ASSERT_EQ(batch.status, 0) << batch.err;
    EXPECT_EQ(batch.err.find("cuda_program") != std::string::npos, on) << env << ": the decode graph";
    // Joined: layer 1's MoE program also runs layer 2's front (one node; attrs "+front of layer 2").
    EXPECT_EQ(batch.err.find("+front of layer 2") != std::string::npos, joined) << env << ": the join";
    // The dense first layer's o_proj, norm and MLP as a program too (attrs " dense MLP <inter>"; the start-up
    // log's "dense MLPs" count is not it), joined with layer 1's front.
    EXPECT_EQ(batch.err.find(" dense MLP ") != std::string::npos, dense) << env << ": the dense layer";
    EXPECT_EQ(batch.err.find("+front of layer 1") != std::string::npos, dense && joined)
        << env << ": the dense layer joined";
    // Absorbing: the fronts write the attention's absorbed query (attrs "absorbs"; the attention reads mla_q_full).
    EXPECT_EQ(batch.err.find(" absorbs") != std::string::npos, absorbed) << env << ": the absorption";
    // The start-up log says which widths run as programs.
    const std::string e = env;
    const char* widths = e.find("MAX_ROWS=2") != std::string::npos   ? "decode programs: widths 1, 2 run as programs"
                         : e.find("MAX_ROWS=4") != std::string::npos ? "decode programs: widths 1, 2, 4 run as programs"
                                                                      : "decode programs: widths 1, 2, 4, 8 run as programs";
    if (on) {
      EXPECT_NE(batch.err.find(widths), std::string::npos) << env << ": " << batch.err.substr(0, 2000);
      // tiny-dsv3: layer 0 dense, layers 1-3 MoE; each front running the attention when asked (the dense
      // program merges layer 0's like the MoE programs).
      if (attention) {
        EXPECT_NE(batch.err.find("4 running the attention"), std::string::npos) << batch.err.substr(0, 2000);
      }
    }
    // With NUCLEUS_DECODE_PROGRAM_ATTENTION=1 the fronts of the MoE layers run the attention (attrs "attends").
    EXPECT_EQ(batch.err.find(" attends") != std::string::npos, attention) << env << ": the attention";
    // The MoE programs merge the attention's splits and apply W_UV (attrs "+attention output").
    EXPECT_EQ(batch.err.find("+attention output") != std::string::npos, attention_output)
        << env << ": the attention output";
    std::vector<std::vector<int>> got;
    for (const json& line : json_lines(batch.out)) got.push_back(line["token_ids"]);
    expect_reference(cases, got, std::string(env) + " batch");
    // At most 5 sequences a step: graph sizes 1, 2, 4, 5; a 5-row step runs a program of width 8 on 5 rows
    // (3 pad rows the kernel must not touch), the 3 left over one of width 4 on 3.
    RunResult five = run(base + " --max-num-seqs 5 --prompts " + dir + "/prompts.jsonl", env, dir);
    ASSERT_EQ(five.status, 0) << five.err;
    got.clear();
    for (const json& line : json_lines(five.out)) got.push_back(line["token_ids"]);
    expect_reference(cases, got, std::string(env) + " at most 5 a step");
    RunResult wide = run(base + " --prompts " + dir + "/twice.jsonl", env, dir);
    ASSERT_EQ(wide.status, 0) << wide.err;
    got.clear();
    for (const json& line : json_lines(wide.out)) got.push_back(line["token_ids"]);
    expect_reference(cases, got, std::string(env) + " 16 rows");
    got.clear();
    for (size_t i = 0; i < cases.size(); ++i) {
      std::ofstream(dir + "/one.jsonl") << json{{"prompt_token_ids", cases[i]["prompt_token_ids"]}}.dump() << "\n";
      RunResult one = run(base + " --prompts " + dir + "/one.jsonl", env, dir);
      ASSERT_EQ(one.status, 0) << one.err;
      got.push_back(json_lines(one.out).at(0)["token_ids"]);
    }
    expect_reference(cases, got, std::string(env) + " single");
  }
}

TEST(GpuDecodeProgram, MoeBlocksOnAndOffAgreeWithTheReference) { check_programs("tiny-dsv3"); }

// Programs under MTP speculative decoding with one sequence at a time: verify
// steps of up to 3 rows run as decode rows, wider than the attention's scratch
// of max_num_seqs rows (the model sizes it for the widest program); greedy
// tokens still equal the references.
TEST(GpuDecodeProgram, WithMtpSpeculativeDecoding) {
  ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device";
  std::ifstream in(testing::model_path("ref/cases.json"));
  const json cases = json::parse(in)["tiny-dsv3"];
  const std::string dir = testing::make_temp_dir("nucleus_programs_mtp");
  {
    std::ofstream f(dir + "/prompts.jsonl");
    for (const json& c : cases) f << json{{"prompt_token_ids", c["prompt_token_ids"]}}.dump() << "\n";
  }
  RunResult r = run("generate --device cuda --model " + testing::model_path("tiny-dsv3") +
                        " --max-tokens 32 --ignore-eos --temperature 0 --json --max-num-seqs 1 --speculative-config "
                        "'{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 2}' --prompts " +
                        dir + "/prompts.jsonl",
                    "NUCLEUS_DECODE_PROGRAMS=1", dir);
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<std::vector<int>> got;
  for (const json& line : json_lines(r.out)) got.push_back(line["token_ids"]);
  expect_reference(cases, got, "programs with MTP, one sequence at a time");
}

TEST(GpuDecodeProgram, Fp8ModelOnAndOffAgreeWithTheReference) { check_programs("tiny-dsv3-fp8"); }

}  // namespace
}  // namespace nucleus
