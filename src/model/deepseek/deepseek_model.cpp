#include "model/deepseek/deepseek_model.h"

#include <filesystem>

#include "core/check.h"
#include "core/device.h"
#include "core/env.h"
#include "core/logging.h"
#include "ops/basic_ops.h"
#include "ops/linear_op.h"
#include "ops/moe_ops.h"

namespace nucleus {

DeepseekModel::DeepseekModel(const ModelConfig& config, ModelWeights weights, const ModelOptions& options)
    : config_(config), weights_(std::move(weights)), options_(options) {
  rope_ = kernels::make_rope_table(config_, config_.max_position_embeddings);
  if (options_.device == Device::kCuda) {
    rope_inv_freq_device_ = to_device(Tensor::from_f32({static_cast<int64_t>(rope_.inv_freq.size())}, rope_.inv_freq));
    uploader_ = std::make_unique<DeviceInputUploader>();
  }
}

StatusOr<std::unique_ptr<DeepseekModel>> DeepseekModel::create(const ModelConfig& config, ModelWeights weights,
                                                                const ModelOptions& options) {
  std::unique_ptr<DeepseekModel> m(new DeepseekModel(config, std::move(weights), options));
  m->build(m->prefill_graph_, StepKind::kPrefill);
  m->build(m->decode_graph_, StepKind::kDecode);
  NUCLEUS_RETURN_IF_ERROR(m->prefill_graph_.select_backends(options.device).with_context("prefill graph"));
  NUCLEUS_RETURN_IF_ERROR(m->decode_graph_.select_backends(options.device).with_context("decode graph"));
  if (env_flag("NUCLEUS_DUMP_GRAPH")) {
    std::fputs(m->prefill_graph_.dump("prefill").c_str(), stderr);
    std::fputs(m->decode_graph_.dump("decode").c_str(), stderr);
  }
  return m;
}

void DeepseekModel::build(StepGraph& g, StepKind kind) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const auto eps = static_cast<float>(c.rms_norm_eps);
  // Activations: f32 in the CPU reference, bf16 on CUDA; the residual stream
  // is f32 on both.
  const DType act = options_.device == Device::kCuda ? DType::kBF16 : DType::kF32;
  kernels::MlaDims dims;
  dims.num_heads = nh;
  dims.qk_nope = c.qk_nope_head_dim;
  dims.qk_rope = c.qk_rope_head_dim;
  dims.v_head = c.v_head_dim;
  dims.kv_lora = c.kv_lora_rank;
  dims.scale = static_cast<float>(c.softmax_scale());
  const AttentionMode mode = options_.attention_mode;

  const int residual = g.buffer("residual", H, DType::kF32);
  const int x_norm = g.buffer("x_norm", H, act);
  const int delta = g.buffer("delta", H, act);
  const int q = g.buffer("q", nh * c.qk_head_dim(), act);
  const int kv_a = g.buffer("kv_a", c.kv_cache_width(), act);
  const int attn_out = g.buffer("attn_out", nh * c.v_head_dim, act);
  const int64_t W = options_.scratch_rows;
  const int q_lat = g.scratch("mla_q_lat", W, nh * c.kv_lora_rank, DType::kF32);
  const int o_lat = g.scratch("mla_o_lat", W, nh * c.kv_lora_rank, DType::kF32);

  g.add("embed_tokens", std::make_unique<EmbeddingOp>(weights_.embed_tokens), {}, {residual});

