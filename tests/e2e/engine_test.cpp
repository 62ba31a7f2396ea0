// LLMEngine on the CPU reference with tiny-dsv3: a request's greedy output
// does not depend on batching, chunking, the prefix cache or preemption
// (exactly, on the CPU), and equals the Hugging Face reference. Also the two
// attention forms agree, and a request too large for the pool is refused
// while the others finish.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "graph/step_graph.h"
#include "io/hf_config.h"
#include "model/weights.h"
#include "ops/basic_ops.h"
#include "ops/moe_ops.h"
#include "runtime/model_executor.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

struct RefCase {
  std::vector<int32_t> prompt;
  std::vector<int32_t> greedy;
};

std::vector<RefCase> ref_cases(const std::string& model) {
  std::ifstream in(testing::model_path("ref/cases.json"));
  json j = json::parse(in);
  std::vector<RefCase> out;
  for (const auto& c : j[model])
    out.push_back({c["prompt_token_ids"].get<std::vector<int32_t>>(), c["greedy_token_ids"].get<std::vector<int32_t>>()});
  return out;
}

std::unique_ptr<ModelExecutor> load(AttentionMode mode = AttentionMode::kAuto) {
  ModelOptions o;
  o.attention_mode = mode;
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// One step of a single sequence in blocks 0..15 of a 16-token-block cache:
// tokens [done, done + len) of `toks` at their positions, a logit row each.
StepInputs one_sequence_step(const std::vector<int32_t>& toks, int64_t done, int64_t len) {
  StepInputs in;
  for (int64_t i = 0; i < len; ++i) {
    in.token_ids.push_back(toks[done + i]);
    in.positions.push_back(static_cast<int32_t>(done + i));
    in.slot_mapping.push_back(done + i);
    in.logit_indices.push_back(static_cast<int32_t>(i));
  }
  in.query_start = {0, static_cast<int32_t>(len)};
  in.context_lens = {static_cast<int32_t>(done)};
  in.max_blocks_per_seq = 16;
  for (int b = 0; b < 16; ++b) in.block_tables.push_back(b);
  return in;
}

SamplingParams greedy(int n) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = n;
  p.ignore_eos = true;
  return p;
}

// Runs `prompts` (all added before the first step) to completion.
std::map<std::string, std::vector<int32_t>> run_all(LLMEngine& e, const std::vector<RefCase>& cases,
                                                   const std::string& tag) {
  for (size_t i = 0; i < cases.size(); ++i) {
    Status s = e.add_request(tag + std::to_string(i), cases[i].prompt, greedy(32));
    NUCLEUS_CHECK(s.ok(), "{}", s.to_string());
  }
  std::map<std::string, std::vector<int32_t>> out;
  while (e.has_unfinished())
    for (const auto& o : e.step())
      out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  return out;
}

EngineConfig small_config(int64_t budget, int64_t blocks = 256, int64_t block_size = 16) {
  EngineConfig c;
  c.block_size = block_size;
  c.num_kv_blocks = blocks;
  c.max_num_batched_tokens = budget;
  return c;
}

void expect_reference(const std::map<std::string, std::vector<int32_t>>& got, const std::vector<RefCase>& cases,
                      const std::string& tag) {
  for (size_t i = 0; i < cases.size(); ++i) {
    auto it = got.find(tag + std::to_string(i));
    ASSERT_NE(it, got.end()) << tag << i;
    EXPECT_EQ(it->second, cases[i].greedy) << tag << i;
  }
}

TEST(EngineTest, EachPromptAloneMatchesReference) {
  auto cases = ref_cases("tiny-dsv3");
  auto e = LLMEngine::create(load(), small_config(8192));
  ASSERT_TRUE(e.ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    auto got = run_all(**e, {cases[i]}, "alone" + std::to_string(i) + "_");
    EXPECT_EQ(got["alone" + std::to_string(i) + "_0"], cases[i].greedy) << i;
  }
}

TEST(EngineTest, BatchedAndChunkedMatchReference) {
  auto cases = ref_cases("tiny-dsv3");
  for (int64_t budget : {8192, 64, 7, 1}) {
    auto e = LLMEngine::create(load(), small_config(budget));
    ASSERT_TRUE(e.ok());
    auto got = run_all(**e, cases, "b");
    SCOPED_TRACE("budget " + std::to_string(budget));
    expect_reference(got, cases, "b");
  }
}

