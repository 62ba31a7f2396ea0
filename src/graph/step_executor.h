// StepExecutor: runs one rank's step graphs. The model builds the graphs
// (model/deepseek/deepseek_model.h); the executor owns them with their
// buffers and runs each step along one path:
//
//   route  = which graph (prefill or decode), at how many rows (the step's,
//            or a captured size it pads to), and which of the graph's
//            segments replay a captured CUDA graph;
//   inputs = the step's metadata, padded to the route's rows, uploaded once;
//   run    = each segment in order: a replay, or its nodes eagerly (on the
//            real rows, or on the padded rows when a padded step runs eagerly).
//
// Routes (docs/architecture.md "One step"):
//   eager        every node on the step's rows (the CPU, or a step no graph fits)
//   decode graph a decode step padded to the smallest captured batch size
//                that holds it; the whole graph is one captured segment
//   token graph  a prefill step padded to the smallest token bucket that holds
//                it; the dense segments between attention layers replay, the
//                attention and logits segments run eagerly on the real rows
// NUCLEUS_GRAPH_EAGER_PAD / NUCLEUS_TOKEN_GRAPH_EAGER_PAD run the padded
// routes eagerly (padding effects told apart from graph effects).
//
// Multi-token decode (ExecutorOptions::multi_token_decode): a step whose
// every sequence has 2..kMaxMultiTokenDecodeRows new tokens (the verify step
// of MTP speculative decoding, the MTP passes, a short prompt) runs as a
// decode step of one row a token (as_decode_rows), so it takes the decode
// route and its CUDA graphs instead of the prefill path.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "core/status.h"
#include "graph/cuda_graph.h"
#include "graph/device_inputs.h"
#include "graph/fault_injection.h"
#include "graph/step_graph.h"
#include "graph/step_resources.h"

namespace nucleus {

// The default decode graph sizes: 1, 2, 4, 8, 16, 24, 32, 48, 64, then every
// 32 up to 512, capped at max_num_seqs (vLLM's defaults).
std::vector<int64_t> default_cuda_graph_sizes(int64_t max_num_seqs);

// The most new tokens a sequence may have in a step that runs as decode rows.
constexpr int32_t kMaxMultiTokenDecodeRows = 4;

// `in` as a decode step of one row a token: token i of sequence s becomes
// its own one-token sequence at context_lens[s] + i, with s's block-table
// row. Decode attention of that row sees keys 0 .. context_lens[s] + i,
// exactly the keys the prefill path's causal mask gives token i (the step
// writes every row's key before attention reads), so the two are the same
// computation; token_ids, positions, slot_mapping, logit_indices and
// mtp_hidden are unchanged (rows keep their order).
// Shapes: query_start [num_tokens + 1], context_lens [num_tokens],
// block_tables [num_tokens, max_blocks_per_seq].
StepInputs as_decode_rows(const StepInputs& in);

// Default token-graph buckets: 256, 512, 1024, 2048, 3072, capped at
// max_num_batched_tokens; NUCLEUS_TOKEN_GRAPH_SIZES overrides ("" disables).
// Errors: an item of NUCLEUS_TOKEN_GRAPH_SIZES that is not a positive integer.
StatusOr<std::vector<int64_t>> token_graph_sizes_from_env(int64_t max_num_batched_tokens);

// A prefill step padded to `padded` rows: the pad rows form one extra
// sequence (no context, tokens 0 at position 0, slot -1, block table of
// block 0) that no attention op serves.
StepInputs pad_prefill_step(const StepInputs& in, int64_t padded);

// A decode step padded to `padded` rows for graph replay: pad rows are their
// own sequences with no context, token 0 at position 0, slot -1 (they write
// no KV), a block table of block 0 (read, never written) and their own logit
// row; block tables are widened to `width` entries.
StepInputs pad_decode_step(const StepInputs& in, int64_t padded, int32_t width);

// A step graph as built by a model, with the buffers the CPU's bf16
// emulation rounds after each op (ExecutorOptions::cpu_bf16_emulation).
struct BuiltGraph {
  StepGraph graph;
  std::vector<int> bf16_buffers;
};

struct ExecutorOptions {
  Device device = Device::kCpu;
  // Decode graph sizes (ascending; empty: every step eager). CUDA only.
  std::vector<int64_t> cuda_graph_sizes;
  // Prefill token-graph buckets (ascending; empty: none). CUDA only.
  std::vector<int64_t> token_graph_sizes;
  bool graph_eager_pad = false;        // NUCLEUS_GRAPH_EAGER_PAD
  bool token_graph_eager_pad = false;  // NUCLEUS_TOKEN_GRAPH_EAGER_PAD
  // CPU: round the buffers of BuiltGraph::bf16_buffers to bf16 after each op
  // (and an f32 cache after each cache write): the bf16 backend's expected
  // deviation from the f32 reference.
  bool cpu_bf16_emulation = false;
  // Block-table width of graph steps: ceil(max_model_len / block_size).
  int64_t max_blocks_per_seq = 0;
  // The rank's index in its tensor-parallel group (0 alone): only rank 0 logs.
  int rank = 0;
  // Steps of 2..kMaxMultiTokenDecodeRows tokens a sequence run as decode
  // rows (as_decode_rows; NUCLEUS_MULTI_TOKEN_DECODE, default on).
  bool multi_token_decode = true;
  // The MTP module's executor: the width of StepInputs::mtp_hidden (the
  // hidden size; 0 for the target model). Its decode graphs read the hidden
  // states from a buffer of their own, which a replay fills from the step's
  // mtp_hidden first.
  int64_t mtp_hidden_width = 0;
};

class StepExecutor {
 public:
  // The executor of `prefill` and `decode` (backends selected, passes run).
  // Errors: a malformed NUCLEUS_FAULT_INJECT (or one naming an op kind that
  // no node has).
  static StatusOr<std::unique_ptr<StepExecutor>> create(BuiltGraph prefill, BuiltGraph decode,
                                                        const ExecutorOptions& options);

