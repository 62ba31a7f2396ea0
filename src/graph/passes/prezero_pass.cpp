#include "graph/passes/prezero_pass.h"

#include <fmt/format.h>

#include <string>
#include <vector>

#include "ops/basic_ops.h"
#include "ops/linear_op.h"

namespace nucleus {

namespace {

int find_node(const StepGraph& g, const std::string& name) {
  for (size_t i = 0; i < g.nodes().size(); ++i)
    if (g.nodes()[i].name == name) return static_cast<int>(i);
  return -1;
}

// Replaces buffer `old_id` by `new_id` in node `first` (its outputs) and in
// every later node until one writes `old_id` again.
void rewire(StepGraph& g, size_t first, int old_id, int new_id) {
  for (int& id : g.nodes()[first].outputs)
    if (id == old_id) id = new_id;
  for (size_t i = first + 1; i < g.nodes().size(); ++i) {
    Node& n = g.nodes()[i];
    bool writes = false;
    for (int id : n.outputs) writes |= id == old_id;
    bool reads = false;
    for (int id : n.inputs) reads |= id == old_id;
    // An in-place op (reads and writes it) still works on the slice; a node
    // that only writes it starts a new value: stop there.
    if (writes && !reads) return;
    for (int& id : n.inputs)
      if (id == old_id) id = new_id;
    for (int& id : n.outputs)
      if (id == old_id) id = new_id;
  }
}

struct Consumer {
  int node;
  LinearOp* op;
  int64_t width;
};

Status rewrite_donor(StepGraph& g, int donor, const std::vector<int>& base, const std::vector<int>& tail,
                     const std::string& buffer_name, PrezeroPassReport* report) {
  std::vector<Consumer> consumers;
  int64_t n_base = 0, n_total = 0;
  for (const auto* list : {&base, &tail}) {
    for (int idx : *list) {
      if (idx < 0) continue;
      auto* op = dynamic_cast<LinearOp*>(g.nodes()[idx].op.get());
      if (!op) return internal_error("prezero consumer " + g.nodes()[idx].name + " is not a linear op");
      const int64_t w = op->weight().out_features;
      consumers.push_back({idx, op, w});
      n_total += w;
      if (list == &base) n_base += w;
    }
  }
  if (consumers.empty()) return ok_status();
  auto* norm = dynamic_cast<AddRmsNormOp*>(g.nodes()[donor].op.get());
  if (!norm) return internal_error("prezero donor " + g.nodes()[donor].name + " is not an add_rmsnorm op");
  const int buffer = g.buffer(buffer_name, n_total, DType::kF32);
  int64_t col = 0;
  for (const Consumer& c : consumers) {
    Node& n = g.nodes()[c.node];
    const int old_out = n.outputs[0];
    const int slice = g.slice(buffer_name + "." + n.name.substr(n.name.rfind('.') + 1), buffer, col, c.width);
    rewire(g, c.node, old_out, slice);
    const bool in_base = col < n_base;
    c.op->set_prezero_gate_n(in_base ? n_base : n_total);
    n.notes.push_back(fmt::format("prezero consumer: columns [{}, {}) of {}, zero_init unless the donor filled {}", col,
                                  col + c.width, buffer_name, in_base ? "the base" : "all"));
    col += c.width;
    ++report->consumers;
  }
  norm->set_prezero({n_total, n_base});
  g.nodes()[donor].outputs.push_back(buffer);
  g.nodes()[donor].notes.push_back(fmt::format("prezero donor: fills {} [T, {}] (all, or the first {} columns, by the gate)",
                                               buffer_name, n_total, n_base));
  ++report->donors;
  return ok_status();
}

}  // namespace

StatusOr<PrezeroPassReport> apply_prezero_pass(StepGraph& g) {
  PrezeroPassReport report;
  for (const Node& n : g.nodes())
    if (n.op->backend() != "cpu_ref" && !n.op->backend().empty() &&
        std::string(n.op->kind()) == "add_rmsnorm")
      return unsupported("the prezero pass needs the CUDA split-K GEMMs, which are not built yet; run without "
                         "NUCLEUS_ENABLE_PREZERO on the GPU");
  for (int64_t l = 0;; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const int input_norm = find_node(g, p + "input_layernorm");
    if (input_norm < 0) break;
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
