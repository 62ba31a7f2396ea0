// `nucleus generate` end to end: the binary on the shipped tiny model.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint_files.h"
#include "core/knobs.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

struct RunResult {
  int status = -1;
  std::string out;
};

std::string binary() {
  const char* bin = std::getenv("NUCLEUS_BIN");
  return bin ? bin : "";
}

// Runs the binary; stdout only, or stdout and stderr together.
// `env`: VAR=VALUE assignments for the command (e.g. "NUCLEUS_FORCE_KERNEL=...").
RunResult run(const std::string& args, bool with_stderr = false, const std::string& env = "") {
  std::string cmd = (env.empty() ? "" : "env " + env + " ") + binary() + " " + args +
                    (with_stderr ? " 2>&1" : " 2>/dev/null");
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

json ref_cases() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  return json::parse(in);
}

std::vector<json> json_lines(const std::string& s) {
  std::vector<json> out;
  std::stringstream ss(s);
  std::string line;
  while (std::getline(ss, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

TEST(CliTest, GenerateJsonLinesMatchReference) {
  json cases = ref_cases()["tiny-dsv3"];
  const std::string dir = testing::make_temp_dir("nucleus_cli");
  const std::string file = dir + "/prompts.jsonl";
  {
    std::ofstream f(file);
    f << json{{"prompt", cases[0]["prompt"]}}.dump() << "\n";
    f << json{{"prompt_token_ids", cases[1]["prompt_token_ids"]}}.dump() << "\n";
    f << json{{"prompt", cases[6]["prompt"]}}.dump() << "\n";
  }
  RunResult r = run("generate --device cpu --model " + testing::model_path("tiny-dsv3") + " --prompts " + file +
                    " --max-tokens 32 --ignore-eos --json");
  ASSERT_EQ(r.status, 0) << r.out;
  auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 3u);
  const int idx[3] = {0, 1, 6};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(lines[i]["prompt_token_ids"], cases[idx[i]]["prompt_token_ids"]) << i;
    EXPECT_EQ(lines[i]["token_ids"], cases[idx[i]]["greedy_token_ids"]) << i;
    EXPECT_EQ(lines[i]["text"], cases[idx[i]]["greedy_text"]) << i;
    EXPECT_EQ(lines[i]["finish_reason"], "length") << i;
  }
}

TEST(CliTest, SeededSamplingIsRepeatable) {
  const std::string args = "generate --device cpu --model " + testing::model_path("tiny-dsv3") +
                           " --prompt 'import os' --max-tokens 16 --temperature 0.8 --top-p 0.9 --top-k 50 "
                           "--seed 7 --ignore-eos --json";
  RunResult a = run(args), b = run(args);
  ASSERT_EQ(a.status, 0);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(json_lines(a.out)[0]["token_ids"].size(), 16u);
}

// vLLM's sampling flags reach the sampler: a +100 bias forces its token,
// --min-tokens holds back a biased EOS (id 1), --min-p 1 samples greedily,
// the penalties change the greedy continuation.
TEST(CliTest, SamplingFlagsAreHonoured) {
  json cases = ref_cases()["tiny-dsv3"];
  const std::string dir = testing::make_temp_dir("nucleus_cli_sampling");
  std::ofstream(dir + "/p.jsonl") << json{{"prompt_token_ids", cases[0]["prompt_token_ids"]}}.dump() << "\n";
  const std::string base = "generate --device cpu --model " + testing::model_path("tiny-dsv3") + " --prompts " + dir +
                           "/p.jsonl --json --max-tokens 12 ";
  auto tokens = [&](const std::string& flags) {
    RunResult r = run(base + flags);
    EXPECT_EQ(r.status, 0) << flags << "\n" << r.out;
    auto lines = json_lines(r.out);
    return lines.empty() ? json() : lines[0]["token_ids"];
  };
  const json greedy = tokens("--ignore-eos");
  ASSERT_EQ(greedy.size(), 12u);
  EXPECT_EQ(tokens("--ignore-eos --logit-bias 42:100"), json(std::vector<int>(12, 42)));
  EXPECT_EQ(tokens("--logit-bias 1:100"), json({1}));
  const json held = tokens("--logit-bias 1:100 --min-tokens 4");
  ASSERT_EQ(held.size(), 5u);
  EXPECT_EQ(held[4], 1);
  EXPECT_EQ(tokens("--ignore-eos --temperature 1.5 --seed 3 --min-p 1"), greedy);
  EXPECT_NE(tokens("--ignore-eos --repetition-penalty 3"), greedy);
  EXPECT_NE(tokens("--ignore-eos --presence-penalty 2 --frequency-penalty 2"), greedy);
}

// --skip-tokenizer-init: token ids in, token ids out, the same ids as with
// the tokenizer.
TEST(CliTest, SkipTokenizerInitTakesAndGivesTokenIds) {
  const std::string dir = testing::make_temp_dir("nucleus_cli_ids");
  std::ofstream(dir + "/ids.jsonl") << "{\"prompt_token_ids\": [0, 1263, 2521]}\n";
  const std::string base = "generate --device cpu --model " + testing::model_path("tiny-dsv3") + " --prompts " + dir +
                           "/ids.jsonl --max-tokens 6 --json";
  RunResult with = run(base), without = run(base + " --skip-tokenizer-init");
  ASSERT_EQ(with.status, 0) << with.out;
  ASSERT_EQ(without.status, 0) << without.out;
  const json a = json_lines(with.out)[0], b = json_lines(without.out)[0];
  EXPECT_EQ(a["token_ids"], b["token_ids"]);
  EXPECT_TRUE(a.contains("text"));
  EXPECT_FALSE(b.contains("text"));
  RunResult text = run("generate --device cpu --model " + testing::model_path("tiny-dsv3") +
                           " --prompt hi --skip-tokenizer-init",
                       true);
  EXPECT_EQ(text.status, 2) << text.out;
  EXPECT_NE(text.out.find("prompt_token_ids"), std::string::npos) << text.out;
}

// A Kimi-K2 style directory (tiktoken.model, no tokenizer.json) loads its
// tokenizer: text prompts are encoded with the ranks and Kimi's special ids.
TEST(CliTest, TiktokenModelDirectoryTakesTextPrompts) {
  testing::ModelCopy m("tiny-dsv3");
  std::filesystem::remove(m.dir() + "/tokenizer.json");
  std::string ranks;
  for (int b = 0; b < 256; ++b) {
    // base64 of one byte: two characters of the alphabet, then "==".
    static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    ranks += std::string{kAlphabet[b >> 2], kAlphabet[(b & 3) << 4], '=', '='} + " " + std::to_string(b) + "\n";
  }
  ranks += "aGk= 256\n";  // "hi"
  testing::write_file(m.dir() + "/tiktoken.model", ranks);
  testing::write_file(m.dir() + "/tokenizer_config.json",
                      R"({"added_tokens_decoder": {"258": {"content": "<|im_end|>", "special": true}},
                          "eos_token": "<|im_end|>"})");
  const std::string args =
      "generate --device cpu --model " + m.dir() + " --prompt 'hi<|im_end|>hi!' --max-tokens 4 --json";
  RunResult r = run(args);
  ASSERT_EQ(r.status, 0) << run(args, true).out;
  auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  EXPECT_EQ(lines[0]["prompt_token_ids"], json({256, 258, 256, 33}));
  EXPECT_TRUE(lines[0].contains("text"));
}

