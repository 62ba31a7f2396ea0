// Speculative decoding with the MTP module on the CUDA backend
// (runtime/spec_decode.h): the module's draft logits against the PyTorch
// reference (mtp.safetensors in testing::mtp_dir()) within the numerical
// contract (1.5x the deviation the CPU reference's bf16 emulation shows,
// + 0.1); greedy outputs with MTP on (k = 1, 2, 3; the module's own drafts
// and an oracle drafter that makes runs of drafts accepted) agree with the
// reference up to the first near-tie (top-2 margin < 0.05), batched,
// chunked, from the prefix cache, under preemption, with decode graphs and
// eager. At tensor-parallel size 2 (when two GPUs are visible): the same
// contract for the draft logits, and greedy outputs with MTP on (k = 1, 2)
// agreeing with the reference as at TP = 1. The MTP input rows gathered on
// the device equal those through the host (NUCLEUS_MTP_DEVICE_HIDDEN).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <nlohmann/json.hpp>

#include "core/cuda/context.h"
#include "core/device.h"
#include "io/safetensors.h"
#include "runtime/llm_engine.h"
#include "runtime/model_executor.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using testing::ScopedEnvValue;

struct Case {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> margins;
};

std::vector<Case> load_cases() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  std::vector<Case> out;
  const json all = json::parse(in);
  for (const auto& c : all["tiny-dsv3"])
    out.push_back({c["prompt_token_ids"].get<std::vector<int32_t>>(), c["greedy_token_ids"].get<std::vector<int32_t>>(),
                   c["greedy_top2_margins"].get<std::vector<float>>()});
  return out;
}

std::unique_ptr<ModelExecutor> load(Device device, bool mtp, std::vector<int64_t> graphs = {},
                                    bool bf16_emulation = false, int tp = 1) {
  ModelOptions o;
  o.device = device;
  o.tensor_parallel_size = tp;
  o.load_mtp = mtp;
  o.cuda_graph_sizes = std::move(graphs);
  o.cpu_bf16_emulation = bf16_emulation;
  auto m = load_deepseek_model(testing::mtp_dir() + "/tiny-dsv3", o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// Draft logits of rows 0..n-1 (prompt + greedy tokens of the reference's prompt 0).
std::vector<float> draft_logits(ModelExecutor& m, const std::vector<int32_t>& tokens, int64_t n) {
  const int64_t L = static_cast<int64_t>(tokens.size()), H = m.config().hidden_size;
  const int64_t nb = (L + 15) / 16;
  KvCache kv = m.make_kv_cache(nb, 16), mkv = m.make_mtp_kv_cache(nb, 16);
  auto seq = [&](const std::vector<int32_t>& t, int64_t rows) { return testing::one_sequence_prefill(t, rows, nb); };
  NUCLEUS_CHECK_OK(m.forward(seq(tokens, L), kv).status());
  auto h = m.hidden_states();
  NUCLEUS_CHECK(h.ok(), "{}", h.status().to_string());
  Tensor hh = h->device() == Device::kCuda ? to_host(*h) : h->clone();
  Tensor hf = Tensor::empty({n, H}, DType::kF32);
  convert_to_f32(hh.raw(), hh.dtype(), hf.data<float>(), static_cast<size_t>(n * H));
  StepInputs mi = seq(std::vector<int32_t>(tokens.begin() + 1, tokens.end()), n);
  // TP = 1 on CUDA: a device tensor (as a caller may pass); a group: host
  // rows (each rank uploads them, as the proposer's are).
  mi.mtp_hidden = m.options().device == Device::kCuda && m.tensor_parallel_size() == 1 ? to_device(hf) : hf;
  auto l = m.mtp_forward(mi, mkv);
  NUCLEUS_CHECK(l.ok(), "{}", l.status().to_string());
  return std::vector<float>(l->data<float>(), l->data<float>() + l->numel());
}

class GpuMtpTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(cuda_available()) << "GPU tests need a CUDA device"; }
};