  // SwiGLU MLP writing (or, with accumulate, adding to) `out`.
  auto add_mlp = [&](const std::string& prefix, const MlpWeights& w, int in, int out, bool accumulate) {
    const int gate_up = g.buffer("gate_up." + std::to_string(w.inter), 2 * w.inter, act);
    const int h = g.buffer("mlp_act." + std::to_string(w.inter), w.inter, act);
    g.add(prefix + ".gate_up_proj", std::make_unique<LinearOp>(&w.gate_up, false), {in}, {gate_up});
    g.add(prefix + ".act", std::make_unique<SiluMulOp>(), {gate_up}, {h});
    g.add(prefix + ".down_proj", std::make_unique<LinearOp>(&w.down, accumulate), {h}, {out});
  };

  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = weights_.layers[l];
    const AttentionWeights& aw = lw.attn;
    const std::string p = "layers." + std::to_string(l) + ".";
    // Attention block.
    std::vector<int> norm_in = {residual};
    if (l > 0) norm_in.push_back(delta);
    g.add(p + "input_layernorm", std::make_unique<AddRmsNormOp>(lw.input_layernorm, eps, l > 0), norm_in,
          {residual, x_norm});
    if (aw.q_a_proj) {
      const int q_a = g.buffer("q_a", c.q_lora_rank, act);
      g.add(p + "self_attn.q_a_proj", std::make_unique<LinearOp>(&*aw.q_a_proj, false), {x_norm}, {q_a});
      g.add(p + "self_attn.q_a_layernorm", std::make_unique<RmsNormOp>(aw.q_a_layernorm, eps), {q_a}, {q_a});
      g.add(p + "self_attn.q_b_proj", std::make_unique<LinearOp>(&*aw.q_b_proj, false), {q_a}, {q});
    } else {
      g.add(p + "self_attn.q_proj", std::make_unique<LinearOp>(&*aw.q_proj, false), {x_norm}, {q});
    }
    g.add(p + "self_attn.kv_a_proj_with_mqa", std::make_unique<LinearOp>(&aw.kv_a_proj, false), {x_norm}, {kv_a});
    g.add(p + "self_attn.kv_a_layernorm", std::make_unique<RmsNormOp>(aw.kv_a_layernorm, eps), {kv_a}, {kv_a});
    g.add(p + "self_attn.rope_kv_cache_write",
          std::make_unique<RopeKvCacheWriteOp>(
              l, &rope_, dims, rope_inv_freq_device_.defined() ? rope_inv_freq_device_.data<float>() : nullptr,
              static_cast<float>(kernels::rope_attention_factor(c))),
          {q, kv_a}, {q});
    // The decode graph has only single-token sequences: no prefill op
    // unless expanded attention is forced.
    if (mode != AttentionMode::kExpanded)
      g.add(p + "self_attn.attn_decode", std::make_unique<MlaDecodeAttentionOp>(l, &aw.kv_b_proj, dims, mode), {q},
            {attn_out, q_lat, o_lat});
    if (mode == AttentionMode::kExpanded || (mode == AttentionMode::kAuto && kind == StepKind::kPrefill))
      g.add(p + "self_attn.attn_prefill",
            std::make_unique<MlaPrefillAttentionOp>(l, &aw.kv_b_proj, dims, mode, options_.prefill_context_chunk),
            {q}, {attn_out});
    g.add(p + "self_attn.o_proj", std::make_unique<LinearOp>(&aw.o_proj, false), {attn_out}, {delta});
    // FFN block.
    g.add(p + "post_attention_layernorm", std::make_unique<AddRmsNormOp>(lw.post_attention_layernorm, eps, true),
          {residual, delta}, {residual, x_norm});
    if (lw.moe) {
      const MoeWeights& m = *lw.moe;
      const int64_t E = c.n_routed_experts, k = c.num_experts_per_tok;
      const int logits = g.buffer("router_logits", E, DType::kF32);
      const int ids = g.buffer("topk_ids", k, DType::kI32);
      const int weights = g.buffer("topk_weights", k, DType::kF32);
      g.add(p + "mlp.gate", std::make_unique<LinearOp>(&m.router, false), {x_norm}, {logits});
      g.add(p + "mlp.route",
            std::make_unique<MoeRouteOp>(kernels::MoeRoutingParams::from_config(c), m.e_score_correction_bias),
            {logits}, {ids, weights});
      std::vector<ExpertWeights> experts;
      for (const auto& e : m.experts) experts.push_back({&e.gate_up, &e.down});
      const int moe_scratch = g.scratch("moe_scratch", W, k * c.moe_intermediate_size, DType::kF32);
      g.add(p + "mlp.experts", std::make_unique<MoeExpertsOp>(std::move(experts), c.moe_intermediate_size, k),
            {x_norm, ids, weights}, {delta, moe_scratch});
      if (m.shared) add_mlp(p + "mlp.shared_experts", *m.shared, x_norm, delta, /*accumulate=*/true);
    } else {
      add_mlp(p + "mlp", *lw.mlp, x_norm, delta, /*accumulate=*/false);
    }
  }
  g.add("norm", std::make_unique<AddRmsNormOp>(weights_.norm, eps, true), {residual, delta}, {residual, x_norm});
  const int lm_in = g.buffer("lm_head_in", H, act, RowSpace::kLogits);
  const int logits = g.buffer("logits", c.vocab_size, DType::kF32, RowSpace::kLogits);
  g.add("gather_logit_rows", std::make_unique<GatherLogitRowsOp>(), {x_norm}, {lm_in});
  g.add("lm_head", std::make_unique<LinearOp>(&weights_.lm_head, false), {lm_in}, {logits});
}