TEST(CliTest, RefusedPromptGetsErrorLineOthersFinish) {
  const std::string dir = testing::make_temp_dir("nucleus_cli");
  const std::string file = dir + "/prompts.jsonl";
  {
    std::ofstream f(file);
    f << R"({"prompt": "def f(x):"})" << "\n";
    f << R"({"prompt_token_ids": [0, 99999]})" << "\n";
  }
  RunResult r = run("generate --device cpu --prompts " + file + " --max-tokens 4 --json");
  EXPECT_EQ(r.status, 1);
  auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["token_ids"].size(), 4u);
  ASSERT_TRUE(lines[1].contains("error"));
  EXPECT_NE(lines[1]["error"].get<std::string>().find("vocabulary"), std::string::npos);
}

// A NaN weight fails the load (exit 1, the tensor named) unless
// --skip-weight-check: then the model loads and runs.
TEST(CliTest, NanWeightFailsTheLoadUnlessTheCheckIsSkipped) {
  testing::ModelCopy m("tiny-dsv3");
  const std::string name = "model.embed_tokens.weight";  // [4096, 256]: a short prompt never reads row 4095
  m.edit_shard_of(name, [&](std::vector<testing::StTensor>& ts) {
    testing::StTensor* t = testing::find(ts, name);
    ASSERT_NE(t, nullptr);
    t->bytes[(4095 * 256 + 9) * 2] = '\xc0';  // bf16 0x7fc0, little-endian
    t->bytes[(4095 * 256 + 9) * 2 + 1] = '\x7f';
  });
  const std::string args = "generate --device cpu --model " + m.dir() + " --prompt 'def f' --max-tokens 2";
  RunResult refused = run(args, true);
  EXPECT_EQ(refused.status, 1) << refused.out;
  EXPECT_NE(refused.out.find("tensor '" + name + "' holds nan at element [4095, 9]"), std::string::npos)
      << refused.out;
  RunResult skipped = run(args + " --skip-weight-check", true);
  EXPECT_EQ(skipped.status, 0) << skipped.out;
  EXPECT_EQ(skipped.out.find("weight check"), std::string::npos) << skipped.out;
  RunResult clean = run("generate --device cpu --model " + testing::model_path("tiny-dsv3") +
                            " --prompt 'def f' --max-tokens 2",
                        true);
  EXPECT_EQ(clean.status, 0) << clean.out;
  EXPECT_NE(clean.out.find("weight check: "), std::string::npos) << clean.out;  // the log line with its time
}