TEST_F(GpuMtpTest, DraftLogitsWithinTheNumericalContract) {
  auto f = SafetensorsFile::open(testing::mtp_reference_path());
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  auto get = [&](const std::string& name) {
    const TensorEntry& e = (*f)->tensors().at(name);
    return std::make_pair(e, e.data);
  };
  auto [te, tp] = get("tiny-dsv3.prompt0.tokens");
  std::vector<int32_t> tokens(te.shape[0]);
  std::memcpy(tokens.data(), tp, te.nbytes);
  auto [le, lp] = get("tiny-dsv3.prompt0.draft_logits");
  const int64_t rows = le.shape[0], V = le.shape[1];
  const float* ref = reinterpret_cast<const float*>(lp);
  auto dev = [&](const std::vector<float>& got) {
    double d = 0;
    for (int64_t i = 0; i < rows * V; ++i) d = std::max(d, static_cast<double>(std::fabs(got[i] - ref[i])));
    return d;
  };
  const double emulated = dev(draft_logits(*load(Device::kCpu, true, {}, true), tokens, rows));
  const double gpu = dev(draft_logits(*load(Device::kCuda, true), tokens, rows));
  std::printf("draft logits over %lld rows: max |GPU - ref| %.4f, max |CPU bf16 emulation - ref| %.4f\n",
              static_cast<long long>(rows), gpu, emulated);
  EXPECT_LE(gpu, 1.5 * emulated + 0.1);
}

struct RunOptions {
  int64_t k = 1;
  int64_t budget = 8192;
  int64_t blocks = 256;
  std::vector<int64_t> graphs = {1, 2, 4, 8};
  bool oracle = false;
  int tp = 1;
};

std::map<std::string, std::vector<int32_t>> run(const std::vector<Case>& cases, const RunOptions& r, EngineStats* stats,
                                                int passes = 1) {
  EngineConfig ec;
  ec.block_size = 16;
  ec.num_kv_blocks = r.blocks;
  ec.max_num_batched_tokens = r.budget;
  ec.max_num_seqs = 8;
  if (r.k > 0) ec.speculative = {"deepseek_mtp", r.k};
  auto made = LLMEngine::create(load(Device::kCuda, r.k > 0, r.graphs, false, r.tp), ec);
  NUCLEUS_CHECK(made.ok(), "{}", made.status().to_string());
  LLMEngine& e = **made;
  if (r.oracle)
    e.set_draft_hook([cases](const Sequence& seq, std::vector<int32_t>& drafts) {
      for (const auto& c : cases)
        if (c.prompt == seq.prompt_token_ids)
          for (size_t j = 0; j < drafts.size(); ++j) {
            const size_t at = seq.output_token_ids.size() + j;
            if (at >= c.greedy.size()) {
              drafts.resize(j);
              break;
            }
            drafts[j] = at % 5 == 0 ? (c.greedy[at] + 1) % 4096 : c.greedy[at];
          }
    });
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 32;
  sp.ignore_eos = true;
  std::map<std::string, std::vector<int32_t>> out;
  for (int pass = 0; pass < passes; ++pass) {  // later passes: from the prefix cache
    for (size_t i = 0; i < cases.size(); ++i)
      NUCLEUS_CHECK_OK(e.add_request(std::to_string(pass) + "_" + std::to_string(i), cases[i].prompt, sp));
    while (e.has_unfinished())
      for (const auto& o : e.step())
        out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  }
  if (stats) *stats = e.stats();
  return out;
}

void expect_agrees(const std::map<std::string, std::vector<int32_t>>& got, const std::vector<Case>& cases,
                   int passes = 1) {
  for (int pass = 0; pass < passes; ++pass)
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto& g = got.at(std::to_string(pass) + "_" + std::to_string(i));
      ASSERT_EQ(g.size(), cases[i].greedy.size());
      for (size_t s = 0; s < g.size() && cases[i].margins[s] >= 0.05f; ++s)
        EXPECT_EQ(g[s], cases[i].greedy[s]) << "pass " << pass << " prompt " << i << " step " << s;
    }
}

TEST_F(GpuMtpTest, GreedyMtpOnAgreesWithReference) {
  auto cases = load_cases();
  for (int64_t k = 0; k <= 3; ++k)
    for (bool oracle : {false, true}) {
      if (k == 0 && oracle) continue;
      SCOPED_TRACE("k " + std::to_string(k) + (oracle ? " oracle" : " mtp drafts"));
      EngineStats st;
      RunOptions r;
      r.k = k;
      r.oracle = oracle;
      expect_agrees(run(cases, r, &st, 2), cases, 2);  // second pass from the prefix cache
      EXPECT_GT(st.prefix_hit_tokens, 0);
      if (oracle) {
        EXPECT_GT(st.spec.num_accepted_tokens, 0);
      }
      if (k > 0)
        std::printf("k=%lld %s: %s\n", static_cast<long long>(k), oracle ? "oracle" : "mtp",
                    spec_decode_summary(st.spec).c_str());
    }
}

