// A failed step on the CPU reference with tiny-dsv3, driven by the test-only
// NUCLEUS_FAULT_INJECT switch (graph/fault_injection.h): the requests of the
// failed step finish with kError naming the op, their KV blocks are freed,
// requests outside the step and later ones generate exactly what they
// generate without the fault; a fatal fault fails the engine as a whole.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "graph/fault_injection.h"
#include "runtime/model_executor.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

std::vector<std::vector<int32_t>> prompts() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  const nlohmann::json cases = nlohmann::json::parse(in);
  std::vector<std::vector<int32_t>> out;
  for (const auto& c : cases["tiny-dsv3"])
    out.push_back(c["prompt_token_ids"].get<std::vector<int32_t>>());
  return out;
}

// An engine on tiny-dsv3 whose model was built under NUCLEUS_FAULT_INJECT =
// `fault` ("" : none); max_num_seqs 2, so a third request waits.
StatusOr<std::unique_ptr<LLMEngine>> engine(const std::string& fault) {
  if (fault.empty())
    unsetenv("NUCLEUS_FAULT_INJECT");
  else
    setenv("NUCLEUS_FAULT_INJECT", fault.c_str(), 1);
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), ModelOptions{}, {}, false);
  unsetenv("NUCLEUS_FAULT_INJECT");
  if (!m.ok()) return m.status();
  EngineConfig c;
  c.block_size = 16;
  c.num_kv_blocks = 128;
  c.max_num_seqs = 2;
  return LLMEngine::create(std::move(*m), c);
}

SamplingParams greedy(int n) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = n;
  p.ignore_eos = true;
  return p;
}

struct Recorded {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, RequestOutput> last;  // each request's finishing output
  std::vector<std::vector<std::string>> steps;  // the requests each step reported
};

// Steps `e` until idle, recording what every request produced.
void drain(LLMEngine& e, Recorded& run) {
  while (e.has_unfinished()) {
    run.steps.emplace_back();
    for (auto& o : e.step()) {
      run.steps.back().push_back(o.request_id);
      auto& t = run.tokens[o.request_id];
      t.insert(t.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) run.last[o.request_id] = o;
    }
  }
}

TEST(StepErrorTest, FailedStepFinishesItsRequestsOthersGoOnUnchanged) {
  const auto p = prompts();
  ASSERT_GE(p.size(), 4u);
  // Without a fault: a, b run together (max_num_seqs 2), c waits for them;
  // then d.
  auto clean = engine("");
  ASSERT_TRUE(clean.ok()) << clean.status().to_string();
  Recorded want;
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE((*clean)->add_request(id, p[id[0] - 'a'], greedy(8)).ok());
  drain(**clean, want);
  ASSERT_TRUE((*clean)->add_request("d", p[3], greedy(8)).ok());
  drain(**clean, want);

  // The third step's embedding (a and b's second decode step) fails.
  auto faulty = engine("embedding:3");
  ASSERT_TRUE(faulty.ok()) << faulty.status().to_string();
  LLMEngine& e = **faulty;
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(e.add_request(id, p[id[0] - 'a'], greedy(8)).ok());
  Recorded got;
  for (int s = 0; s < 3; ++s) {
    got.steps.emplace_back();
    for (auto& o : e.step()) {
      got.steps.back().push_back(o.request_id);
      auto& t = got.tokens[o.request_id];
      t.insert(t.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) got.last[o.request_id] = o;
    }
  }
  ASSERT_EQ(got.steps[2], (std::vector<std::string>{"a", "b"}));
  for (const char* id : {"a", "b"}) {
    const RequestOutput& o = got.last.at(id);
    EXPECT_TRUE(o.finished);
    EXPECT_EQ(o.finish_reason, FinishReason::kError);
    EXPECT_TRUE(o.new_token_ids.empty());
    EXPECT_EQ(o.num_output_tokens, 2) << id;  // the two steps before the fault
    EXPECT_NE(o.error.message().find("injected fault in op embedding"), std::string::npos) << o.error.to_string();
    EXPECT_NE(o.error.message().find("node "), std::string::npos) << o.error.to_string();
    // What it produced before the fault is what the clean run produced.
    EXPECT_EQ(got.tokens.at(id), std::vector<int32_t>(want.tokens.at(id).begin(), want.tokens.at(id).begin() + 2));
  }
  EXPECT_TRUE(e.failure().ok());
  // c was waiting, not in the failed step: it runs on, and d after it.
  EXPECT_EQ(e.stats().num_running + e.stats().num_waiting, 1);
  drain(e, got);
  ASSERT_TRUE(e.add_request("d", p[3], greedy(8)).ok());
  drain(e, got);
  for (const char* id : {"c", "d"}) {
    EXPECT_EQ(got.tokens.at(id), want.tokens.at(id)) << id;
    EXPECT_EQ(got.last.at(id).finish_reason, FinishReason::kLength) << id;
  }
  EXPECT_EQ(e.stats().kv_blocks_used, 0);  // the failed requests' blocks came back
  // The failed prompts run again, with the same tokens as without the fault.
  ASSERT_TRUE(e.add_request("a2", p[0], greedy(8)).ok());
  drain(e, got);
  EXPECT_EQ(got.tokens.at("a2"), want.tokens.at("a"));
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
}

