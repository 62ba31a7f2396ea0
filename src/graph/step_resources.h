// StepResources: what the ops of a step graph use besides their buffers,
// made once and handed to each step: the workspace arena (one device buffer
// of the largest Op::workspace_bytes over every node of every graph, reused
// by each op in turn), each op's persistent state (Op::reserve), and the
// per-step plans (Op::step_plan) that a graph's ops share.
#pragma once

#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "graph/step_graph.h"
#include "ops/op.h"

namespace nucleus {

class StepResources {
 public:
  // For steps within `limits` of the graphs `graphs` (their backends
  // selected): reserves each op's state (Op::reserve), allocates the arena
  // on `device` (kept when already large enough; an outgrown one stays
  // allocated for the CUDA graphs captured with it) and records each graph's distinct plans. Call before
  // any CUDA-graph capture. Errors: an op's reservation or the arena's
  // allocation failing (kResourceExhausted).
  Status reserve(const std::vector<const StepGraph*>& graphs, const StepLimits& limits, Device device);
  // The same for ops outside a graph (kernel tests, benchmarks): `ops` are
  // one group (their plans those of begin_step(ctx) without a graph).
  Status reserve_ops(const std::vector<Op*>& ops, const StepLimits& limits, Device device);
  // Before a step of `graph`: sets ctx.workspace and runs each of the
  // graph's distinct plans once, on ctx's step (ctx.inputs, ctx.dev). A step
  // beyond the reserved limits (or a graph never reserved) first reserves for
  // it, as reserve() would, growing the arena (not under capture). Errors: a
  // plan or a reservation failing, or a host plan (StepPlan::capturable()
  // false) or a reservation asked under CUDA-graph capture
  // (kFailedPrecondition).
  Status begin_step(const StepGraph& graph, OpContext& ctx);
  // begin_step for the ops of reserve_ops.
  Status begin_step(OpContext& ctx);
  // Device bytes of the arena (the ops' own state is not counted).
  size_t bytes() const { return arena_.defined() ? arena_.nbytes() : 0; }

 private:
  struct Group {
    const StepGraph* graph = nullptr;  // null: the reserve_ops group
    std::vector<Op*> ops;
    std::vector<StepPlan*> plans;  // distinct, in node order
    StepLimits limits;             // reserved for
  };
  Status reserve_group(const StepGraph* graph, const std::vector<Op*>& ops, const StepLimits& limits, Device device);
  Status grow_arena(Device device);
  Status begin(Group& group, OpContext& ctx);

  std::vector<Group> groups_;
  Tensor arena_;
  std::vector<Tensor> retired_;  // outgrown arenas, which captured graphs may still use
  size_t need_ = 0;              // the largest workspace_bytes asked
  // bytes() counts the current arena only.
};

}  // namespace nucleus