  // Runs one step: writes its latent rows into `kv_cache` (slots from
  // inputs.slot_mapping) and returns the logits [num_logits, vocab] f32: on
  // CUDA a view of the step buffers (valid until the next step), on the CPU a
  // host tensor. Errors: what an op reported (OpContext::fail), naming the
  // node; the step's KV rows are then partly written. A step with `stats`
  // runs eagerly (ops record what they touched).
  StatusOr<Tensor> forward_logits(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats = nullptr);

  // The buffer `name` of the last step that ran, its first num_tokens rows
  // (the step's real rows) as a view on the step's device: e.g. "x_norm"
  // after the final norm (the hidden states MTP reads) or "residual". Valid
  // until the next step. Errors: no step ran, no such buffer.
  StatusOr<Tensor> last_step_buffer(const std::string& name) const;

  // Allocates the step buffers of both graphs for steps of up to
  // `max_tokens` tokens and `max_logits` logit rows (prefill steps up to
  // max(max_logits, max_prefill_logits): prompt logprobs), the metadata
  // upload buffer and the ops' workspaces (StepResources), so memory is
  // known before the KV pool is sized. A workspace that cannot be allocated
  // stops the process (start-up).
  void reserve(int64_t max_tokens, int64_t max_logits, int64_t max_prefill_logits);
  // Captures one decode graph per cuda_graph_sizes entry and the token-graph
  // segments per bucket against `kv_cache` (whose addresses the graphs keep);
  // replaces graphs captured before. Returns the device bytes they took.
  // Errors: an op failing in a warm-up step or under capture.
  StatusOr<size_t> capture(KvCache& kv_cache);
  void drop_graphs();

  // Whether the rank can run more steps: OK, or kAborted after a fatal
  // injected fault or with a sticky CUDA error (synchronises the device).
  Status health();
  // Whether a fatal injected fault fired (NUCLEUS_FAULT_INJECT=...:fatal).
  bool fatal_fault_fired() const { return faults_ && faults_->fatal_fired(); }