// ModelExecutor::gather_hidden_rows: on the device (auto) the rows of the
// target's hidden states (bf16) and of the MTP layer's output (f32) as f32
// on the GPU, equal bit for bit to the host path (0), repeated and
// out-of-order rows included, the buffer's 512 rows exceeded; a row outside
// the source refused.
TEST_F(GpuMtpTest, GatherHiddenRowsOnTheDeviceEqualsTheHostPath) {
  auto m = load(Device::kCuda, true);
  const std::vector<int32_t> tokens = {5, 17, 99, 3, 250, 4000, 12, 7};
  const int64_t L = static_cast<int64_t>(tokens.size());
  KvCache kv = m->make_kv_cache(1, 16), mkv = m->make_mtp_kv_cache(1, 16);
  const StepInputs in = testing::one_sequence_prefill(tokens, L, 1);
  ASSERT_TRUE(m->forward(in, kv).ok());
  auto target = m->hidden_states();
  ASSERT_TRUE(target.ok()) << target.status().to_string();
  const std::vector<int32_t> rows = {7, 0, 3, 3, 1};
  std::vector<int32_t> many(600);
  for (size_t i = 0; i < many.size(); ++i) many[i] = static_cast<int32_t>((i * 5) % L);
  auto both = [&](const Tensor& source, const std::vector<int32_t>& r) {
    std::vector<float> got[2];
    for (int device = 0; device < 2; ++device) {
      ScopedEnvValue env("NUCLEUS_MTP_DEVICE_HIDDEN", device ? nullptr : "0");
      auto g = m->gather_hidden_rows(source, r);
      EXPECT_TRUE(g.ok()) << g.status().to_string();
      if (!g.ok()) return;
      EXPECT_EQ(g->device(), device ? Device::kCuda : Device::kCpu);
      EXPECT_EQ(g->dtype(), DType::kF32);
      EXPECT_EQ(g->dim(0), static_cast<int64_t>(r.size()));
      Tensor h = g->device() == Device::kCuda ? to_host(*g) : *g;
      got[device].assign(h.data<float>(), h.data<float>() + h.numel());
    }
    EXPECT_EQ(got[0], got[1]);
    EXPECT_GT(got[0].size(), 0u);
  };
  EXPECT_EQ(target->dtype(), DType::kBF16);
  both(*target, rows);
  both(*target, many);
  // The MTP layer's own output (f32): one MTP step over the same rows.
  StepInputs mi = in;
  mi.token_ids.erase(mi.token_ids.begin());
  mi.token_ids.push_back(1);
  std::vector<int32_t> all(L);
  for (int64_t i = 0; i < L; ++i) all[i] = static_cast<int32_t>(i);
  auto h = m->gather_hidden_rows(*target, all);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  mi.mtp_hidden = *h;
  ASSERT_TRUE(m->mtp_forward_logits(mi, mkv).ok());
  auto own = m->mtp_hidden_states();
  ASSERT_TRUE(own.ok()) << own.status().to_string();
  EXPECT_EQ(own->dtype(), DType::kF32);
  both(*own, rows);
  for (int32_t bad : {-1, static_cast<int32_t>(L)}) {
    auto r = m->gather_hidden_rows(*target, {0, bad});
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("outside the source's"), std::string::npos) << r.status().to_string();
  }
}

