#include "graph/passes/splitk_pass.h"

#include <fmt/format.h>

#include <algorithm>

#include "graph/passes/redirect.h"
#include "ops/linear_op.h"

namespace nucleus {

StatusOr<SplitKPassReport> apply_splitk_pass(StepGraph& g, Device device) {
  SplitKPassReport report;
  for (size_t i = 0; i < g.nodes().size(); ++i) {
    Node& n = g.nodes()[i];
    auto* op = dynamic_cast<LinearOp*>(n.op.get());
    if (!op || !op->needs_f32_output() || n.outputs.empty()) continue;
    const int old_id = n.outputs[0];
    const BufferDesc old = g.buffers()[old_id];
    if (old.dtype == DType::kF32) continue;  // already f32 (router logits, logits)
    std::string why_not;
    if (op->accumulate()) why_not = "adds onto the " + std::string(dtype_name(old.dtype)) + " buffer " + old.name;
    for (const auto& [r, k] : readers_of_output(g, i, old_id))
      if (why_not.empty() && !g.nodes()[r].op->accepts_f32_input(k))
        why_not = g.nodes()[r].name + " (" + g.nodes()[r].op->kind() + ") reads it as " + dtype_name(old.dtype);
    if (!why_not.empty()) {
      op->set_splitk_allowed(false);
      NUCLEUS_RETURN_IF_ERROR(op->select_backend(device).with_context("node " + n.name));
      n.notes.push_back("splitk: not split-K (" + why_not + "), " + op->backend() + " instead");
      ++report.reselected;
      continue;
    }
    const int f32_id = g.buffer(old.name + ".f32", old.width, DType::kF32, old.rows);
    const auto readers = redirect_output(g, i, old_id, f32_id);
    n.notes.push_back(fmt::format("splitk: f32 output {} (declared {} {})", old.name + ".f32", old.name,
                                  dtype_name(old.dtype)));
    for (const auto& [r, k] : readers) {
      Node& rn = g.nodes()[r];
      const bool converts = std::find(rn.outputs.begin(), rn.outputs.end(), old_id) != rn.outputs.end();
      rn.notes.push_back(converts ? fmt::format("splitk: reads {} (f32), writes {}", old.name + ".f32", old.name)
                                  : fmt::format("splitk: reads {} (f32)", old.name + ".f32"));
    }
    ++report.redirected;
  }
  return report;
}

}  // namespace nucleus