TEST(EngineTest, SecondRunServedFromPrefixCache) {
  auto cases = ref_cases("tiny-dsv3");
  auto e = LLMEngine::create(load(), small_config(8192));
  ASSERT_TRUE(e.ok());
  expect_reference(run_all(**e, cases, "first"), cases, "first");
  const int64_t hits_before = (*e)->stats().prefix_hit_tokens;
  expect_reference(run_all(**e, cases, "second"), cases, "second");
  const int64_t hits = (*e)->stats().prefix_hit_tokens - hits_before;
  int64_t expect_hits = 0;  // every full 16-token block except the one holding the last prompt token
  for (const auto& c : cases) expect_hits += (static_cast<int64_t>(c.prompt.size()) - 1) / 16 * 16;
  EXPECT_EQ(hits, expect_hits);
}

TEST(EngineTest, PreemptionDoesNotChangeOutputs) {
  auto cases = ref_cases("tiny-dsv3");
  // 11 blocks of 16 tokens: the longest request needs 10 (118 + 32 tokens), so
  // requests admitted together must preempt each other as they grow.
  auto e = LLMEngine::create(load(), small_config(8192, 11));
  ASSERT_TRUE(e.ok());
  expect_reference(run_all(**e, cases, "p"), cases, "p");
  EXPECT_GT((*e)->stats().num_preemptions, 0);
  EXPECT_EQ((*e)->stats().kv_blocks_used, 0);
}

TEST(EngineTest, RequestTooLargeForPoolIsRefusedOthersFinish) {
  auto cases = ref_cases("tiny-dsv3");
  auto e = LLMEngine::create(load(), small_config(8192, 8));  // 128 tokens
  ASSERT_TRUE(e.ok());
  Status s = (*e)->add_request("big", cases[3].prompt, greedy(32));  // 118 + 32 tokens
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("KV blocks"), std::string::npos) << s.message();
  auto got = run_all(**e, {cases[0], cases[6]}, "ok");
  EXPECT_EQ(got["ok0"], cases[0].greedy);
  EXPECT_EQ(got["ok1"], cases[6].greedy);
}

TEST(EngineTest, BadRequestsAreRefused) {
  auto e = LLMEngine::create(load(), small_config(8192));
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE((*e)->add_request("a", {}, greedy(4)).ok());
  Status s = (*e)->add_request("b", {0, 5000}, greedy(4));
  EXPECT_NE(s.message().find("vocabulary"), std::string::npos);
  s = (*e)->add_request("c", {0, 5}, greedy(2000));
  EXPECT_NE(s.message().find("maximum context length"), std::string::npos);
  ASSERT_TRUE((*e)->add_request("d", {0, 5}, greedy(4)).ok());
  EXPECT_FALSE((*e)->add_request("d", {0, 5}, greedy(4)).ok());  // duplicate id
  EXPECT_TRUE((*e)->abort("d"));
  EXPECT_FALSE((*e)->has_unfinished());
}

TEST(EngineTest, StopsOnEosUnlessIgnored) {
  auto e = LLMEngine::create(load(), small_config(8192));
  ASSERT_TRUE(e.ok());
  // Forcing EOS: make token 1 (EOS) a stop via stop_token_ids on a greedy run of
  // the first reference prompt whose 3rd greedy token we declare as the stop.
  auto cases = ref_cases("tiny-dsv3");
  SamplingParams p = greedy(32);
  p.stop_token_ids = {cases[0].greedy[2]};
  ASSERT_TRUE((*e)->add_request("s", cases[0].prompt, p).ok());
  std::vector<int32_t> out;
  FinishReason reason = FinishReason::kNone;
  while ((*e)->has_unfinished())
    for (const auto& o : (*e)->step()) {
      out.insert(out.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) reason = o.finish_reason;
    }
  EXPECT_EQ(reason, FinishReason::kStop);
  ASSERT_GE(out.size(), 1u);
  EXPECT_EQ(out.back(), cases[0].greedy[2]);
  EXPECT_LE(out.size(), 3u);
}

// Runs one request to completion: its tokens and finish reason.
std::pair<std::vector<int32_t>, FinishReason> run_one(LLMEngine& e, const std::vector<int32_t>& prompt,
                                                      const SamplingParams& p) {
  Status s = e.add_request("one", prompt, p);
  EXPECT_TRUE(s.ok()) << s.to_string();
  std::vector<int32_t> out;
  FinishReason reason = FinishReason::kNone;
  while (e.has_unfinished())
    for (const auto& o : e.step()) {
      out.insert(out.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) reason = o.finish_reason;
    }
  return {out, reason};
}