TEST(CliTest, BinaryIsThere) {
  ASSERT_FALSE(binary().empty()) << "NUCLEUS_BIN is not set (run through ctest)";
  RunResult r = run("--help");  // asked for: on stdout, exit 0
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("generate"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--help-env"), std::string::npos) << r.out;
  RunResult none = run("");  // a usage error: on stderr, exit 2
  EXPECT_EQ(none.status, 2);
  EXPECT_EQ(none.out.find("generate"), std::string::npos) << none.out;
}

// `nucleus --help-env` prints the switch registry (core/knobs.cpp) on stdout and exits 0.
TEST(CliTest, HelpEnvListsEverySwitch) {
  RunResult r = run("--help-env");
  EXPECT_EQ(r.status, 0) << r.out;
  for (const KnobInfo& k : all_knobs()) {
    const size_t at = r.out.find(std::string(k.name) + "  ");
    ASSERT_NE(at, std::string::npos) << k.name << " missing from:\n" << r.out;
    EXPECT_NE(r.out.find(std::string("default: ") + k.default_value, at), std::string::npos) << k.name;
  }
}

// A misspelt switch is ignored, but not silently: the CLI names it and the
// switch it is nearest to, and the run goes on (exit 0, the same tokens).
TEST(CliTest, UnknownEnvSwitchIsNamedWithTheNearestOne) {
  const std::string args = "generate --device cpu --model " + testing::model_path("tiny-dsv3") +
                           " --prompt 'The capital of France' --max-tokens 4 --temperature 0";
  const RunResult plain = run(args);
  const RunResult typo = run(args, true, "NUCLEUS_FUSE_KV_A_NROM=0");
  ASSERT_EQ(plain.status, 0) << plain.out;
  EXPECT_EQ(typo.status, 0) << typo.out;
  EXPECT_NE(typo.out.find("warning: NUCLEUS_FUSE_KV_A_NROM is not a nucleus environment switch and is ignored "
                          "(did you mean NUCLEUS_FUSE_KV_A_NORM?)"),
            std::string::npos)
      << typo.out;
  EXPECT_NE(typo.out.find(plain.out), std::string::npos) << "the same output:\n" << plain.out << "\n" << typo.out;
  const RunResult clean = run(args, true);
  EXPECT_EQ(clean.out.find("is not a nucleus environment switch"), std::string::npos) << clean.out;
}

// `nucleus prebuild-kernels` compiles width builds with NVRTC on a machine
// without a GPU (this one): two small widths, fused and lean, land in the
// cache; a second run finds them there. Skipped in a build without CUDA.
TEST(CliTest, PrebuildKernelsFillsTheCacheWithoutAGpu) {
  const std::string dir = testing::make_temp_dir("nucleus_prebuild");
  const std::string args = "prebuild-kernels --cuda-graph-sizes 1,2 -j 2 --cache-dir " + dir + "/kernels";
  RunResult first = run(args, true);
  if (first.status == 1 && first.out.find("no CUDA support") != std::string::npos) GTEST_SKIP() << first.out;
  ASSERT_EQ(first.status, 0) << first.out;
  EXPECT_NE(first.out.find("4 compiled, 0 already cached, 0 failed"), std::string::npos) << first.out;
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/kernels")) {
    EXPECT_EQ(e.path().extension(), ".nwb") << e.path();
    ++entries;
  }
  EXPECT_EQ(entries, 4);
  RunResult second = run(args, true);
  ASSERT_EQ(second.status, 0) << second.out;
  EXPECT_NE(second.out.find("0 compiled, 4 already cached, 0 failed"), std::string::npos) << second.out;
  EXPECT_EQ(run("prebuild-kernels --variants bogus", true).status, 2);
  // A cache that cannot be written is refused before anything compiles.
  std::ofstream(dir + "/a_file") << "x";
  RunResult bad = run("prebuild-kernels --cuda-graph-sizes 512 --cache-dir " + dir + "/a_file", true);
  EXPECT_EQ(bad.status, 2) << bad.out;
  EXPECT_NE(bad.out.find(dir + "/a_file"), std::string::npos) << bad.out;
  EXPECT_EQ(bad.out.find("compiled"), std::string::npos) << bad.out;
  EXPECT_EQ(run("prebuild-kernels --cache-dir ''", true).status, 2);
}

