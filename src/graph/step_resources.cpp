#include "graph/step_resources.h"

#include <algorithm>

#include "core/check.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/context.h"
#endif

namespace nucleus {

namespace {

// Whether the engine stream of this thread's device is capturing a CUDA graph.
bool capturing(const OpContext& ctx) {
#ifdef NUCLEUS_HAVE_CUDA
  if (ctx.device != Device::kCuda) return false;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(cuda::context().stream, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
#else
  return false;
#endif
}

}  // namespace

Status StepResources::reserve_group(const StepGraph* graph, const std::vector<Op*>& ops, const StepLimits& limits,
                                    Device device) {
  auto it = std::find_if(groups_.begin(), groups_.end(), [&](const Group& g) { return g.graph == graph; });
  Group group;
  group.graph = graph;
  group.ops = ops;
  group.limits = limits;
  if (it != groups_.end()) {  // never less than reserved before
    const StepLimits& o = it->limits;
    group.limits = {std::max(o.max_tokens, limits.max_tokens), std::max(o.max_seqs, limits.max_seqs),
                    std::max(o.max_logits, limits.max_logits),
                    std::max(o.max_blocks_per_seq, limits.max_blocks_per_seq),
                    std::max(o.block_size, limits.block_size)};
  }
  for (Op* op : ops) {
    NUCLEUS_RETURN_IF_ERROR(
        op->reserve(group.limits, device).with_context(std::string("reserving ") + op->kind()));
    need_ = std::max(need_, op->workspace_bytes(group.limits));
    StepPlan* p = op->step_plan();
    if (p && std::find(group.plans.begin(), group.plans.end(), p) == group.plans.end()) group.plans.push_back(p);
  }
  if (it == groups_.end())
    groups_.push_back(std::move(group));
  else
    *it = std::move(group);
  return ok_status();
}

Status StepResources::grow_arena(Device device) {
  if (need_ <= bytes()) return ok_status();
  NUCLEUS_ASSIGN_OR_RETURN(Tensor grown,
                           try_empty({static_cast<int64_t>(need_)}, DType::kU8, device, "the step workspace"));
  // The old arena stays allocated: CUDA graphs captured with it keep using it
  // (its contents never outlive an op, so the two never need to agree).
  if (arena_.defined()) retired_.push_back(std::move(arena_));
  arena_ = std::move(grown);
  return ok_status();
}

Status StepResources::reserve(const std::vector<const StepGraph*>& graphs, const StepLimits& limits, Device device) {
  for (const StepGraph* g : graphs) {
    std::vector<Op*> ops;
    for (const Node& n : g->nodes()) ops.push_back(n.op.get());
    NUCLEUS_RETURN_IF_ERROR(reserve_group(g, ops, limits, device));
  }
  return grow_arena(device);
}

Status StepResources::reserve_ops(const std::vector<Op*>& ops, const StepLimits& limits, Device device) {
  NUCLEUS_RETURN_IF_ERROR(reserve_group(nullptr, ops, limits, device));
  return grow_arena(device);
}

Status StepResources::begin(Group& group, OpContext& ctx) {
  // A step beyond what the group was reserved for reserves for it first.
  StepLimits l = group.limits;
  if (ctx.inputs) {
    l.max_tokens = std::max(l.max_tokens, ctx.inputs->num_tokens());
    l.max_seqs = std::max(l.max_seqs, ctx.inputs->num_seqs());
    l.max_logits = std::max(l.max_logits, ctx.inputs->num_logits());
    l.max_blocks_per_seq = std::max<int64_t>(l.max_blocks_per_seq, ctx.inputs->max_blocks_per_seq);
  }
  if (ctx.kv_cache && l.block_size == 0) l.block_size = ctx.kv_cache->block_size;
  if (l.max_tokens != group.limits.max_tokens || l.max_seqs != group.limits.max_seqs ||
      l.max_logits != group.limits.max_logits || l.max_blocks_per_seq != group.limits.max_blocks_per_seq ||
      l.block_size != group.limits.block_size) {
    if (capturing(ctx))
      return failed_precondition("a step beyond the reserved step limits under CUDA-graph capture");
    const StepGraph* graph = group.graph;
    const std::vector<Op*> ops = group.ops;
    NUCLEUS_RETURN_IF_ERROR(reserve_group(graph, ops, l, ctx.device));  // replaces `group`
    NUCLEUS_RETURN_IF_ERROR(grow_arena(ctx.device));
    auto it = std::find_if(groups_.begin(), groups_.end(), [&](const Group& g) { return g.graph == graph; });
    return begin(*it, ctx);
  }
  ctx.workspace = {bytes() ? arena_.raw() : nullptr, bytes()};
  for (StepPlan* p : group.plans) {
    if (!p->capturable() && capturing(ctx))
      return failed_precondition("a host step plan cannot run under CUDA-graph capture (its op's backend must "
                                 "refuse a captured graph)");
    NUCLEUS_RETURN_IF_ERROR(p->plan(ctx));
  }
  return ok_status();
}

Status StepResources::begin_step(const StepGraph& graph, OpContext& ctx) {
  auto it = std::find_if(groups_.begin(), groups_.end(), [&](const Group& g) { return g.graph == &graph; });
  if (it == groups_.end()) {  // never reserved: reserved for this step
    std::vector<Op*> ops;
    for (const Node& n : graph.nodes()) ops.push_back(n.op.get());
    NUCLEUS_RETURN_IF_ERROR(reserve_group(&graph, ops, StepLimits{}, ctx.device));
    it = groups_.end() - 1;
  }
  return begin(*it, ctx);
}

Status StepResources::begin_step(OpContext& ctx) {
  auto it = std::find_if(groups_.begin(), groups_.end(), [](const Group& g) { return g.graph == nullptr; });
  NUCLEUS_CHECK(it != groups_.end(), "begin_step without reserve_ops");
  return begin(*it, ctx);
}

}  // namespace nucleus
