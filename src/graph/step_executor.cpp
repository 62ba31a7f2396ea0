#include "graph/step_executor.h"

#include <algorithm>
#include <sstream>

#include "core/check.h"
#include "core/device.h"
#include "core/knobs.h"
#include "core/logging.h"
#include "graph/op_profiler.h"

namespace nucleus {

namespace {

// Ops a token graph never captures: attention (its work depends on the real
// rows' contexts), the logit-row gather and the vocabulary all-gather (their
// rows are the step's logit rows), and lm_head.
bool runs_eagerly_in_token_graphs(const Node& n) {
  const std::string kind = n.op->kind();
  return kind == "mla_decode" || kind == "mla_prefill" || kind == "gather_rows" || kind == "all_gather_vocab" ||
         n.name == "lm_head";
}

bool is_attention(const Node& n) {
  const std::string kind = n.op->kind();
  return kind == "mla_decode" || kind == "mla_prefill";
}

// NUCLEUS_FAULT_INJECT's injector when the switch is set; errors when it is
// malformed or names an op kind no node of `graphs` has.
StatusOr<std::unique_ptr<FaultInjector>> make_fault_injector(const std::vector<const StepGraph*>& graphs, int rank) {
  auto plan = parse_fault_plan(env_string(Knob::kFaultInject).value_or(""));
  if (!plan.ok()) return plan.status();
  if (!plan->has_value()) return std::unique_ptr<FaultInjector>();
  std::string kinds;
  for (const StepGraph* g : graphs)
    for (const Node& n : g->nodes())
      if (kinds.find(std::string(" ") + n.op->kind() + ",") == std::string::npos)
        kinds += std::string(" ") + n.op->kind() + ",";
  if (kinds.find(" " + (*plan)->kind + ",") == std::string::npos)
    return invalid_argument("NUCLEUS_FAULT_INJECT names op kind '" + (*plan)->kind + "', which no node of the model has" +
                            " (kinds:" + kinds.substr(0, kinds.size() - 1) + ")");
  if (rank == 0)
    NUCLEUS_LOG_WARN("NUCLEUS_FAULT_INJECT: run {} of op {} will fail{} (a test switch)", (*plan)->nth, (*plan)->kind,
                     (*plan)->fatal ? ", fatally" : "");
  return std::make_unique<FaultInjector>(**plan);
}

// Whether two uploads put every array of the step at the same device address.
bool same_addresses(const DeviceStepInputs& a, const DeviceStepInputs& b) {
  return a.token_ids == b.token_ids && a.positions == b.positions && a.slot_mapping == b.slot_mapping &&
         a.query_start == b.query_start && a.context_lens == b.context_lens && a.block_tables == b.block_tables &&
         a.logit_indices == b.logit_indices && a.token_seq == b.token_seq && a.single_token_rows == b.single_token_rows;
}

}  // namespace

StatusOr<std::unique_ptr<StepExecutor>> StepExecutor::create(BuiltGraph prefill, BuiltGraph decode,
                                                              const ExecutorOptions& options) {
  std::unique_ptr<StepExecutor> e(new StepExecutor(options));
  e->prefill_ = std::move(prefill);
  e->decode_ = std::move(decode);
  const std::vector<Node>& pn = e->prefill_.graph.nodes();
  for (size_t i = 0; i < pn.size(); ++i) {
    const bool eager = runs_eagerly_in_token_graphs(pn[i]);
    if (e->prefill_segments_.empty() || e->prefill_segments_.back().graph == eager)
      e->prefill_segments_.push_back({i, i, !eager});
    e->prefill_segments_.back().end = i + 1;
  }
  e->whole_prefill_ = {{0, pn.size(), false}};
  e->whole_decode_ = {{0, e->decode_.graph.nodes().size(), true}};
  if (options.device == Device::kCuda) e->uploader_ = std::make_unique<DeviceInputUploader>();
  e->packed_upload_ = env_auto_switch(Knob::kPackedUpload).value_or(AutoSwitch::kAuto) != AutoSwitch::kOff;
  NUCLEUS_ASSIGN_OR_RETURN(e->faults_, make_fault_injector({&e->prefill_.graph, &e->decode_.graph}, options.rank));
  return e;
}

const std::vector<StepExecutor::Segment>& StepExecutor::segments(StepKind kind, Route route) const {
  if (route == Route::kTokenGraph) return prefill_segments_;
  return kind == StepKind::kDecode ? whole_decode_ : whole_prefill_;
}

std::pair<StepExecutor::Route, int64_t> StepExecutor::route_for(const StepInputs& inputs, bool eager_only) const {
  if (options_.device != Device::kCuda || eager_only) return {Route::kEager, 0};
  if (inputs.is_decode()) {
    const int64_t padded = graph_size_for(inputs.num_seqs());
    // The graphs return the first rows in order: a step whose logit rows are
    // others (a sequence whose one token is a prompt position, not its last)
    // runs eagerly.
    bool leading_rows = true;
    for (int64_t i = 0; i < inputs.num_logits(); ++i) leading_rows = leading_rows && inputs.logit_indices[i] == i;
    if (padded > 0 && leading_rows && inputs.max_blocks_per_seq <= options_.max_blocks_per_seq &&
        uploader_->generation() == graphs_generation_)
      return {Route::kDecodeGraph, padded};
    return {Route::kEager, 0};
  }
  const int64_t bucket = token_bucket_for(inputs.num_tokens());
  if (bucket > 0 && uploader_->generation() == graphs_generation_) return {Route::kTokenGraph, bucket};
  NUCLEUS_LOG_DEBUG("prefill step of {} tokens runs eagerly ({})", inputs.num_tokens(),
                    token_graphs_.empty() ? "no token graphs" : "larger than the largest bucket");
  return {Route::kEager, 0};
}

Status StepExecutor::run_range(StepKind kind, OpContext& ctx, const std::vector<Tensor>& buffers, size_t begin,
                               size_t end) {
  StepGraph& g = graph(kind);
  if (!options_.cpu_bf16_emulation) return run_nodes(g, ctx, buffers, begin, end);
  const std::vector<int>& rounded = kind == StepKind::kDecode ? decode_.bf16_buffers : prefill_.bf16_buffers;
  for (size_t i = begin; i < end; ++i) {
    NUCLEUS_RETURN_IF_ERROR(run_nodes(g, ctx, buffers, i, i + 1));
    for (int id : g.nodes()[i].outputs) {
      if (std::find(rounded.begin(), rounded.end(), id) == rounded.end()) continue;
      float* p = buffers[id].data<float>();
      for (int64_t k = 0; k < buffers[id].numel(); ++k) p[k] = round_to_bf16(p[k]);
    }
    // Emulates a bf16 cache in an f32 one (a bf16 or FP8 cache is stored as such already).
    if (std::string(g.nodes()[i].op->kind()) == "rope_kv_cache_write" && ctx.kv_cache->dtype() == KvCacheDtype::kF32) {
      float* c = ctx.kv_cache->data.data<float>();
      for (int64_t k = 0; k < ctx.kv_cache->data.numel(); ++k) c[k] = round_to_bf16(c[k]);
    }
  }
  return ok_status();
}

bool StepExecutor::runs_as_decode_rows(const StepInputs& inputs) const {
  if (!options_.multi_token_decode || inputs.is_decode()) return false;
  for (int64_t s = 0; s < inputs.num_seqs(); ++s)
    if (inputs.query_len(s) > kMaxMultiTokenDecodeRows) return false;
  return decode_row_capacity_ == 0 ? options_.device != Device::kCuda : inputs.num_tokens() <= decode_row_capacity_;
}

StatusOr<Tensor> StepExecutor::forward_logits(const StepInputs& step, KvCache& kv_cache, StepStats* stats) {
  NUCLEUS_CHECK(step.num_tokens() > 0, "empty step");
  NUCLEUS_CHECK(static_cast<int64_t>(step.positions.size()) == step.num_tokens() &&
                    static_cast<int64_t>(step.slot_mapping.size()) == step.num_tokens() &&
                    static_cast<int64_t>(step.query_start.size()) == step.num_seqs() + 1 &&
                    step.query_start.back() == step.num_tokens(),
                "inconsistent step inputs");
  // 0. A step of a few tokens a sequence runs as decode rows. An MTP step's
  // host mtp_hidden goes to the device: into the decode graphs' own buffer
  // when the step replays one (step 1), else as a device copy.
  StepInputs local;
  const StepInputs* in = &step;
  if (runs_as_decode_rows(step)) {
    local = as_decode_rows(step);
    in = &local;
    ++multi_token_decode_steps_;
  }
  // The route depends on the rows, not on where mtp_hidden lies: taken once.
  auto [route, rows] = route_for(*in, stats != nullptr);
  if (options_.device == Device::kCuda && in->mtp_hidden.defined() && in->mtp_hidden.device() != Device::kCuda &&
      !(graph_mtp_hidden_.defined() && route == Route::kDecodeGraph)) {
    if (in != &local) local = *in;
    in = &local;
    local.mtp_hidden = to_device(local.mtp_hidden);
  }
  const StepInputs& inputs = *in;
  const StepKind kind = inputs.is_decode() ? StepKind::kDecode : StepKind::kPrefill;
  if (op_profiling_enabled()) op_profile_set_phase(kind == StepKind::kDecode ? "decode" : "prefill");
  StepGraph& g = graph(kind);
  StepBuffers& sb = kind == StepKind::kDecode ? decode_buffers_ : prefill_buffers_;
  const int64_t T = inputs.num_tokens();

  // 1. Padded inputs for the route.
  StepInputs padded;
  if (route == Route::kDecodeGraph) {
    // The width the graphs were captured with (capture), so a packed upload
    // has the capture's lengths.
    padded = pad_decode_step(inputs, rows, static_cast<int32_t>(std::max<int64_t>(options_.max_blocks_per_seq, 1)));
    if (graph_mtp_hidden_.defined()) {  // the MTP layer's graphs read their own copy
      copy_rows_async(graph_mtp_hidden_, inputs.mtp_hidden);
      padded.mtp_hidden = graph_mtp_hidden_.rows(0, rows);
    }
  }
  else if (route == Route::kTokenGraph)
    padded = pad_prefill_step(inputs, rows);
  const StepInputs& run_in = route == Route::kEager ? inputs : padded;
  const int64_t logit_rows = route == Route::kDecodeGraph ? rows : inputs.num_logits();

  // 2. Upload (CUDA). A padded prefill step that outgrew the upload buffer
  // moved it: the token graphs hold the old addresses, so it runs eagerly.
  DeviceStepInputs dev;
  if (uploader_) {
    dev = uploader_->upload(run_in, packed_upload(route));
    if (route == Route::kTokenGraph && uploader_->generation() != graphs_generation_) {
      NUCLEUS_LOG_DEBUG("prefill step of {} tokens runs eagerly (the padded metadata outgrew the reserved buffer)", T);
      route = Route::kEager;
      dev = uploader_->upload(inputs);
    }
  }

  // 3. Buffers: the padded height for graph segments, the real rows for
  // eager ones (views of the same allocation: a prefix of rows).
  std::vector<Tensor> full;
  if (route != Route::kEager) full = sb.for_step(g, rows, logit_rows, options_.device);
  const std::vector<Tensor>& real =
      route == Route::kDecodeGraph ? full : sb.for_step(g, T, inputs.num_logits(), options_.device);

  OpContext ctx;
  ctx.device = options_.device;
  ctx.kv_cache = &kv_cache;
  ctx.stats = stats;
  ctx.faults = faults_.get();
  // The eager segments of a token-graph step see the real rows only: the pad
  // sequence (the last one) must not count among the one-token rows that
  // decode attention serves, as it would when the pad is a single row.
  DeviceStepInputs dev_real = dev;
  if (route == Route::kTokenGraph) {
    dev_real.num_single_token_rows = 0;
    for (int64_t s = 0; s < inputs.num_seqs(); ++s) dev_real.num_single_token_rows += inputs.query_len(s) == 1;
  }
  const bool eager_pad = route == Route::kDecodeGraph   ? options_.graph_eager_pad
                         : route == Route::kTokenGraph ? options_.token_graph_eager_pad
                                                       : false;

  // 4. The step's plans, once for every layer (a replayed decode graph runs
  // the capturable plans it captured), then the segments in order.
  if (route != Route::kDecodeGraph || eager_pad) {
    ctx.inputs = route == Route::kDecodeGraph ? &run_in : &inputs;
    ctx.dev = uploader_ ? (route == Route::kDecodeGraph ? &dev : &dev_real) : nullptr;
    NUCLEUS_RETURN_IF_ERROR(resources_.begin_step(g, ctx));
  }
  const int attn_out = g.find_buffer("attn_out");
  size_t graph_index = 0;
  for (const Segment& seg : segments(kind, route)) {
    if (route != Route::kEager && seg.graph) {
      if (eager_pad) {
        ctx.inputs = &run_in;
        ctx.dev = uploader_ ? &dev : nullptr;
        NUCLEUS_RETURN_IF_ERROR(run_range(kind, ctx, full, seg.begin, seg.end));
      } else if (route == Route::kDecodeGraph) {
        NUCLEUS_CHECK(same_addresses(dev, decode_graph_inputs_.at(rows)),
                      "decode graph of batch {}: the step's metadata is not where the graph was captured reading it",
                      rows);
        decode_graphs_.at(rows).replay();
      } else {
        token_graphs_.at(rows)[graph_index].replay();
      }
      ++graph_index;
      continue;
    }
    ctx.inputs = &inputs;
    ctx.dev = uploader_ ? &dev_real : nullptr;
    NUCLEUS_RETURN_IF_ERROR(run_range(kind, ctx, real, seg.begin, seg.end));
    // Attention hands back zero pad rows to the graphed segments after it.
    if (route == Route::kTokenGraph && is_attention(g.nodes()[seg.begin]))
      zero_rows_async(full[attn_out], T, rows - T);
  }
  if (route == Route::kDecodeGraph && !eager_pad) ++graph_replays_;
  if (route == Route::kTokenGraph && !eager_pad) ++token_graph_replays_;

  last_kind_ = kind;
  last_rows_ = T;
  last_buffers_ = real;
  const int logits = g.find_buffer("logits");
  if (options_.device != Device::kCuda) return real[logits].clone();
  if (route == Route::kDecodeGraph) return full[logits].rows(0, inputs.num_logits());
  return real[logits];
}

StatusOr<Tensor> StepExecutor::last_step_buffer(const std::string& name) const {
  if (last_buffers_.empty()) return failed_precondition("no step has run: no buffer '" + name + "' to read");
  const int id = (last_kind_ == StepKind::kDecode ? decode_ : prefill_).graph.find_buffer(name);
  if (id < 0 || id >= static_cast<int>(last_buffers_.size()))
    return not_found("the step graph has no buffer '" + name + "'");
  return last_buffers_[id].rows(0, last_rows_);
}

void StepExecutor::reserve(int64_t max_tokens, int64_t max_logits, int64_t max_prefill_logits) {
  const int64_t prefill_logits = std::max(max_logits, max_prefill_logits);
  prefill_buffers_.for_step(prefill_.graph, max_tokens, prefill_logits, options_.device);
  decode_buffers_.for_step(decode_.graph, max_logits, max_logits, options_.device);
  decode_row_capacity_ = std::max(decode_row_capacity_, max_logits);
  if (uploader_) {
    // One sequence more than a step can hold: a padded token-graph step adds
    // its pad sequence. Without it, a step of max_num_seqs sequences padded
    // to a bucket grew (reallocated) the upload buffer under the captured
    // graphs, which then read freed memory.
    const int64_t width = std::max<int64_t>(options_.max_blocks_per_seq, 1), seqs = max_logits + 1;
    uploader_->reserve({std::max(max_tokens, max_logits), seqs, seqs * width, prefill_logits});
  }
  NUCLEUS_CHECK_OK(resources_.reserve({&prefill_.graph, &decode_.graph},
                                      {std::max(max_tokens, max_logits), max_logits + 1, prefill_logits,
                                       options_.max_blocks_per_seq, 0},
                                      options_.device));
}

void StepExecutor::drop_graphs() {
  decode_graphs_.clear();
  decode_graph_inputs_.clear();
  token_graphs_.clear();
}

int64_t StepExecutor::token_bucket_for(int64_t num_tokens) const {
  auto it = token_graphs_.lower_bound(num_tokens);
  return it == token_graphs_.end() ? 0 : it->first;
}

int64_t StepExecutor::graph_size_for(int64_t num_seqs) const {
  auto it = decode_graphs_.lower_bound(num_seqs);
  return it == decode_graphs_.end() ? 0 : it->first;
}

Status StepExecutor::health() {
  if (faults_ && faults_->fatal_fired())
    return aborted("a fatal fault was injected (NUCLEUS_FAULT_INJECT=" + faults_->plan().kind + ":" +
                   std::to_string(faults_->plan().nth) + ":fatal)");
  if (options_.device == Device::kCuda) return device_health();
  return ok_status();
}

StatusOr<size_t> StepExecutor::capture(KvCache& kv_cache) {
  drop_graphs();
  if (options_.device != Device::kCuda) return size_t{0};
  if (op_profiling_enabled()) op_profile_set_phase("graph warm-up");
  const int64_t largest = options_.cuda_graph_sizes.empty() ? 1 : options_.cuda_graph_sizes.back();
  const int32_t width = static_cast<int32_t>(std::max<int64_t>(options_.max_blocks_per_seq, 1));
  uploader_->reserve({largest, largest, largest * width, largest});
  decode_buffers_.for_step(decode_.graph, largest, largest, options_.device);
  decode_row_capacity_ = std::max(decode_row_capacity_, largest);
  NUCLEUS_RETURN_IF_ERROR(resources_.reserve({&decode_.graph}, {largest, largest + 1, largest, width, kv_cache.block_size},
                                             options_.device));
  size_t free_before = 0, total = 0, free_after = 0;
  synchronize_device();
  device_memory_info(&free_before, &total);
  // Each route's graph segments, captured from a request-less step (every
  // row a pad row) after one warm-up run (plans, lazy state); neither counts
  // toward NUCLEUS_FAULT_INJECT (no injector in the context).
  auto capture_route = [&](StepKind kind, const StepInputs& dummy, int64_t rows, int64_t logit_rows,
                           const std::vector<Segment>& segs, const std::string& what) -> StatusOr<std::vector<CudaGraph>> {
    StepGraph& g = graph(kind);
    StepBuffers& sb = kind == StepKind::kDecode ? decode_buffers_ : prefill_buffers_;
    const std::vector<Tensor> buffers = sb.for_step(g, rows, logit_rows, options_.device);
    // A decode graph's route uploads as its replays will (packed_upload).
    const Route route = kind == StepKind::kDecode ? Route::kDecodeGraph : Route::kTokenGraph;
    DeviceStepInputs dev = uploader_->upload(dummy, packed_upload(route));
    if (route == Route::kDecodeGraph) decode_graph_inputs_[rows] = dev;
    OpContext ctx;
    ctx.device = options_.device;
    ctx.kv_cache = &kv_cache;
    ctx.inputs = &dummy;
    ctx.dev = &dev;
    std::vector<CudaGraph> graphs;
    // The warm-up's plans; a decode graph also captures its (capturable)
    // plans, so a replay plans its own step. A token graph's segments plan
    // nothing (attention, whose ops plan, runs eagerly).
    const bool whole = kind == StepKind::kDecode;
    NUCLEUS_RETURN_IF_ERROR(resources_.begin_step(g, ctx).with_context(what + " warm-up"));
    for (const Segment& seg : segs) {
      if (!seg.graph) continue;
      NUCLEUS_RETURN_IF_ERROR(run_nodes(g, ctx, buffers, seg.begin, seg.end).with_context(what + " warm-up"));
      auto cg = CudaGraph::capture([&] {
        if (whole) NUCLEUS_RETURN_IF_ERROR(resources_.begin_step(g, ctx));
        return run_nodes(g, ctx, buffers, seg.begin, seg.end);
      });
      if (!cg.ok()) return cg.status().with_context(what);
      graphs.push_back(std::move(*cg));
    }
    return graphs;
  };
  StepInputs empty;
  empty.query_start = {0};
  empty.max_blocks_per_seq = 0;
  if (options_.mtp_hidden_width > 0 && !options_.cuda_graph_sizes.empty()) {
    graph_mtp_hidden_ = Tensor::empty({largest, options_.mtp_hidden_width}, DType::kF32, Device::kCuda);
    zero_device(graph_mtp_hidden_);
  }
  for (int64_t size : options_.cuda_graph_sizes) {
    StepInputs dummy = pad_decode_step(empty, size, width);
    if (graph_mtp_hidden_.defined()) dummy.mtp_hidden = graph_mtp_hidden_.rows(0, size);
    NUCLEUS_ASSIGN_OR_RETURN(std::vector<CudaGraph> gs,
                             capture_route(StepKind::kDecode, dummy, size, size, whole_decode_,
                                           "decode graph of batch " + std::to_string(size)));
    decode_graphs_.emplace(size, std::move(gs.at(0)));
  }
  for (int64_t bucket : options_.token_graph_sizes) {
    NUCLEUS_ASSIGN_OR_RETURN(std::vector<CudaGraph> gs,
                             capture_route(StepKind::kPrefill, pad_prefill_step(empty, bucket), bucket, 0,
                                           prefill_segments_, "token graph of bucket " + std::to_string(bucket)));
    token_graphs_.emplace(bucket, std::move(gs));
  }
  synchronize_device();
  device_memory_info(&free_after, &total);
  graphs_generation_ = uploader_->generation();
  return free_before > free_after ? free_before - free_after : size_t{0};
}

std::vector<int64_t> default_cuda_graph_sizes(int64_t max_num_seqs) {
  std::vector<int64_t> sizes = {1, 2, 4, 8, 16, 24, 32, 48, 64};
  for (int64_t s = 96; s <= 512; s += 32) sizes.push_back(s);
  std::vector<int64_t> out;
  for (int64_t s : sizes)
    if (s <= max_num_seqs) out.push_back(s);
  if (out.empty() || out.back() < std::min<int64_t>(max_num_seqs, 512))
    out.push_back(std::min<int64_t>(max_num_seqs, 512));
  return out;
}

StatusOr<std::vector<int64_t>> token_graph_sizes_from_env(int64_t max_num_batched_tokens) {
  std::vector<int64_t> sizes = {256, 512, 1024, 2048, 3072};
  if (auto env = env_string(Knob::kTokenGraphSizes)) {
    sizes.clear();
    std::stringstream ss(*env);
    std::string item;
    while (std::getline(ss, item, ',')) {
      const std::optional<int64_t> v = parse_int(item);
      if (!v || *v < 1)
        return invalid_argument("NUCLEUS_TOKEN_GRAPH_SIZES: '" + item + "' is not a positive integer");
      sizes.push_back(*v);
    }
    if (!env->empty() && env->back() == ',')
      return invalid_argument("NUCLEUS_TOKEN_GRAPH_SIZES: '' is not a positive integer");
  }
  std::vector<int64_t> out;
  for (int64_t s : sizes)
    if (s <= max_num_batched_tokens) out.push_back(s);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

StepInputs pad_decode_step(const StepInputs& in, int64_t padded, int32_t width) {
  NUCLEUS_CHECK(in.is_decode() && padded >= in.num_seqs() && width >= in.max_blocks_per_seq,
                "pad_decode_step: {} seqs to {}, width {} to {}", in.num_seqs(), padded, in.max_blocks_per_seq, width);
  StepInputs out = in;
  const int64_t n = in.num_seqs();
  out.block_tables.assign(padded * width, -1);
  for (int64_t s = 0; s < n; ++s)
    std::copy(in.block_tables.begin() + s * in.max_blocks_per_seq,
              in.block_tables.begin() + (s + 1) * in.max_blocks_per_seq, out.block_tables.begin() + s * width);
  out.max_blocks_per_seq = width;
  for (int64_t s = n; s < padded; ++s) {
    out.token_ids.push_back(0);
    out.positions.push_back(0);
    out.slot_mapping.push_back(-1);
    out.query_start.push_back(static_cast<int32_t>(s + 1));
    out.context_lens.push_back(0);
    out.block_tables[s * width] = 0;
  }
  out.logit_indices.resize(padded);
  for (int64_t s = 0; s < padded; ++s) out.logit_indices[s] = static_cast<int32_t>(s);
  return out;
}

StepInputs as_decode_rows(const StepInputs& in) {
  StepInputs out;
  out.token_ids = in.token_ids;
  out.positions = in.positions;
  out.slot_mapping = in.slot_mapping;
  out.logit_indices = in.logit_indices;
  out.mtp_hidden = in.mtp_hidden;
  out.max_blocks_per_seq = in.max_blocks_per_seq;
  const size_t width = static_cast<size_t>(in.max_blocks_per_seq);
  out.query_start.reserve(in.token_ids.size() + 1);
  out.context_lens.reserve(in.token_ids.size());
  out.block_tables.reserve(in.token_ids.size() * width);
  out.query_start.push_back(0);
  for (int64_t s = 0; s < in.num_seqs(); ++s) {
    const auto table = in.block_tables.begin() + static_cast<std::ptrdiff_t>(s * width);
    for (int32_t i = 0; i < in.query_len(s); ++i) {
      out.query_start.push_back(static_cast<int32_t>(out.context_lens.size() + 1));
      out.context_lens.push_back(in.context_lens[s] + i);
      out.block_tables.insert(out.block_tables.end(), table, table + static_cast<std::ptrdiff_t>(width));
    }
  }
  return out;
}

StepInputs pad_prefill_step(const StepInputs& in, int64_t padded) {
  NUCLEUS_CHECK(padded >= in.num_tokens(), "pad_prefill_step: {} tokens to {}", in.num_tokens(), padded);
  StepInputs out = in;
  const int64_t pad = padded - in.num_tokens();
  if (pad == 0) return out;
  for (int64_t i = 0; i < pad; ++i) {
    out.token_ids.push_back(0);
    out.positions.push_back(0);
    out.slot_mapping.push_back(-1);
  }
  out.query_start.push_back(static_cast<int32_t>(padded));
  out.context_lens.push_back(0);
  const int32_t width = std::max<int32_t>(in.max_blocks_per_seq, 1);
  if (in.max_blocks_per_seq == 0) out.block_tables.clear();
  out.max_blocks_per_seq = width;
  out.block_tables.push_back(0);
  for (int32_t b = 1; b < width; ++b) out.block_tables.push_back(-1);
  return out;
}

}  // namespace nucleus