// bench latency on the CPU backend: the table, without the H200 roofline columns.
TEST(CliTest, BenchLatencyOnTheCpuShowsNoGpuRoofline) {
  RunResult r = run("bench latency --device cpu --model " + testing::model_path("tiny-dsv3") +
                        " --batch-sizes 1 --input-len 8 --output-len 2",
                    true);
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("not shown for the cpu backend"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("%\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("width builds: not used"), std::string::npos) << r.out;
  // A batch whose KV rows do not fit the cache is refused before it runs
  // (it used to abort when the scheduler preempted part of it).
  for (const char* batch : {"300", "99999999999"}) {
    r = run("bench latency --device cpu --model " + testing::model_path("tiny-dsv3") + " --batch-sizes " + batch +
                " --input-len 16 --output-len 4",
            true);
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.out.find(std::string("batch ") + batch + ": the KV cache holds"), std::string::npos) << r.out;
  }
  r = run("bench latency --device cpu --model " + testing::model_path("tiny-dsv3") +
              " --batch-sizes 16 --input-len 64 --output-len 8 --num-kv-blocks 8",
          true);
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("the KV cache holds 8 blocks"), std::string::npos) << r.out;
  // Prompts that take many chunked-prefill steps (16 x 256 tokens at 64 a
  // step): the requests that finish theirs first decode meanwhile, and must
  // still be running when the timed decode steps start (they used to reach
  // max_tokens first: "a decode step served 6 of the 16 sequences").
  r = run("bench latency --device cpu --model " + testing::model_path("tiny-dsv3") +
              " --batch-sizes 16 --input-len 256 --output-len 4 --max-num-batched-tokens 64 --num-kv-blocks 128",
          true);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out.find("a decode step served"), std::string::npos) << r.out;
}

// bench latency's output on the CPU: its main table's rows and those of the
// table whose header ends with `extra_header_end`, each stream past its header.
struct BenchTables {
  std::istringstream main, extra;
};
BenchTables bench_tables(const std::string& out, const std::string& extra_header_end) {
  BenchTables t{std::istringstream(out.substr(out.find("%4.58TB/s"))),
                std::istringstream(out.substr(out.find(extra_header_end)))};
  std::string line;
  std::getline(t.main, line);  // the headers' ends
  std::getline(t.extra, line);
  return t;
}

// One row of the main table (the CPU's: "-" in the roofline columns).
struct MainRow {
  long long input = 0, batch = 0, experts = 0;
  double prefill_ms = 0, prefill_tps = 0, decode_ms = 0, decode_tps = 0, gb = 0;
};
bool read_main_row(std::istream& in, MainRow* r) {
  const bool ok = static_cast<bool>(in >> r->input >> r->batch >> r->prefill_ms >> r->prefill_tps >> r->decode_ms >>
                                    r->decode_tps >> r->experts >> r->gb);
  std::string rest;
  std::getline(in, rest);  // the roofline dashes
  return ok;
}