// vLLM's logit processors through the engine (tiny-dsv3, EOS id 1).
TEST(EngineTest, LogitBiasForcesAToken) {
  auto e = LLMEngine::create(load(), small_config(8192));
  ASSERT_TRUE(e.ok());
  auto cases = ref_cases("tiny-dsv3");
  SamplingParams p = greedy(8);
  p.logit_bias = {{42, 100.0f}};
  EXPECT_EQ(run_one(**e, cases[0].prompt, p).first, std::vector<int32_t>(8, 42));
  p.temperature = 1.0f;  // sampled rows too
  p.seed = 7;
  EXPECT_EQ(run_one(**e, cases[0].prompt, p).first, std::vector<int32_t>(8, 42));
  // An id past the vocabulary is refused, naming it.
  p.logit_bias = {{5000, 1.0f}};
  Status s = (*e)->add_request("bad", cases[0].prompt, p);
  EXPECT_NE(s.message().find("logit_bias token id 5000"), std::string::npos) << s.to_string();
}

TEST(EngineTest, MinTokensDelaysEos) {
  auto e = LLMEngine::create(load(), small_config(8192));
  ASSERT_TRUE(e.ok());
  auto cases = ref_cases("tiny-dsv3");
  SamplingParams p = greedy(16);
  p.ignore_eos = false;
  p.logit_bias = {{1, 100.0f}};  // EOS would be the first token
  auto [out, reason] = run_one(**e, cases[0].prompt, p);
  EXPECT_EQ(out, std::vector<int32_t>{1});
  EXPECT_EQ(reason, FinishReason::kStop);
  p.min_tokens = 5;
  std::tie(out, reason) = run_one(**e, cases[0].prompt, p);
  ASSERT_EQ(out.size(), 6u);
  for (int i = 0; i < 5; ++i) EXPECT_NE(out[i], 1) << i;
  EXPECT_EQ(out[5], 1);
  EXPECT_EQ(reason, FinishReason::kStop);
  // stop_token_ids are masked too.
  p.logit_bias = {{42, 100.0f}};
  p.stop_token_ids = {42};
  p.min_tokens = 3;
  std::tie(out, reason) = run_one(**e, cases[0].prompt, p);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_NE(out[2], 42);
  EXPECT_EQ(out[3], 42);
}

TEST(EngineTest, PenaltiesChangeGreedyOutput) {
  auto e = LLMEngine::create(load(), small_config(8192));
  ASSERT_TRUE(e.ok());
  auto cases = ref_cases("tiny-dsv3");
  for (size_t ci = 0; ci < 2; ++ci) {
    const auto& ref = cases[ci];
    // Neutral values: the reference.
    SamplingParams p = greedy(static_cast<int>(ref.greedy.size()));
    p.repetition_penalty = 1.0f;
    EXPECT_EQ(run_one(**e, ref.prompt, p).first, ref.greedy);
    p.repetition_penalty = 3.0f;
    const auto rep = run_one(**e, ref.prompt, p).first;
    EXPECT_NE(rep, ref.greedy) << "case " << ci;
    p.repetition_penalty = 1.0f;
    p.presence_penalty = 2.0f;
    p.frequency_penalty = 2.0f;
    const auto freq = run_one(**e, ref.prompt, p).first;
    EXPECT_NE(freq, ref.greedy) << "case " << ci;
    // Penalized output repeats less: count distinct tokens.
    auto distinct = [](std::vector<int32_t> v) {
      std::sort(v.begin(), v.end());
      return std::unique(v.begin(), v.end()) - v.begin();
    };
    EXPECT_GE(distinct(freq), distinct(ref.greedy)) << "case " << ci;
  }
}

TEST(EngineTest, MinPOneIsGreedy) {
  auto e = LLMEngine::create(load(), small_config(8192));
  ASSERT_TRUE(e.ok());
  auto cases = ref_cases("tiny-dsv3");
  SamplingParams p = greedy(static_cast<int>(cases[1].greedy.size()));
  p.temperature = 1.5f;
  p.min_p = 1.0f;  // only the most likely token survives
  p.seed = 3;
  EXPECT_EQ(run_one(**e, cases[1].prompt, p).first, cases[1].greedy);
}

