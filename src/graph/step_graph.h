// StepGraph: the forward of one step as an ordered list of op nodes over
// named buffers. The model builds it; passes rewrite it (graph/passes/);
// an executor runs it eagerly or captures segments of it in CUDA graphs.
//
// Buffers are [rows, width]; rows is the step's token count (RowSpace::kTokens)
// or its logit-row count (RowSpace::kLogits). Nodes name their input and output
// buffers; a buffer is reused by every layer that uses the same name.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "ops/op.h"

namespace nucleus {

enum class RowSpace { kTokens, kLogits };

struct BufferDesc {
  std::string name;
  int64_t width = 0;
  DType dtype = DType::kF32;
  RowSpace rows = RowSpace::kTokens;
};

struct Node {
  std::string name;  // e.g. "layers.0.self_attn.kv_a_proj"
  std::unique_ptr<Op> op;
  std::vector<int> inputs;   // buffer ids
  std::vector<int> outputs;  // buffer ids
  std::vector<std::string> notes;  // what passes did to it, shown in dumps
};

class StepGraph {
 public:
  // Id of buffer `name`, created on first use. A later use must agree on
  // width, dtype and row space (checked).
  int buffer(const std::string& name, int64_t width, DType dtype, RowSpace rows = RowSpace::kTokens);
  // Appends a node; returns it.
  Node& add(std::string name, std::unique_ptr<Op> op, std::vector<int> inputs, std::vector<int> outputs);

  // Picks every node's backend for `device` (first supporter in its family's
  // ordered list). Errors name the node and every refusal.
  Status select_backends(Device device);

  const std::vector<BufferDesc>& buffers() const { return buffers_; }
  std::vector<Node>& nodes() { return nodes_; }
  const std::vector<Node>& nodes() const { return nodes_; }
  int find_buffer(const std::string& name) const;  // -1 if absent

  // Text form: one line per node: index, name, op kind and attributes,
  // backend, inputs -> outputs, and pass notes.
  std::string dump(const std::string& title) const;

 private:
  std::vector<BufferDesc> buffers_;
  std::vector<Node> nodes_;
};

// Allocates the graph's buffers for a step on `device` (uninitialised).
std::vector<Tensor> allocate_step_buffers(const StepGraph& graph, const StepInputs& inputs, Device device);

// Runs nodes [begin, end) in order.
void run_nodes(StepGraph& graph, OpContext& ctx, const std::vector<Tensor>& buffers, size_t begin, size_t end);

}  // namespace nucleus