KvCache DeepseekModel::make_kv_cache(int64_t num_blocks, int64_t block_size) const {
  KvCache kv;
  kv.num_layers = config_.num_hidden_layers;
  kv.num_blocks = num_blocks;
  kv.block_size = block_size;
  kv.width = config_.kv_cache_width();
  if (options_.device == Device::kCuda) {
    kv.data = Tensor::empty({kv.num_layers, num_blocks, block_size, kv.width}, DType::kBF16, Device::kCuda);
    zero_device(kv.data);
  } else {
    kv.data = Tensor::zeros({kv.num_layers, num_blocks, block_size, kv.width}, DType::kF32);
  }
  return kv;
}

void DeepseekModel::reserve_step_buffers(int64_t max_tokens, int64_t max_logits) {
  prefill_buffers_.for_step(prefill_graph_, max_tokens, max_logits, options_.device);
  decode_buffers_.for_step(decode_graph_, max_logits, max_logits, options_.device);
  if (uploader_) {
    const int64_t width = std::max<int64_t>(options_.max_blocks_per_seq, 1);
    uploader_->reserve({std::max(max_tokens, max_logits), max_logits, max_logits * width, max_logits});
  }
}

int64_t DeepseekModel::kv_bytes_per_token() const {
  const int64_t elem = options_.device == Device::kCuda ? 2 : 4;
  return config_.num_hidden_layers * config_.kv_cache_width() * elem;
}

DeepseekModel::WeightBytes DeepseekModel::weight_bytes() const {
  WeightBytes b;
  auto lin = [](const LinearWeight& w) {
    return static_cast<int64_t>(w.weight.nbytes() + (w.scale_inv.defined() ? w.scale_inv.nbytes() : 0));
  };
  auto mlp = [&](const MlpWeights& m) { return lin(m.gate_up) + lin(m.down); };
  // The embedding is gathered row by row (a step reads num_tokens rows): not counted.
  b.dense += lin(weights_.lm_head) + static_cast<int64_t>(weights_.norm.nbytes());
  for (const auto& l : weights_.layers) {
    const auto& a = l.attn;
    b.dense += static_cast<int64_t>(l.input_layernorm.nbytes() + l.post_attention_layernorm.nbytes());
    if (a.q_a_proj) b.dense += lin(*a.q_a_proj) + lin(*a.q_b_proj) + static_cast<int64_t>(a.q_a_layernorm.nbytes());
    if (a.q_proj) b.dense += lin(*a.q_proj);
    b.dense += lin(a.kv_a_proj) + lin(a.kv_b_proj) + lin(a.o_proj) + static_cast<int64_t>(a.kv_a_layernorm.nbytes());
    if (l.mlp) b.dense += mlp(*l.mlp);
    if (l.moe) {
      b.dense += lin(l.moe->router);
      if (l.moe->shared) b.dense += mlp(*l.moe->shared);
      if (!l.moe->experts.empty()) b.per_expert = mlp(l.moe->experts[0]);
    }
  }
  return b;
}

StatusOr<Tensor> DeepseekModel::forward(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats) {
  NUCLEUS_CHECK(inputs.num_tokens() > 0, "empty step");
  NUCLEUS_CHECK(static_cast<int64_t>(inputs.positions.size()) == inputs.num_tokens() &&
                    static_cast<int64_t>(inputs.slot_mapping.size()) == inputs.num_tokens() &&
                    static_cast<int64_t>(inputs.query_start.size()) == inputs.num_seqs() + 1 &&
                    inputs.query_start.back() == inputs.num_tokens(),
                "inconsistent step inputs");
  for (int32_t p : inputs.positions)
    NUCLEUS_CHECK(p >= 0 && p < config_.max_position_embeddings, "position {} outside [0, {})", p,
                  config_.max_position_embeddings);
  const bool decode = inputs.is_decode();
  StepGraph& g = graph(decode ? StepKind::kDecode : StepKind::kPrefill);
  StepBuffers& sb = decode ? decode_buffers_ : prefill_buffers_;
  OpContext ctx;
  ctx.device = options_.device;
  ctx.kv_cache = &kv_cache;
  ctx.stats = stats;
  if (options_.device != Device::kCuda) {
    const std::vector<Tensor>& buffers = sb.for_step(g, inputs.num_tokens(), inputs.num_logits(), options_.device);
    ctx.inputs = &inputs;
    run_nodes(g, ctx, buffers, 0, g.nodes().size());
    return buffers[g.find_buffer("logits")].clone();
  }
  // CUDA: replay a captured decode graph when one fits, else run eagerly.
  const int64_t padded = decode && !stats ? graph_size_for(inputs.num_seqs()) : 0;
  if (padded > 0 && inputs.max_blocks_per_seq <= options_.max_blocks_per_seq &&
      uploader_->generation() == graphs_generation_) {
    StepInputs p = pad_decode_step(inputs, padded, static_cast<int32_t>(options_.max_blocks_per_seq));
    const std::vector<Tensor>& buffers = sb.for_step(g, padded, padded, options_.device);
    DeviceStepInputs dev = uploader_->upload(p);
    if (options_.graph_eager_pad) {
      ctx.inputs = &p;
      ctx.dev = &dev;
      run_nodes(g, ctx, buffers, 0, g.nodes().size());
    } else {
      decode_graphs_.at(padded).replay();
      ++graph_replays_;
    }
    return to_host(buffers[g.find_buffer("logits")].rows(0, inputs.num_logits()));
  }
  const std::vector<Tensor>& buffers = sb.for_step(g, inputs.num_tokens(), inputs.num_logits(), options_.device);
  DeviceStepInputs dev = uploader_->upload(inputs);
  ctx.inputs = &inputs;
  ctx.dev = &dev;
  run_nodes(g, ctx, buffers, 0, g.nodes().size());
  return to_host(buffers[g.find_buffer("logits")]);
}

