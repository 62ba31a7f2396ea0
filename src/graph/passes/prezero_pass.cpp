#include "graph/passes/prezero_pass.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "graph/passes/redirect.h"
#include "ops/basic_ops.h"
#include "ops/linear_op.h"
#include "ops/moe_ops.h"

namespace nucleus {

namespace {

int find_node(const StepGraph& g, const std::string& name) {
  for (size_t i = 0; i < g.nodes().size(); ++i)
    if (g.nodes()[i].name == name) return static_cast<int>(i);
  return -1;
}

struct Consumer {
  int node;
  LinearOp* op;
  int64_t width;
};

// The candidates of one list that can take a donor's zeroing.
StatusOr<std::vector<Consumer>> consumers_of(const StepGraph& g, const std::vector<int>& candidates) {
  std::vector<Consumer> out;
  for (int idx : candidates) {
    if (idx < 0) continue;
    auto* op = dynamic_cast<LinearOp*>(g.nodes()[idx].op.get());
    if (!op) return internal_error("prezero consumer " + g.nodes()[idx].name + " is not a linear op");
    if (!op->honours_zero_init() || op->accumulate() || op->zero_init_max_rows() == 0) continue;
    const BufferDesc& b = g.buffers()[g.nodes()[idx].outputs[0]];
    if (b.dtype != DType::kF32)
      return internal_error("prezero consumer " + g.nodes()[idx].name + " (" + op->backend() + ") writes " +
                            dtype_name(b.dtype) + " buffer " + b.name + "; the split-K pass must run first");
    out.push_back({idx, op, op->weight().out_features});
  }
  return out;
}

Status rewrite_donor(StepGraph& g, int donor, const std::vector<int>& base, const std::vector<int>& tail,
                     const std::string& buffer_name, PrezeroPassReport* report) {
  NUCLEUS_ASSIGN_OR_RETURN(std::vector<Consumer> consumers, consumers_of(g, base));
  int64_t n_base = 0;
  for (const Consumer& c : consumers) n_base += c.width;
  NUCLEUS_ASSIGN_OR_RETURN(std::vector<Consumer> tail_consumers, consumers_of(g, tail));
  consumers.insert(consumers.end(), tail_consumers.begin(), tail_consumers.end());
  if (consumers.empty()) return ok_status();
  int64_t n_total = 0, max_rows = 0;  // the donor fills up to the most rows any consumer accumulates at
  for (const Consumer& c : consumers) {
    n_total += c.width;
    max_rows = std::max(max_rows, c.op->zero_init_max_rows());
  }
  Op* op = g.nodes()[donor].op.get();
  auto* norm = dynamic_cast<AddRmsNormOp*>(op);
  auto* moe = dynamic_cast<MoeExpertsOp*>(op);
  if (!norm && !(moe && moe->fuses_add_rmsnorm()))
    return internal_error("prezero donor " + g.nodes()[donor].name +
                          " is not an add_rmsnorm op or a moe_experts op that runs one");
  const int buffer = g.buffer(buffer_name, n_total, DType::kF32);
  int64_t col = 0;
  for (const Consumer& c : consumers) {
    Node& n = g.nodes()[c.node];
    const int old_out = n.outputs[0];
    const int slice = g.slice(buffer_name + "." + n.name.substr(n.name.rfind('.') + 1), buffer, col, c.width);
    redirect_output(g, c.node, old_out, slice);
    const bool in_base = col < n_base;
    c.op->set_prezero_gate(in_base ? n_base : n_total, max_rows);
    g.nodes()[c.node].notes.push_back(
        fmt::format("prezero consumer: columns [{}, {}) of {}, zero_init unless the donor filled {}", col,
                    col + c.width, buffer_name, in_base ? "the base" : "all"));
    col += c.width;
    ++report->consumers;
  }
  const PrezeroDonor d{n_total, n_base, max_rows};
  if (norm)
    norm->set_prezero(d);
  else
    moe->set_prezero(d);
  g.nodes()[donor].outputs.push_back(buffer);
  g.nodes()[donor].notes.push_back(fmt::format(
      "prezero donor: fills {} [T, {}] (all, or the first {} columns, by the gate)", buffer_name, n_total, n_base));
  ++report->donors;
  return ok_status();
}

}  // namespace

StatusOr<PrezeroPassReport> apply_prezero_pass(StepGraph& g) {
  PrezeroPassReport report;
  for (int64_t l = 0;; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    // The layer's input add + norm: its own node, or run by the MoE op of the
    // layer before (NUCLEUS_MOE_COMBINE_NORM, MoeExpertsOp::fuse_add_rmsnorm).
    int input_norm = find_node(g, p + "input_layernorm");
    if (input_norm < 0 && l > 0) input_norm = find_node(g, "layers." + std::to_string(l - 1) + ".mlp.experts");
    if (find_node(g, p + "post_attention_layernorm") < 0) break;
    if (input_norm < 0) return internal_error("prezero: layer " + std::to_string(l) + " has no input add + norm");
    int q_first = find_node(g, p + "self_attn.q_a_proj");
    if (q_first < 0) q_first = find_node(g, p + "self_attn.q_proj");
    NUCLEUS_RETURN_IF_ERROR(rewrite_donor(g, input_norm,
                                          {q_first, find_node(g, p + "self_attn.kv_a_proj_with_mqa"),
                                           find_node(g, p + "self_attn.q_b_proj")},
                                          {find_node(g, p + "self_attn.o_proj")}, "prezero." + std::to_string(l) + ".attn",
                                          &report));
    const int post_norm = find_node(g, p + "post_attention_layernorm");
    int ffn_first = find_node(g, p + "mlp.shared_experts.gate_up_proj");
    if (ffn_first < 0) ffn_first = find_node(g, p + "mlp.gate_up_proj");
    NUCLEUS_RETURN_IF_ERROR(rewrite_donor(g, post_norm, {find_node(g, p + "mlp.gate"), ffn_first}, {},
                                          "prezero." + std::to_string(l) + ".ffn", &report));
  }
  return report;
}

}  // namespace nucleus