TEST(StepErrorTest, FatalFaultFailsTheEngineAndEveryRequest) {
  const auto p = prompts();
  auto made = engine("embedding:2:fatal");
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  LLMEngine& e = **made;
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(e.add_request(id, p[id[0] - 'a'], greedy(8)).ok());
  Recorded got;
  drain(e, got);
  ASSERT_EQ(got.steps.size(), 2u);  // the second step failed the engine
  EXPECT_EQ(got.steps[1].size(), 3u);  // c, waiting, failed too
  for (const char* id : {"a", "b", "c"}) {
    const RequestOutput& o = got.last.at(id);
    EXPECT_EQ(o.finish_reason, FinishReason::kError) << id;
    EXPECT_EQ(o.error.code(), StatusCode::kAborted) << o.error.to_string();
    EXPECT_NE(o.error.message().find("injected fault in op embedding"), std::string::npos) << o.error.to_string();
  }
  EXPECT_EQ(e.failure().code(), StatusCode::kAborted);
  EXPECT_NE(e.failure().message().find("cannot run further steps"), std::string::npos) << e.failure().to_string();
  EXPECT_FALSE(e.has_unfinished());
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
  Status s = e.add_request("d", p[3], greedy(8));
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
  EXPECT_TRUE(e.step().empty());
}

TEST(StepErrorTest, MalformedSwitchIsRefusedAtStartUp) {
  for (const char* bad : {"embedding", "embedding:0", "embedding:x", "embedding:2:later", ":3"}) {
    auto e = engine(bad);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(e.status().message().find("NUCLEUS_FAULT_INJECT"), std::string::npos) << e.status().to_string();
  }
  auto e = engine("no_such_op:1");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("no_such_op"), std::string::npos) << e.status().to_string();
  EXPECT_NE(e.status().message().find("moe_experts"), std::string::npos) << e.status().to_string();  // the known kinds
}

TEST(StepErrorTest, FaultPlanParses) {
  auto p = parse_fault_plan("moe_experts:12:fatal");
  ASSERT_TRUE(p.ok() && p->has_value());
  EXPECT_EQ((*p)->kind, "moe_experts");
  EXPECT_EQ((*p)->nth, 12);
  EXPECT_TRUE((*p)->fatal);
  auto none = parse_fault_plan("");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  FaultInjector f(FaultPlan{"linear", 2, false});
  EXPECT_TRUE(f.before_run("embedding", "embed").ok());
  EXPECT_TRUE(f.before_run("linear", "l0").ok());
  Status s = f.before_run("linear", "l1");
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("node l1"), std::string::npos) << s.to_string();
  EXPECT_TRUE(f.before_run("linear", "l2").ok());  // once
  EXPECT_FALSE(f.fatal_fired());
}

}  // namespace
}  // namespace nucleus