std::vector<int64_t> default_cuda_graph_sizes(int64_t max_num_seqs) {
  std::vector<int64_t> sizes = {1, 2, 4, 8, 16, 24, 32, 48, 64};
  for (int64_t s = 96; s <= 512; s += 32) sizes.push_back(s);
  std::vector<int64_t> out;
  for (int64_t s : sizes)
    if (s <= max_num_seqs) out.push_back(s);
  if (out.empty() || out.back() < std::min<int64_t>(max_num_seqs, 512)) out.push_back(std::min<int64_t>(max_num_seqs, 512));
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

int64_t DeepseekModel::graph_size_for(int64_t num_seqs) const {
  auto it = decode_graphs_.lower_bound(num_seqs);
  return it == decode_graphs_.end() ? 0 : it->first;
}

StatusOr<size_t> DeepseekModel::capture_decode_graphs(KvCache& kv_cache) {
  decode_graphs_.clear();
  if (options_.device != Device::kCuda || options_.cuda_graph_sizes.empty()) return size_t{0};
  const int64_t largest = options_.cuda_graph_sizes.back();
  const int32_t width = static_cast<int32_t>(std::max<int64_t>(options_.max_blocks_per_seq, 1));
  uploader_->reserve({largest, largest, largest * width, largest});
  decode_buffers_.for_step(decode_graph_, largest, largest, options_.device);
  size_t free_before = 0, total = 0, free_after = 0;
  synchronize_device();
  device_memory_info(&free_before, &total);
  StepInputs empty;
  empty.query_start = {0};
  empty.max_blocks_per_seq = 0;
  for (int64_t size : options_.cuda_graph_sizes) {
    // A request-less decode step: every row is a pad row.
    StepInputs dummy = pad_decode_step(empty, size, width);
    const std::vector<Tensor>& buffers = decode_buffers_.for_step(decode_graph_, size, size, options_.device);
    DeviceStepInputs dev = uploader_->upload(dummy);
    OpContext ctx;
    ctx.device = options_.device;
    ctx.kv_cache = &kv_cache;
    ctx.inputs = &dummy;
    ctx.dev = &dev;
    run_nodes(decode_graph_, ctx, buffers, 0, decode_graph_.nodes().size());  // warm-up: plans, lazy state
    auto g = CudaGraph::capture([&] { run_nodes(decode_graph_, ctx, buffers, 0, decode_graph_.nodes().size()); });
    if (!g.ok()) return g.status().with_context("decode graph of batch " + std::to_string(size));
    decode_graphs_.emplace(size, std::move(*g));
  }
  synchronize_device();
  device_memory_info(&free_after, &total);
  graphs_generation_ = uploader_->generation();
  return free_before > free_after ? free_before - free_after : size_t{0};
}

StatusOr<std::unique_ptr<DeepseekModel>> load_deepseek_model(const std::string& model_dir,
                                                             const ModelOptions& options,
                                                             const std::vector<std::string>& overrides,
                                                             bool show_progress) {
  namespace fs = std::filesystem;
  NUCLEUS_ASSIGN_OR_RETURN(ModelConfig config,
                           load_model_config((fs::path(model_dir) / "config.json").string(), overrides));
  NUCLEUS_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(model_dir));
  auto backend = make_weight_backend(options.device);
  if (!backend) return unsupported("no weight backend for device " + std::string(device_name(options.device)));
  LoadOptions lo;
  lo.show_progress = show_progress;
  NUCLEUS_ASSIGN_OR_RETURN(ModelWeights weights, load_weights(ckpt, config, *backend, lo));
  return DeepseekModel::create(config, std::move(weights), options);
}

}  // namespace nucleus