// bench latency --host-profile: a row a (input, batch) whose phases are
// non-negative and add up to the step, which is the decode_ms the main table
// reports (the bench's clock around the same steps; 10% and 0.2 ms slack for
// the clock reads outside the phases).
TEST(CliTest, BenchLatencyHostProfileAddsUpToTheDecodeStep) {
  RunResult r = run("bench latency --device cpu --model " + testing::model_path("tiny-dsv3") +
                        " --batch-sizes 1,3 --input-len 8 --output-len 6 --host-profile",
                    true);
  ASSERT_EQ(r.status, 0) << r.out;
  ASSERT_NE(r.out.find("step_us"), std::string::npos) << r.out;
  BenchTables t = bench_tables(r.out, "step_us");
  for (int batch : {1, 3}) {
    MainRow m;
    ASSERT_TRUE(read_main_row(t.main, &m)) << r.out;
    const double decode_ms = m.decode_ms;
    long long input, b;
    double phase[5], step_us;
    ASSERT_TRUE(t.extra >> input >> b >> phase[0] >> phase[1] >> phase[2] >> phase[3] >> phase[4] >> step_us)
        << r.out;
    EXPECT_EQ(b, batch);
    EXPECT_EQ(m.batch, batch);
    double sum = 0;
    for (double p : phase) {
      EXPECT_GE(p, 0.0) << r.out;
      sum += p;
    }
    EXPECT_NEAR(sum, step_us, 0.5) << r.out;  // printed to 0.1 us
    EXPECT_GT(phase[2], 0.0) << "the forward pass takes time: " << r.out;
    EXPECT_LE(step_us, decode_ms * 1e3 * 1.001 + 1.0) << r.out;
    EXPECT_GE(step_us, decode_ms * 1e3 * 0.9 - 200.0) << r.out;
  }
  // Speculative steps are not profiled: the combination is refused (it used to drop the table silently).
  r = run("bench latency --device cpu --model " + testing::model_path("tiny-dsv3") +
              " --batch-sizes 1 --input-len 8 --output-len 4 --host-profile --speculative-config "
              "'{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}'",
          true);
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--host-profile measures plain decode steps"), std::string::npos) << r.out;
}

// bench latency with MTP drafts: decode_tok/s counts the tokens the verify
// steps produced (between 1 and k + 1 a sequence a step, above 1 once drafts
// are accepted), and the acceptance is given per row.
TEST(CliTest, BenchLatencyWithDraftsCountsTokens) {
  RunResult r = run("bench latency --device cpu --model " + testing::model_path("tiny-dsv3") +
                        " --batch-sizes 1,2 --input-len 8 --output-len 12 --speculative-config "
                        "'{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 2}'",
                    true);
  ASSERT_EQ(r.status, 0) << r.out;
  ASSERT_NE(r.out.find("tok/s_per_user"), std::string::npos) << r.out;
  BenchTables t = bench_tables(r.out, "tok/s_per_user");
  std::istringstream& spec_rows = t.extra;
  for (int batch : {1, 2}) {
    MainRow m;
    ASSERT_TRUE(read_main_row(t.main, &m)) << r.out;
    const double decode_ms = m.decode_ms, decode_tps = m.decode_tps;
    long long input, b;
    EXPECT_EQ(m.batch, batch);
    double d_ms, verify_ms, mtp_ms, per_user;
    std::string acceptance;
    ASSERT_TRUE(spec_rows >> input >> b >> d_ms >> verify_ms >> mtp_ms >> acceptance >> per_user) << r.out;
    const double accepted = acceptance == "n/a" ? 0.0 : std::stod(acceptance.substr(0, acceptance.size() - 1));
    const double tokens_per_seq_step = decode_tps * decode_ms / 1e3 / batch;
    EXPECT_GE(tokens_per_seq_step, 0.999) << r.out;
    EXPECT_LE(tokens_per_seq_step, 3.001) << r.out;
    if (accepted > 0) {
      EXPECT_GT(tokens_per_seq_step, 1.0) << r.out;
    }
    EXPECT_NEAR(per_user * batch, decode_tps, 0.01 * decode_tps + 1) << r.out;
  }
}