// Expanded and absorbed attention agree on full prompts and on decode steps.
TEST(EngineTest, ExpandedAndAbsorbedAttentionAgree) {
  auto cases = ref_cases("tiny-dsv3");
  auto expanded = load(AttentionMode::kExpanded);
  auto absorbed = load(AttentionMode::kAbsorbed);
  float worst = 0;
  for (size_t ci = 0; ci < 3; ++ci) {
    std::vector<int32_t> toks = cases[ci].prompt;
    toks.insert(toks.end(), cases[ci].greedy.begin(), cases[ci].greedy.begin() + 4);
    KvCache kv_e = expanded->make_kv_cache(16, 16), kv_a = absorbed->make_kv_cache(16, 16);
    // Prefill the prompt, then decode the 4 greedy tokens one by one.
    const int64_t n = static_cast<int64_t>(cases[ci].prompt.size());
    int64_t done = 0;
    for (int64_t len : {n, int64_t{1}, int64_t{1}, int64_t{1}, int64_t{1}}) {
      const StepInputs in = one_sequence_step(toks, done, len);
      auto le = expanded->forward(in, kv_e);
      auto la = absorbed->forward(in, kv_a);
      ASSERT_TRUE(le.ok() && la.ok());
      for (int64_t i = 0; i < le->numel(); ++i)
        worst = std::max(worst, std::fabs(le->data<float>()[i] - la->data<float>()[i]));
      done += len;
    }
  }
  EXPECT_LT(worst, 1e-4);
  std::printf("expanded vs absorbed: max |logit difference| %.3g\n", worst);
}

// NUCLEUS_FUSE_KV_A_NORM: kv_a_layernorm inside the RoPE + cache-write op
// (default) or as its own RmsNormOp gives the same logits bit for bit on the
// CPU (the fused op calls the same reference) and the same greedy tokens; a
// malformed value refuses the model before its weights are read.
TEST(EngineTest, FusedKvANormEqualsItsOwnOp) {
  auto cases = ref_cases("tiny-dsv3");
  struct Env {
    explicit Env(const char* v) { setenv("NUCLEUS_FUSE_KV_A_NORM", v, 1); }
    ~Env() { unsetenv("NUCLEUS_FUSE_KV_A_NORM"); }
  };
  std::unique_ptr<ModelExecutor> fused, own;
  {
    Env e("1");
    fused = load();
  }
  {
    Env e("0");
    own = load();
  }
  for (size_t ci = 0; ci < 2; ++ci) {
    std::vector<int32_t> toks = cases[ci].prompt;
    toks.insert(toks.end(), cases[ci].greedy.begin(), cases[ci].greedy.begin() + 3);
    KvCache kv_f = fused->make_kv_cache(16, 16), kv_o = own->make_kv_cache(16, 16);
    const int64_t n = static_cast<int64_t>(cases[ci].prompt.size());
    int64_t done = 0;
    for (int64_t len : {n, int64_t{1}, int64_t{1}, int64_t{1}}) {
      const StepInputs in = one_sequence_step(toks, done, len);
      auto lf = fused->forward(in, kv_f);
      auto lo = own->forward(in, kv_o);
      ASSERT_TRUE(lf.ok() && lo.ok());
      ASSERT_EQ(lf->numel(), lo->numel());
      EXPECT_EQ(0, std::memcmp(lf->raw(), lo->raw(), static_cast<size_t>(lf->nbytes()))) << "case " << ci << " at " << done;
      done += len;
    }
  }
  {
    Env e("fused");
    ModelOptions o;
    auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find("NUCLEUS_FUSE_KV_A_NORM='fused'"), std::string::npos) << m.status().to_string();
  }
}

// NUCLEUS_MOE_FUSE_SHARED: decode steps run the shared experts as routed
// experts (ids E, E + 1, ... with weight 1 in the routed experts' op) instead
// of their own MLP. Prefill steps are the same ops either way; decode logits
// differ by float summation order only, and the greedy tokens are the same
// (with two pieces the prefill steps run them as two MLPs: summation order too).
// Checked on tiny-dsv3 (one shared expert: the whole MLP is one piece) and on
// a dummy model of the same shapes with n_shared_experts = 2 (two pieces a
// layer, each half of the shared MLP's intermediate units), at TP 1 and 2.
// A malformed value refuses the load.
struct FuseSharedEnv {
  explicit FuseSharedEnv(const char* v) { setenv("NUCLEUS_MOE_FUSE_SHARED", v, 1); }
  ~FuseSharedEnv() { unsetenv("NUCLEUS_MOE_FUSE_SHARED"); }
};

