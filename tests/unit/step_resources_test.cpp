// Per-step resources of op backends, on the CPU:
//  - the dispatch rule for captured graphs: a toy family whose first backend
//    cannot be captured is chosen eagerly, refused (with its reason listed)
//    when the op's graph is captured, and the next backend is chosen;
//  - StepResources: the arena is the largest workspace any node declares
//    (over several graphs), each op sees it in ctx.workspace, ops of a plan
//    key share one StepPlan that runs once per step however many ops use it,
//    plans of different keys or graphs stay apart, and Op::reserve runs once
//    per op per reservation.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "graph/step_graph.h"
#include "graph/step_resources.h"
#include "ops/op.h"

namespace nucleus {
namespace {

// A plan that counts its runs and records the step it saw.
class CountingPlan : public StepPlan {
 public:
  Status plan(OpContext& ctx) override {
    ++runs;
    tokens = ctx.inputs ? ctx.inputs->num_tokens() : -1;
    return ok_status();
  }
  int runs = 0;
  int64_t tokens = 0;
};

// A toy family: "host_planned" (not capturable, plans per step, a workspace
// of bytes_per_token x max_tokens) before "plain" (no workspace, no plan).
class ToyOp : public OpWithBackends<ToyOp> {
 public:
  ToyOp(int64_t bytes_per_token, std::string plan_key) : bytes_per_token_(bytes_per_token), key_(std::move(plan_key)) {}
  const char* kind() const override { return "toy"; }
  std::string step_plan_key() const override { return key_; }
  static const std::vector<Backend<ToyOp>>& backends() {
    static const std::vector<Backend<ToyOp>> list = {
        {"host_planned", Device::kCpu,
         [](const ToyOp& op) {
           return op.captured() ? unsupported("plans on the host, which a CUDA graph replay cannot follow")
                                : ok_status();
         },
         [](ToyOp& op, OpContext& ctx, const TensorList&, const TensorList&) {
           op.seen_workspace = ctx.workspace;
           op.seen_plan_runs = static_cast<CountingPlan*>(op.step_plan())->runs;
         },
         [](const ToyOp& op, const StepLimits& l) { return static_cast<size_t>(op.bytes_per_token_ * l.max_tokens); },
         [](ToyOp& op, const StepLimits&, Device) {
           ++op.reserves;
           return ok_status();
         },
         [](const ToyOp&) -> std::shared_ptr<StepPlan> { return std::make_shared<CountingPlan>(); }},
        {"plain", Device::kCpu, nullptr, [](ToyOp&, OpContext&, const TensorList&, const TensorList&) {}},
    };
    return list;
  }
  OpWorkspace seen_workspace;
  int seen_plan_runs = 0;
  int reserves = 0;