// A tokenizer whose ids reach past config.json's vocab_size is refused at
// load, naming the token (before, a prompt holding it failed at request time
// and the model's own id for it decoded to nothing).
TEST(CliTest, TokenizerIdPastVocabSizeIsRefusedAtLoad) {
  namespace fs = std::filesystem;
  const std::string dir = testing::make_temp_dir("nucleus_tok_vocab");
  for (const auto& de : fs::directory_iterator(testing::model_path("tiny-dsv3")))
    fs::create_symlink(de.path(), fs::path(dir) / de.path().filename());
  nlohmann::json tok;
  std::ifstream(testing::model_path("tiny-dsv3/tokenizer.json")) >> tok;
  tok["added_tokens"].push_back({{"id", 5000}, {"content", "<extra>"}, {"single_word", false}, {"lstrip", false},
                                 {"rstrip", false}, {"normalized", false}, {"special", true}});
  fs::remove(fs::path(dir) / "tokenizer.json");
  std::ofstream(dir + "/tokenizer.json") << tok.dump();
  RunResult r = run("generate --device cpu --max-tokens 2 --model " + dir, true);
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("the tokenizer's token '<extra>' has id 5000, outside config.json's vocab_size 4096"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("weight check"), std::string::npos) << "refused after the weights were read\n" << r.out;
}

// generation_config.json's eos_token_id list stops generation, as in Hugging
// Face's generate() and vLLM (it was never read): the second greedy token of
// a run, named there, ends the same run after it with "stop". A malformed
// file is refused naming it.
TEST(CliTest, GenerationConfigEosStopsGeneration) {
  namespace fs = std::filesystem;
  auto first_line = [](const std::string& out) { return nlohmann::json::parse(out.substr(0, out.find('\n'))); };
  const std::string base_args = "generate --device cpu --prompt hi --max-tokens 6 --json --model ";
  RunResult r = run(base_args + testing::model_path("tiny-dsv3"));
  ASSERT_EQ(r.status, 0) << r.out;
  const auto base = first_line(r.out)["token_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(base.size(), 6u);
  ASSERT_NE(base[1], 1) << "the tiny model's eos";
  const std::string dir = testing::make_temp_dir("nucleus_gen_eos");
  for (const auto& de : fs::directory_iterator(testing::model_path("tiny-dsv3")))
    if (de.path().filename() != "generation_config.json")
      fs::create_symlink(de.path(), fs::path(dir) / de.path().filename());
  std::ofstream(dir + "/generation_config.json") << "{\"eos_token_id\": [1, " << base[1] << "]}";
  r = run(base_args + dir);
  ASSERT_EQ(r.status, 0) << r.out;
  const auto got = first_line(r.out);
  EXPECT_EQ(got["token_ids"].get<std::vector<int32_t>>(), std::vector<int32_t>(base.begin(), base.begin() + 2));
  EXPECT_EQ(got["finish_reason"], "stop");
  std::ofstream(dir + "/generation_config.json") << "{\"eos_token_id\": \"two\"}";
  r = run(base_args + dir, true);
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("generation_config.json: eos_token_id must be an integer or a list of integers"),
            std::string::npos)
      << r.out;
}