// Prefill the first n_prompt of `toks`, then decode `decode` more one at a
// time on both models; returns the largest |logit difference| of all steps;
// with exact_prefill also expects the prefill logits equal bit for bit.
float compare_decode_steps(ModelExecutor& a, ModelExecutor& b, const std::vector<int32_t>& toks, int64_t n_prompt,
                           int decode, bool exact_prefill) {
  KvCache kv_a = a.make_kv_cache(16, 16), kv_b = b.make_kv_cache(16, 16);
  float worst = 0;
  int64_t done = 0;
  std::vector<int64_t> lens = {n_prompt};
  for (int i = 0; i < decode; ++i) lens.push_back(1);
  for (int64_t len : lens) {
    const StepInputs in = one_sequence_step(toks, done, len);
    auto la = a.forward(in, kv_a);
    auto lb = b.forward(in, kv_b);
    EXPECT_TRUE(la.ok() && lb.ok());
    if (!la.ok() || !lb.ok()) return INFINITY;
    EXPECT_EQ(la->numel(), lb->numel());
    if (done == 0 && exact_prefill) {
      EXPECT_EQ(0, std::memcmp(la->raw(), lb->raw(), static_cast<size_t>(la->nbytes()))) << "prefill logits";
    }
    for (int64_t i = 0; i < la->numel(); ++i)
      worst = std::max(worst, std::fabs(la->data<float>()[i] - lb->data<float>()[i]));
    done += len;
  }
  return worst;
}

// compare_decode_steps over the first two reference cases of tiny-dsv3: each
// prompt prefilled, then 4 of its greedy tokens decoded one at a time.
float compare_first_cases(ModelExecutor& a, ModelExecutor& b, const std::vector<RefCase>& cases) {
  float worst = 0;
  for (size_t ci = 0; ci < 2; ++ci) {
    std::vector<int32_t> toks = cases[ci].prompt;
    toks.insert(toks.end(), cases[ci].greedy.begin(), cases[ci].greedy.begin() + 4);
    worst = std::max(worst, compare_decode_steps(a, b, toks, static_cast<int64_t>(cases[ci].prompt.size()), 4, true));
  }
  return worst;
}

TEST(EngineTest, FusedSharedExpertsEqualTheirOwnMlp) {
  auto cases = ref_cases("tiny-dsv3");
  std::unique_ptr<ModelExecutor> fused, own;
  {
    FuseSharedEnv e("1");
    fused = load();
  }
  {
    FuseSharedEnv e("0");
    own = load();
  }
  const float worst = compare_first_cases(*fused, *own, cases);
  EXPECT_LT(worst, 1e-4);
  std::printf("tiny-dsv3 fused vs own shared MLP: max |logit difference| %.3g\n", worst);
  // The engine's greedy tokens with the fused decode steps equal the reference.
  auto e = LLMEngine::create(std::move(fused), small_config(8192));
  ASSERT_TRUE(e.ok());
  auto got = run_all(**e, cases, "f");
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(got["f" + std::to_string(i)], cases[i].greedy) << "case " << i;
  {
    FuseSharedEnv bad("shared");
    ModelOptions o;
    auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find("NUCLEUS_MOE_FUSE_SHARED='shared'"), std::string::npos)
        << m.status().to_string();
  }
}

// NUCLEUS_MOE_COMBINE_NORM: where the MoE op is the last writer of the delta
// (here: the shared experts inside it, NUCLEUS_MOE_FUSE_SHARED=1), decode
// graphs fold the next add + RMSNorm (the next layer's input norm, or the
// final norm) into the MoE op. The same ops in the same order, so the same
// logits bit for bit on the CPU; prefill graphs, two ranks and the CPU's bf16
// emulation keep the norm as its own op; a malformed value refuses the load.
struct CombineNormEnv {
  explicit CombineNormEnv(const char* v) {
    setenv("NUCLEUS_MOE_FUSE_SHARED", "1", 1);
    setenv("NUCLEUS_MOE_COMBINE_NORM", v, 1);
  }
  ~CombineNormEnv() {
    unsetenv("NUCLEUS_MOE_FUSE_SHARED");
    unsetenv("NUCLEUS_MOE_COMBINE_NORM");
  }
};