// NUCLEUS_MTP_DEVICE_HIDDEN: the MTP module's input rows gathered on the
// device (auto) or through the host (0) are the same f32 rows, so the
// drafts, the acceptance and the outputs are identical (k = 1 and 3, with
// decode graphs and eager). Greedy outputs do not depend on the drafts;
// the acceptance counts do, and GatherHiddenRowsOnTheDeviceEqualsTheHostPath
// compares the rows themselves.
TEST_F(GpuMtpTest, DeviceHiddenRowsEqualHostRows) {
  auto cases = load_cases();
  for (int64_t k : {1, 3})
    for (bool graphs : {true, false}) {
      SCOPED_TRACE("k " + std::to_string(k) + (graphs ? " graphs" : " eager"));
      RunOptions r;
      r.k = k;
      if (!graphs) r.graphs = {};
      EngineStats on, off;
      std::map<std::string, std::vector<int32_t>> host, device;
      {
        ScopedEnvValue env("NUCLEUS_MTP_DEVICE_HIDDEN", "0");
        host = run(cases, r, &off);
      }
      {
        ScopedEnvValue env("NUCLEUS_MTP_DEVICE_HIDDEN", nullptr);
        device = run(cases, r, &on);
      }
      EXPECT_EQ(device, host);
      EXPECT_EQ(on.spec.num_draft_tokens, off.spec.num_draft_tokens);
      EXPECT_EQ(on.spec.num_accepted_tokens, off.spec.num_accepted_tokens);
      EXPECT_GT(on.spec.num_accepted_tokens, 0);
      expect_agrees(device, cases);
    }
}

TEST_F(GpuMtpTest, ChunkedPreemptedAndEager) {
  auto cases = load_cases();
  for (bool oracle : {false, true}) {
    SCOPED_TRACE(oracle ? "oracle" : "mtp drafts");
    EngineStats st;
    RunOptions r;
    r.k = 2;
    r.oracle = oracle;
    r.budget = 7;
    expect_agrees(run(cases, r, &st), cases);  // chunked prefill
    r.budget = 8192;
    r.blocks = 11;
    expect_agrees(run(cases, r, &st), cases);  // preemption
    EXPECT_GT(st.num_preemptions, 0);
    r.blocks = 256;
    r.graphs = {};
    expect_agrees(run(cases, r, &st), cases);  // every step eager
  }
}

TEST_F(GpuMtpTest, TensorParallelTwoAgreesWithReference) {
  constexpr int kTp = 2;
  if (cuda::device_count() < kTp) GTEST_SKIP() << "needs " << kTp << " GPUs (" << cuda::device_count() << " visible)";
  auto f = SafetensorsFile::open(testing::mtp_reference_path());
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  const TensorEntry& te = (*f)->tensors().at("tiny-dsv3.prompt0.tokens");
  std::vector<int32_t> tokens(te.shape[0]);
  std::memcpy(tokens.data(), te.data, te.nbytes);
  const TensorEntry& le = (*f)->tensors().at("tiny-dsv3.prompt0.draft_logits");
  const int64_t rows = le.shape[0], V = le.shape[1];
  const float* ref = reinterpret_cast<const float*>(le.data);
  auto dev = [&](const std::vector<float>& got) {
    double d = 0;
    for (int64_t i = 0; i < rows * V; ++i) d = std::max(d, static_cast<double>(std::fabs(got[i] - ref[i])));
    return d;
  };
  const double emulated = dev(draft_logits(*load(Device::kCpu, true, {}, true), tokens, rows));
  const double one = dev(draft_logits(*load(Device::kCuda, true), tokens, rows));
  const double two = dev(draft_logits(*load(Device::kCuda, true, {}, false, kTp), tokens, rows));
  std::printf("draft logits over %lld rows: max |GPU TP=2 - ref| %.4f, TP=1 %.4f, CPU bf16 emulation %.4f\n",
              static_cast<long long>(rows), two, one, emulated);
  EXPECT_LE(two, 1.5 * emulated + 0.1);
  auto cases = load_cases();
  for (int64_t k : {1, 2})
    for (bool oracle : {false, true}) {
      SCOPED_TRACE("TP 2, k " + std::to_string(k) + (oracle ? " oracle" : " mtp drafts"));
      EngineStats st;
      RunOptions r;
      r.k = k;
      r.oracle = oracle;
      r.tp = kTp;
      expect_agrees(run(cases, r, &st, 2), cases, 2);  // second pass from the prefix cache
      EXPECT_GT(st.spec.num_accepted_tokens, 0);
      std::printf("TP=2 k=%lld %s: %s\n", static_cast<long long>(k), oracle ? "oracle" : "mtp",
                  spec_decode_summary(st.spec).c_str());
    }
  RunOptions r;  // chunked and preempted, every step eager
  r.k = 2;
  r.tp = kTp;
  r.budget = 7;
  r.blocks = 11;
  r.graphs = {};
  EngineStats st;
  expect_agrees(run(cases, r, &st), cases);
  EXPECT_GT(st.num_preemptions, 0);
}

}  // namespace
}  // namespace nucleus