 private:
  int64_t bytes_per_token_;
  std::string key_;
};

TEST(CapturedDispatch, HostPlannedBackendRefusedUnderCapture) {
  ToyOp eager(1, "");
  ASSERT_TRUE(eager.select_backend(Device::kCpu).ok());
  EXPECT_EQ(eager.backend(), "host_planned");
  EXPECT_NE(eager.step_plan(), nullptr);

  ToyOp captured(1, "");
  captured.set_captured(true);
  ASSERT_TRUE(captured.select_backend(Device::kCpu).ok());
  EXPECT_EQ(captured.backend(), "plain");
  EXPECT_EQ(captured.step_plan(), nullptr);
  EXPECT_EQ(captured.workspace_bytes({100, 1, 1, 1, 1}), 0u);

  // The refusal is listed when nothing else takes the op.
  const std::vector<Backend<ToyOp>> only_first = {ToyOp::backends()[0]};
  auto chosen = choose_backend("toy", only_first, Device::kCpu, captured);
  ASSERT_FALSE(chosen.ok());
  EXPECT_NE(chosen.status().message().find("host_planned: plans on the host"), std::string::npos)
      << chosen.status().message();
  // use_backend (tests, benchmarks) refuses alike.
  EXPECT_FALSE(captured.use_backend(ToyOp::backends()[0]).ok());
}

TEST(StepResources, ArenaIsTheLargestWorkspaceAndPlansRunOncePerStep) {
  StepGraph a, b;
  std::vector<ToyOp*> a_ops;
  for (int i = 0; i < 5; ++i) {  // five layers sharing one plan, one op of another key
    auto op = std::make_unique<ToyOp>(8 + i, i == 4 ? "other" : "same");
    a_ops.push_back(op.get());
    a.add("a" + std::to_string(i), std::move(op), {}, {});
  }
  auto big = std::make_unique<ToyOp>(100, "same");
  ToyOp* b_op = big.get();
  b.add("b0", std::move(big), {}, {});
  ASSERT_TRUE(a.select_backends(Device::kCpu).ok());
  ASSERT_TRUE(b.select_backends(Device::kCpu).ok());
  EXPECT_EQ(a_ops[0]->step_plan(), a_ops[3]->step_plan());
  EXPECT_NE(a_ops[0]->step_plan(), a_ops[4]->step_plan());
  EXPECT_NE(a_ops[0]->step_plan(), b_op->step_plan());  // each graph its own

  StepResources res;
  const StepLimits limits{16, 4, 4, 2, 16};
  ASSERT_TRUE(res.reserve({&a, &b}, limits, Device::kCpu).ok());
  EXPECT_EQ(res.bytes(), 100u * 16);  // b's op, the largest
  for (ToyOp* op : a_ops) EXPECT_EQ(op->reserves, 1);

  StepInputs inputs;
  inputs.token_ids = {5, 6, 7};
  inputs.positions = {0, 1, 2};
  inputs.query_start = {0, 3};
  for (int step = 1; step <= 3; ++step) {
    OpContext ctx;
    ctx.inputs = &inputs;
    ASSERT_TRUE(res.begin_step(a, ctx).ok());
    StepBuffers sb;
    ASSERT_TRUE(run_nodes(a, ctx, sb.for_step(a, 3, 1, Device::kCpu), 0, a.nodes().size()).ok());
    for (ToyOp* op : a_ops) {
      EXPECT_EQ(op->seen_plan_runs, step);  // once per step, whatever the number of ops
      EXPECT_EQ(op->seen_workspace.bytes, res.bytes());
      EXPECT_NE(op->seen_workspace.data, nullptr);
    }
    EXPECT_EQ(static_cast<CountingPlan*>(a_ops[0]->step_plan())->tokens, 3);
  }
  EXPECT_EQ(static_cast<CountingPlan*>(b_op->step_plan())->runs, 0);  // b never began a step

  // A reservation within the arena keeps it (captured graphs hold its address).
  void* before = a_ops[0]->seen_workspace.data;
  ASSERT_TRUE(res.reserve({&a}, {4, 1, 1, 1, 16}, Device::kCpu).ok());
  OpContext ctx;
  ctx.inputs = &inputs;
  ASSERT_TRUE(res.begin_step(a, ctx).ok());
  EXPECT_EQ(ctx.workspace.data, before);
}

TEST(StepResources, OpsOutsideAGraph) {
  ToyOp op(4, "");
  ASSERT_TRUE(op.use_backend(ToyOp::backends()[0]).ok());
  StepResources res;
  ASSERT_TRUE(res.reserve_ops({&op}, {10, 1, 1, 1, 16}, Device::kCpu).ok());
  EXPECT_EQ(res.bytes(), 40u);
  OpContext ctx;
  ASSERT_TRUE(res.begin_step(ctx).ok());
  op.run(ctx, {}, {});
  EXPECT_EQ(op.seen_plan_runs, 1);
  EXPECT_EQ(op.seen_workspace.bytes, 40u);
}

}  // namespace
}  // namespace nucleus