// The nodes of `g` whose op is a MoE op running the add + norm after it, and
// the add + norm nodes.
std::pair<int, int> folded_and_own_norms(const StepGraph& g) {
  int folded = 0, own = 0;
  for (const Node& n : g.nodes()) {
    if (auto* m = dynamic_cast<const MoeExpertsOp*>(n.op.get()); m && m->fuses_add_rmsnorm()) ++folded;
    if (dynamic_cast<const AddRmsNormOp*>(n.op.get())) ++own;
  }
  return {folded, own};
}

TEST(EngineTest, CombineNormFoldEqualsTheNormAsItsOwnOp) {
  auto cases = ref_cases("tiny-dsv3");
  std::unique_ptr<ModelExecutor> folded, own;
  {
    CombineNormEnv e("auto");
    folded = load();
  }
  {
    CombineNormEnv e("0");
    own = load();
  }
  // tiny-dsv3: layer 0 dense, layers 1..3 MoE: the input norms of layers 2
  // and 3 and the final norm run in the MoE ops of layers 1, 2 and 3.
  const int layers = static_cast<int>(folded->config().num_hidden_layers);
  const auto [f_folded, f_own] = folded_and_own_norms(folded->graph(StepKind::kDecode));
  const auto [o_folded, o_own] = folded_and_own_norms(own->graph(StepKind::kDecode));
  EXPECT_EQ(o_folded, 0);
  EXPECT_EQ(o_own, 2 * layers + 1);
  EXPECT_EQ(f_folded, 3);
  EXPECT_EQ(f_own, 2 * layers + 1 - 3);
  EXPECT_EQ(folded_and_own_norms(folded->graph(StepKind::kPrefill)).first, 0) << "prefill keeps the norm";
  bool has_final_norm = false;
  for (const Node& n : folded->graph(StepKind::kDecode).nodes()) has_final_norm |= n.name == "norm";
  EXPECT_FALSE(has_final_norm) << "the last MoE op runs the final norm";
  EXPECT_EQ(compare_first_cases(*folded, *own, cases), 0.0f) << "the fold changed the decode logits";
  {  // the CPU's bf16 emulation rounds the delta between the ops: no fold
    CombineNormEnv e("1");
    ModelOptions o;
    o.cpu_bf16_emulation = true;
    auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(folded_and_own_norms((*m)->graph(StepKind::kDecode)).first, 0);
  }
  {
    CombineNormEnv bad("fold");
    ModelOptions o;
    auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find("NUCLEUS_MOE_COMBINE_NORM='fold'"), std::string::npos)
        << m.status().to_string();
  }
}

TEST(EngineTest, CombineNormFoldIsOffAtTp2) {
  auto config = load_model_config(testing::model_path("tiny-dsv3/config.json"), {});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  CombineNormEnv e("1");
  ModelOptions o;
  o.tensor_parallel_size = 2;
  auto m = build_deepseek_model(*config, o, [&](WeightBackend& backend, const TpShard& shard) {
    return make_dummy_weights(*config, backend, 1, shard);
  });
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(folded_and_own_norms((*m)->graph(StepKind::kDecode)).first, 0) << "the norm all-reduces the delta first";
}

TEST(EngineTest, FusedSharedExpertsOfTwoPiecesEqualTheirOwnMlpAtTp1And2) {
  auto config = load_model_config(testing::model_path("tiny-dsv3/config.json"), {"n_shared_experts=2"});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  const std::vector<int32_t> toks = {5, 17, 300, 42, 7, 99, 1000, 3, 64, 2048, 11};
  for (int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    ModelOptions o;
    o.tensor_parallel_size = tp;
    auto make = [&](const char* v) {
      FuseSharedEnv e(v);
      auto m = build_deepseek_model(*config, o, [&](WeightBackend& backend, const TpShard& shard) {
        return make_dummy_weights(*config, backend, 1, shard);
      });
      NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
      return std::move(*m);
    };
    auto fused = make("1"), own = make("auto");  // auto: off on the CPU (docs/flags.md)
    const float worst = compare_decode_steps(*fused, *own, toks, 8, 3, false);
    EXPECT_LT(worst, 1e-4);
    std::printf("n_shared_experts 2, tp %d: max |logit difference| %.3g\n", tp, worst);
  }
}

}  // namespace
}  // namespace nucleus
