#include "graph/step_graph.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "core/check.h"
#include "core/op_cuda_error.h"
#include "graph/fault_injection.h"
#include "graph/op_profiler.h"

namespace nucleus {

int StepGraph::buffer(const std::string& name, int64_t width, DType dtype, RowSpace rows) {
  int id = find_buffer(name);
  if (id >= 0) {
    const BufferDesc& b = buffers_[id];
    NUCLEUS_CHECK(b.width == width && b.dtype == dtype && b.rows == rows,
                  "buffer {} redeclared: width {} vs {}, dtype {} vs {}", name, b.width, width, dtype_name(b.dtype),
                  dtype_name(dtype));
    return id;
  }
  buffers_.push_back({name, width, dtype, rows});
  return static_cast<int>(buffers_.size()) - 1;
}

int StepGraph::scratch(const std::string& name, int64_t fixed_rows, int64_t width, DType dtype) {
  int id = buffer(name, width, dtype, RowSpace::kFixed);
  NUCLEUS_CHECK(buffers_[id].fixed_rows == 0 || buffers_[id].fixed_rows == fixed_rows, "scratch {} resized", name);
  buffers_[id].fixed_rows = fixed_rows;
  return id;
}

int StepGraph::slice(const std::string& name, int parent, int64_t col_offset, int64_t width) {
  NUCLEUS_CHECK(parent >= 0 && parent < static_cast<int>(buffers_.size()) && buffers_[parent].parent < 0 &&
                    col_offset + width <= buffers_[parent].width,
                "bad slice {} of buffer {}", name, parent);
  NUCLEUS_CHECK(find_buffer(name) < 0, "buffer {} exists", name);
  BufferDesc d = buffers_[parent];
  d.name = name;
  d.width = width;
  d.parent = parent;
  d.col_offset = col_offset;
  buffers_.push_back(d);
  return static_cast<int>(buffers_.size()) - 1;
}

int StepGraph::find_buffer(const std::string& name) const {
  for (size_t i = 0; i < buffers_.size(); ++i)
    if (buffers_[i].name == name) return static_cast<int>(i);
  return -1;
}

Node& StepGraph::add(std::string name, std::unique_ptr<Op> op, std::vector<int> inputs, std::vector<int> outputs) {
  nodes_.push_back(Node{std::move(name), std::move(op), std::move(inputs), std::move(outputs), {}});
  return nodes_.back();
}

Status StepGraph::select_backends(Device device) {
  std::map<std::string, std::shared_ptr<StepPlan>> plans;  // family/backend/step_plan_key -> the shared plan
  for (auto& n : nodes_) {
    Status s = n.op->select_backend(device);
    if (!s.ok()) return s.with_context("node " + n.name);
    if (!n.op->shared_step_plan()) continue;
    auto [it, fresh] = plans.emplace(std::string(n.op->kind()) + "/" + n.op->backend() + "/" + n.op->step_plan_key(),
                                     n.op->shared_step_plan());
    if (!fresh) n.op->share_step_plan(it->second);
  }
  return ok_status();
}

std::string StepGraph::dump(const std::string& title) const {
  std::string out = fmt::format("# step graph: {} ({} nodes, {} buffers)\n", title, nodes_.size(), buffers_.size());
  auto names = [&](const std::vector<int>& ids) {
    std::string s;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) s += ", ";
      const BufferDesc& b = buffers_[ids[i]];
      if (b.parent >= 0) {
        s += fmt::format("{}[T,{},{}]=slice({},{})", b.name, b.width, dtype_name(b.dtype), buffers_[b.parent].name,
                         b.col_offset);
        continue;
      }
      s += fmt::format("{}[{}{},{}]", b.name,
                       b.rows == RowSpace::kTokens ? "T," : b.rows == RowSpace::kLogits ? "L," : fmt::format("{},", b.fixed_rows),
                       b.width, dtype_name(b.dtype));
    }
    return s;
  };
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    out += fmt::format("{:4} {:<44} {:<20} {:<10} {} -> {}", i, n.name, n.op->kind(),
                       n.op->backend().empty() ? "-" : n.op->backend(), names(n.inputs), names(n.outputs));
    std::string attrs = n.op->attrs();
    if (!attrs.empty()) out += "  {" + attrs + "}";
    for (const auto& note : n.notes) out += "  <" + note + ">";
    out += "\n";
  }
  return out;
}

const std::vector<Tensor>& StepBuffers::for_step(const StepGraph& graph, int64_t num_tokens, int64_t num_logits,
                                                 Device device) {
  if (full_.size() != graph.buffers().size() || num_tokens > token_capacity_ || num_logits > logit_capacity_) {
    token_capacity_ = std::max(token_capacity_, num_tokens);
    logit_capacity_ = std::max(logit_capacity_, num_logits);
    full_.clear();
    bytes_ = 0;
    for (const auto& b : graph.buffers()) {
      const int64_t rows = b.rows == RowSpace::kTokens   ? token_capacity_
                           : b.rows == RowSpace::kLogits ? logit_capacity_
                                                         : b.fixed_rows;
      if (b.parent >= 0) {  // views are made per step
        full_.emplace_back();
        continue;
      }
      full_.push_back(Tensor::empty({rows, b.width}, b.dtype, device));
      bytes_ += full_.back().nbytes();
    }
  }
  views_.clear();
  for (size_t i = 0; i < full_.size(); ++i) {
    const BufferDesc& b = graph.buffers()[i];
    const int64_t rows = b.rows == RowSpace::kTokens ? num_tokens : b.rows == RowSpace::kLogits ? num_logits
                                                                                               : b.fixed_rows;
    if (b.parent >= 0) {
      views_.push_back(full_[b.parent].slice_flat(rows * b.col_offset, {rows, b.width}));
      continue;
    }
    views_.push_back(full_[i].rows(0, rows));
  }
  return views_;
}

Status run_nodes(StepGraph& graph, OpContext& ctx, const std::vector<Tensor>& buffers, size_t begin, size_t end) {
  std::vector<Tensor> in, out;
  for (size_t i = begin; i < end; ++i) {
    Node& n = graph.nodes()[i];
    in.clear();
    out.clear();
    for (int id : n.inputs) in.push_back(buffers[id]);
    for (int id : n.outputs) out.push_back(buffers[id]);
    if (ctx.faults) ctx.fail(ctx.faults->before_run(n.op->kind(), n.name));
    if (!ctx.failed()) {
      try {
        if (op_profiling_enabled()) {
          op_profile_begin();
          n.op->run(ctx, in, out);
          op_profile_end(op_profile_label(n.name, n.op->kind(), n.op->backend()));
        } else {
          n.op->run(ctx, in, out);
        }
      } catch (const OpCudaError& e) {  // a failed CUDA call in the op (core/cuda/cuda_check.h)
        ctx.fail(internal_error(e.what()));
      }
    }
    if (ctx.failed()) {
      Status s = ctx.error.with_context(fmt::format("node {} ({}, backend {})", n.name, n.op->kind(), n.op->backend()));
      ctx.error = ok_status();
      return s;
    }
  }
  return ok_status();
}

}  // namespace nucleus