  StepGraph& graph(StepKind kind) { return kind == StepKind::kDecode ? decode_.graph : prefill_.graph; }
  const ExecutorOptions& options() const { return options_; }
  void set_max_blocks_per_seq(int64_t n) { options_.max_blocks_per_seq = n; }
  // The captured size a decode step of `num_seqs` replays, or 0 (eager).
  int64_t graph_size_for(int64_t num_seqs) const;
  // The bucket a prefill step of `num_tokens` pads to, or 0 (eager).
  int64_t token_bucket_for(int64_t num_tokens) const;
  int64_t graph_replays() const { return graph_replays_; }
  int64_t token_graph_replays() const { return token_graph_replays_; }
  // Steps that ran as decode rows (as_decode_rows), on any route.
  int64_t multi_token_decode_steps() const { return multi_token_decode_steps_; }
  // Device bytes the step buffers and the ops' workspace arena take at the
  // current capacity.
  size_t activation_bytes() const {
    return prefill_buffers_.bytes() + decode_buffers_.bytes() + resources_.bytes();
  }

 private:
  enum class Route { kEager, kDecodeGraph, kTokenGraph };
  // A run of nodes [begin, end); graph: replayed from a capture on graph
  // routes, else eager.
  struct Segment {
    size_t begin = 0, end = 0;
    bool graph = false;
  };

  explicit StepExecutor(const ExecutorOptions& options) : options_(options) {}
  // Whether `inputs` runs as decode rows (multi_token_decode): not a decode
  // step, every sequence at most kMaxMultiTokenDecodeRows tokens, and the
  // rows fit the decode buffers reserved (a larger step would reallocate
  // them under the captured graphs).
  bool runs_as_decode_rows(const StepInputs& inputs) const;
  // The route of a step (and its padded size, 0 for eager).
  std::pair<Route, int64_t> route_for(const StepInputs& inputs, bool eager_only) const;
  // Nodes [begin, end) of `kind`'s graph; with cpu_bf16_emulation one at a
  // time, rounding the bf16 buffers after each.
  Status run_range(StepKind kind, OpContext& ctx, const std::vector<Tensor>& buffers, size_t begin, size_t end);
  // The segments of `kind`'s graph on `route`.
  const std::vector<Segment>& segments(StepKind kind, Route route) const;
  // Whether `route` uploads its metadata packed (DeviceInputUploader::upload):
  // the decode-graph route under NUCLEUS_PACKED_UPLOAD, at capture and at
  // replay alike (a function of the route only), so a replay's addresses are
  // the ones its graph captured.
  bool packed_upload(Route route) const { return packed_upload_ && route == Route::kDecodeGraph; }

  ExecutorOptions options_;
  BuiltGraph prefill_, decode_;
  StepBuffers prefill_buffers_, decode_buffers_;
  int64_t decode_row_capacity_ = 0;  // rows the decode buffers were reserved for (0: none yet)
  // MTP executor on CUDA: [largest graph size, mtp_hidden_width] f32, the
  // mtp_hidden its decode graphs were captured reading.
  Tensor graph_mtp_hidden_;
  StepResources resources_;  // the ops' workspace arena and per-step plans
  std::vector<Segment> prefill_segments_;     // attention and logits eager, the rest graphed
  std::vector<Segment> whole_prefill_, whole_decode_;  // one segment of every node
  std::map<int64_t, CudaGraph> decode_graphs_;               // by padded batch size
  std::map<int64_t, std::vector<CudaGraph>> token_graphs_;  // by bucket: one per graph segment
  std::unique_ptr<DeviceInputUploader> uploader_;  // CUDA
  bool packed_upload_ = true;  // NUCLEUS_PACKED_UPLOAD (auto, 1: on; 0: off), read once in create
  // By padded batch size: the metadata addresses each decode graph was
  // captured with; a replay's upload must give the same (a NUCLEUS_CHECK).
  std::map<int64_t, DeviceStepInputs> decode_graph_inputs_;
  int64_t graphs_generation_ = -1;  // uploader generation the graphs were captured with
  int64_t graph_replays_ = 0, token_graph_replays_ = 0;
  int64_t multi_token_decode_steps_ = 0;
  // The last step's graph, rows and buffers (last_step_buffer).
  StepKind last_kind_ = StepKind::kPrefill;
  int64_t last_rows_ = 0;
  std::vector<Tensor> last_buffers_;
  std::unique_ptr<FaultInjector> faults_;  // NUCLEUS_FAULT_INJECT; null: none
};

}  // namespace nucleus
