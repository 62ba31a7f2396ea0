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

// The two graph shapes a step can take. kDecode: every sequence has one new
// token; kPrefill: anything else (prefill chunks, possibly mixed with decodes).
enum class StepKind { kPrefill, kDecode };

// How many rows a buffer has in a step: the step's tokens, its logit rows, or
// a fixed count set when the graph is built (scratch that kernels process
// in chunks of at most that many rows).
enum class RowSpace { kTokens, kLogits, kFixed };

struct BufferDesc {
  std::string name;
  int64_t width = 0;
  DType dtype = DType::kF32;
  RowSpace rows = RowSpace::kTokens;
  int64_t fixed_rows = 0;  // RowSpace::kFixed only
  // A slice of another buffer: the column block [col_offset, col_offset +
  // width) of `parent`, stored as its own contiguous [rows, width] run that
  // starts rows * col_offset elements into the parent (so a prefix of
  // columns is a prefix of memory). -1: a buffer of its own.
  int parent = -1;
  int64_t col_offset = 0;
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
  // A scratch buffer of `fixed_rows` rows whatever the step.
  int scratch(const std::string& name, int64_t fixed_rows, int64_t width, DType dtype);
  // A slice buffer (see BufferDesc::parent) of parent `parent`.
  int slice(const std::string& name, int parent, int64_t col_offset, int64_t width);
  // Appends a node; returns it.
  Node& add(std::string name, std::unique_ptr<Op> op, std::vector<int> inputs, std::vector<int> outputs);

  // Picks every node's backend for `device` (first supporter in its family's
  // ordered list); ops of one family, backend and Op::step_plan_key() then
  // share one StepPlan. Errors name the node and every refusal.
  Status select_backends(Device device);

  const std::vector<BufferDesc>& buffers() const { return buffers_; }
  std::vector<Node>& nodes() { return nodes_; }
  std::vector<BufferDesc>& mutable_buffers() { return buffers_; }
  const std::vector<Node>& nodes() const { return nodes_; }
  int find_buffer(const std::string& name) const;  // -1 if absent

  // Text form: one line per node: index, name, op kind and attributes,
  // backend, inputs -> outputs (name[rows,width,dtype], slices with their
  // parent and column offset), and pass notes.
  std::string dump(const std::string& title) const;

 private:
  std::vector<BufferDesc> buffers_;
  std::vector<Node> nodes_;
};

// The graph's buffers at a capacity (max tokens and logit rows per step),
// allocated once on a device; each step takes row views of them.
class StepBuffers {
 public:
  // Views for a step with the given rows; reallocates (all buffers) when the
  // step exceeds the capacity.
  const std::vector<Tensor>& for_step(const StepGraph& graph, int64_t num_tokens, int64_t num_logits, Device device);
  size_t bytes() const { return bytes_; }

 private:
  std::vector<Tensor> full_, views_;
  int64_t token_capacity_ = 0, logit_capacity_ = 0;
  size_t bytes_ = 0;
};

// Runs nodes [begin, end) in order. Stops after the first op that reports an
// error (OpContext::fail) and returns it, with the node's name, op kind and
// backend as context (ctx.error is left clear). Applies ctx.faults
// (NUCLEUS_FAULT_INJECT) before each op.
Status run_nodes(StepGraph& graph, OpContext& ctx, const std::vector<Tensor>& buffers, size_t begin, size_t end);

}  // namespace nucleus