TEST(CliTest, BadFlagsAndFilesAreErrorsNamingTheProblem) {
  struct Case {
    std::string args;
    int status;
    std::string message;
  };
  const std::string dir = testing::make_temp_dir("nucleus_cli");
  std::ofstream(dir + "/bad.jsonl") << "{not json\n";
  std::ofstream(dir + "/wide_id.jsonl") << "{\"prompt_token_ids\": [1, 4294967301]}\n";  // 2^32 + 5
  std::ofstream(dir + "/negative_id.jsonl") << "{\"prompt_token_ids\": [1, -4294967291]}\n";
  std::ofstream(dir + "/huge.jsonl") << "{\"prompt\": \"" << std::string(5 << 20, 'a') << "\"}\n";
  ASSERT_EQ(mkfifo((dir + "/fifo.jsonl").c_str(), 0600), 0);
  std::ofstream(dir + "/extra_key.jsonl") << "{\"prompt\": \"a\", \"max_tokens\": 6}\n";  // sampling is per run
  std::ofstream(dir + "/both.jsonl") << "{\"prompt\": \"a\", \"prompt_token_ids\": [5]}\n";
  std::vector<Case> cases = {
      {"generate --device cpu --temperature -1", 2, "temperature"},
      {"generate --device cpu --top-p 1.5", 2, "top_p"},
      {"generate --device cpu --model /nonexistent", 1, "/nonexistent"},
      {"generate --device tpu", 2, "--device"},  // a CLI11 validation error: usage errors exit 2
      {"bogus", 2, "unknown command 'bogus'"},
      {"generate --device cpu --prompts " + dir + "/bad.jsonl", 2, "bad.jsonl:1"},
      {"generate --device cpu --prompts " + dir + "/missing.jsonl", 2, "missing.jsonl"},
      {"generate --device cpu --prompts " + dir + "/wide_id.jsonl", 2, "4294967301, not a token id"},
      {"generate --device cpu --prompts " + dir + "/negative_id.jsonl", 2, "-4294967291, not a token id"},
      {"generate --device cpu --seed -1", 2, "--seed"},
      // Past int64: refused (it was clamped to the maximum, so every such seed gave one output).
      {"generate --device cpu --seed 99999999999999999999", 2, "a seed is an integer from 0 to 9223372036854775807"},
      {"generate --device cpu --prompts " + dir + "/extra_key.jsonl", 2, "extra_key.jsonl:1: unknown key \"max_tokens\""},
      {"generate --device cpu --prompts " + dir + "/both.jsonl", 2, "both.jsonl:1: both \"prompt\" and \"prompt_token_ids\""},
      {"bench serve --base-url http://127.0.0.1:1 --request-rate 1e-300", 2, "the longest mean interval is 86400 s"},
      {"generate --device cpu --presence-penalty 3", 2, "presence_penalty"},
      {"generate --device cpu --frequency-penalty -3", 2, "frequency_penalty"},
      {"generate --device cpu --repetition-penalty 0", 2, "repetition_penalty"},
      {"generate --device cpu --min-p 1.5", 2, "min_p"},
      {"generate --device cpu --min-tokens 100 --max-tokens 10", 2, "min_tokens"},
      {"generate --device cpu --logit-bias 42", 2, "--logit-bias '42'"},
      {"generate --device cpu --logit-bias 42:200", 2, "logit_bias"},
      {"generate --device cpu --prompts " + dir + "/fifo.jsonl", 2, "FIFO"},  // refused, never read forever
      {"generate --device cpu --prompts " + dir + "/huge.jsonl", 1, "encode to more than"},  // before encoding
      {"generate --device cpu --block-size 0", 2, "--block-size"},
      {"generate --device cpu --max-num-seqs 0", 2, "--max-num-seqs"},
      // Plain messages (CLI11's printed the range's 309-digit upper end).
      {"generate --device cpu --max-num-batched-tokens 0", 2, "--max-num-batched-tokens: must be > 0, got 0"},
      {"generate --device cpu --num-kv-blocks -1", 2, "--num-kv-blocks: must be >= 0, got -1"},
      {"generate --device cpu --gpu-memory-utilization 2", 2, "--gpu-memory-utilization"},
      {"generate --device cpu --num-kv-blocks 2000000000", 1, "GiB of host memory"},
      // A scheme the HTTP client does not speak is refused (it threw past main: std::terminate).
      {"bench serve --base-url ftp://127.0.0.1:1 --num-prompts 1", 2, "scheme 'ftp' is not supported"},
      {"bench serve --base-url ws://127.0.0.1:1 --num-prompts 1", 2, "scheme 'ws' is not supported"},
  };
  for (const auto& c : cases) {
    RunResult r = run(c.args, true);
    EXPECT_EQ(r.status, c.status) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.message), std::string::npos) << c.args << "\n" << r.out;
  }
  // A family no op has is an error, not silently ignored.
  RunResult r = run("generate --device cpu --max-tokens 2", true, "NUCLEUS_FORCE_KERNEL=linearr=cpu_ref");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("no kernel family 'linearr'"), std::string::npos) << r.out;
  // A malformed NUCLEUS_TOKEN_GRAPH_SIZES is refused on the CPU too (token graphs are CUDA's).
  r = run("generate --device cpu --max-tokens 2", true, "NUCLEUS_TOKEN_GRAPH_SIZES=1,x");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("NUCLEUS_TOKEN_GRAPH_SIZES: 'x' is not a positive integer"), std::string::npos) << r.out;
  // An empty item or a size past int64 (strtoll clamped it) is refused too.
  for (const char* bad : {"1,,2", "2,", "99999999999999999999"}) {
    r = run("generate --device cpu --max-tokens 2", true, std::string("NUCLEUS_TOKEN_GRAPH_SIZES=") + bad);
    EXPECT_EQ(r.status, 1) << bad << "\n" << r.out;
    EXPECT_NE(r.out.find("is not a positive integer"), std::string::npos) << bad << "\n" << r.out;
  }
  // A malformed NUCLEUS_MOE_DECODE is refused on any device (the kernel takes 1..16 tokens).
  for (const char* bad : {"17", "-1", "yes", "8x"}) {
    r = run("generate --device cpu --max-tokens 2", true, std::string("NUCLEUS_MOE_DECODE=") + bad);
    EXPECT_EQ(r.status, 1) << bad << "\n" << r.out;
    EXPECT_NE(r.out.find(std::string("NUCLEUS_MOE_DECODE='") + bad + "' is not auto, 0 or a token count 1..16"),
              std::string::npos)
        << r.out;
  }
  // So is a malformed NUCLEUS_MOE_UP_SPLIT_K (2..8 splits); auto and 0 run.
  for (const char* bad : {"9", "-2", "two", "16"}) {
    r = run("generate --device cpu --max-tokens 2", true, std::string("NUCLEUS_MOE_UP_SPLIT_K=") + bad);
    EXPECT_EQ(r.status, 1) << bad << "\n" << r.out;
    EXPECT_NE(r.out.find(std::string("NUCLEUS_MOE_UP_SPLIT_K='") + bad + "' is not auto, 0 or a split count 2..8"),
              std::string::npos)
        << r.out;
  }
  for (const char* good : {"auto", "0", "4"}) {
    r = run("generate --device cpu --max-tokens 2", true, std::string("NUCLEUS_MOE_UP_SPLIT_K=") + good);
    EXPECT_EQ(r.status, 0) << good << "\n" << r.out;
  }
  // The decode-kernel switches are refused before the weights are read (no
  // "weight check" line): a typo must not cost a model load.
  struct Bad {
    const char* env;
    const char* message;
  };
  for (const Bad& b : {Bad{"NUCLEUS_MLA_DECODE_KEY_TILE=48", "NUCLEUS_MLA_DECODE_KEY_TILE='48' is not auto, 32 or 64"},
                       Bad{"NUCLEUS_PDL=gemm", "NUCLEUS_PDL='gemm' is not 0, 1 or gemms"},
                       Bad{"NUCLEUS_MOE_DECODE=17", "NUCLEUS_MOE_DECODE='17'"},
                       // Integer switches read at a CUDA kernel's first launch (where a bad value
                       // threw or aborted) are refused here too, on any device.
                       Bad{"NUCLEUS_MOE_CHUNK_TOKENS=abc", "NUCLEUS_MOE_CHUNK_TOKENS='abc' is not an integer"},
                       Bad{"NUCLEUS_MOE_CHUNK_TOKENS=99999999999999999999",
                           "NUCLEUS_MOE_CHUNK_TOKENS='99999999999999999999' is not an integer"},
                       Bad{"NUCLEUS_FUSED_ALLREDUCE_MAX_BYTES=-1",
                           "NUCLEUS_FUSED_ALLREDUCE_MAX_BYTES='-1' is not a non-negative integer"},
                       Bad{"NUCLEUS_CUDA_POISON_ALLOCS=0x100", "NUCLEUS_CUDA_POISON_ALLOCS='0x100' is not 0, 1 or a byte"},
                       Bad{"NUCLEUS_PROFILE_OPS=nodes", "NUCLEUS_PROFILE_OPS='nodes' is not a flag value"}}) {
    r = run("generate --device cpu --max-tokens 2", true, b.env);
    EXPECT_EQ(r.status, 1) << b.env << "\n" << r.out;
    EXPECT_NE(r.out.find(b.message), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("weight check"), std::string::npos) << b.env << ": refused after the weights were read\n"
                                                             << r.out;
  }
  for (const char* good : {"NUCLEUS_MLA_DECODE_KEY_TILE=Auto", "NUCLEUS_PDL=gemms", "NUCLEUS_CUDA_POISON_ALLOCS=0x7e",
                           "NUCLEUS_MOE_CHUNK_TOKENS=0"}) {
    r = run("generate --device cpu --max-tokens 2", true, good);
    EXPECT_EQ(r.status, 0) << good << "\n" << r.out;
  }
}

}  // namespace
}  // namespace nucleus
