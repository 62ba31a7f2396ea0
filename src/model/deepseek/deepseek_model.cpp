#include "model/deepseek/deepseek_model.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <thread>
#include <sstream>

#include "core/check.h"
#include "core/device.h"
#include "core/env.h"
#include "core/logging.h"
#include "graph/op_profiler.h"
#include "graph/passes/prezero_pass.h"
#include "graph/passes/splitk_pass.h"
#include "model/deepseek/kernel_params.h"
#include "ops/basic_ops.h"
#include "ops/collective_ops.h"
#include "ops/linear_op.h"
#include "ops/mla_front_op.h"
#include "ops/moe_ops.h"
#include "ops/prezero.h"
#include "ops/skinny.h"
#include "ops/splitk.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "kernels/width/mla_front_builds.h"
#include "ops/cuda_backends.h"
#endif

namespace nucleus {

DeepseekModel::DeepseekModel(const ModelConfig& config, ModelWeights weights, const ModelOptions& options)
    : config_(config), weights_(std::move(weights)), options_(options) {
  // The CPU reference's cos/sin cache: 2^16 positions at most (16 MiB at
  // qk_rope_head_dim 64); later positions are computed (rope_ref.h).
  rope_ = kernels::make_rope_table(rope_params(config_),
                                  std::min<int64_t>(config_.max_position_embeddings, int64_t{1} << 16));
  if (options_.device == Device::kCuda) {
    rope_inv_freq_device_ = to_device(Tensor::from_f32({static_cast<int64_t>(rope_.inv_freq.size())}, rope_.inv_freq));
    uploader_ = std::make_unique<DeviceInputUploader>();
  }
}

DeepseekModel::~DeepseekModel() {
  // A group's rank models free their device state on their own threads.
  if (group_) on_ranks([this](DeepseekModel&, int r) {
    ranks_[r].reset();
    return ok_status();
  });
}

StatusOr<std::unique_ptr<DeepseekModel>> DeepseekModel::create(const ModelConfig& config, ModelWeights weights,
                                                                const ModelOptions& options) {
  NUCLEUS_CHECK(options.tensor_parallel_size == 1, "DeepseekModel::create of tensor-parallel size {}",
                options.tensor_parallel_size);
  return build_graphs(std::unique_ptr<DeepseekModel>(new DeepseekModel(config, std::move(weights), options)));
}

StatusOr<std::unique_ptr<DeepseekModel>> DeepseekModel::create_rank(const ModelConfig& config, ModelWeights weights,
                                                                     const ModelOptions& options, RankContext rank) {
  NUCLEUS_CHECK(rank.comm && rank.comm->world_size() == rank.shard.world_size && rank.comm->rank() == rank.shard.rank,
                "rank {} of {} without its communicator", rank.shard.rank, rank.shard.world_size);
  std::unique_ptr<DeepseekModel> m(new DeepseekModel(config, std::move(weights), options));
  m->rank_ = std::move(rank);
  return build_graphs(std::move(m));
}

std::unique_ptr<DeepseekModel> DeepseekModel::create_group(const ModelConfig& config, const ModelOptions& options,
                                                           std::unique_ptr<TpGroup> group,
                                                           std::vector<std::unique_ptr<DeepseekModel>> ranks) {
  NUCLEUS_CHECK(group && static_cast<int>(ranks.size()) == group->world_size(), "group of {} ranks, {} models",
                group ? group->world_size() : 0, ranks.size());
  std::unique_ptr<DeepseekModel> m(new DeepseekModel(config, ModelWeights{}, options));
  // The group holds no weights: its cache dtype and k_scale are its ranks'
  // (every rank resolves the same ones: k_scale tensors are replicated).
  m->kv_cache_dtype_ = ranks[0]->kv_cache_dtype_;
  m->kv_k_scales_ = ranks[0]->kv_k_scales_;
  for (const auto& r : ranks)
    NUCLEUS_CHECK(r->kv_cache_dtype_ == m->kv_cache_dtype_ && r->kv_k_scales_ == m->kv_k_scales_,
                  "tensor-parallel ranks disagree on the KV cache dtype or k_scale");
  m->group_ = std::move(group);
  m->ranks_ = std::move(ranks);
  return m;
}

void DeepseekModel::on_ranks(const std::function<Status(DeepseekModel&, int)>& fn) const {
  Status s = group_->run([&](int r) { return fn(*ranks_[r], r); });
  NUCLEUS_CHECK(s.ok(), "tensor-parallel ranks: {}", s.to_string());
}

StatusOr<std::unique_ptr<DeepseekModel>> DeepseekModel::build_graphs(std::unique_ptr<DeepseekModel> m) {
  const ModelOptions& options = m->options_;
  NUCLEUS_RETURN_IF_ERROR(splitk_env_status());
  NUCLEUS_RETURN_IF_ERROR(skinny_env_status());
  NUCLEUS_RETURN_IF_ERROR(prezero_env_status());
  NUCLEUS_ASSIGN_OR_RETURN(m->kv_cache_dtype_, resolve_kv_cache_dtype(options.kv_cache_dtype, options.device));
  NUCLEUS_RETURN_IF_ERROR(m->resolve_k_scales());
  NUCLEUS_RETURN_IF_ERROR(m->prepare_width_builds());
  m->build(m->prefill_graph_, StepKind::kPrefill);
  m->build(m->decode_graph_, StepKind::kDecode);
  // Decode GEMMs may run split-K (ops/splitk.h); prefill GEMMs never do.
  for (Node& n : m->decode_graph_.nodes())
    if (auto* lin = dynamic_cast<LinearOp*>(n.op.get())) lin->set_splitk_allowed(true);
  NUCLEUS_RETURN_IF_ERROR(m->prefill_graph_.select_backends(options.device).with_context("prefill graph"));
  NUCLEUS_RETURN_IF_ERROR(m->decode_graph_.select_backends(options.device).with_context("decode graph"));
  // Prefill segments: attention and the logits tail run eagerly.
  for (size_t i = 0; i < m->prefill_graph_.nodes().size(); ++i) {
    const std::string kind = m->prefill_graph_.nodes()[i].op->kind();
    const bool eager = kind == "mla_decode" || kind == "mla_prefill" || kind == "gather_rows" ||
                       kind == "all_gather_vocab" || m->prefill_graph_.nodes()[i].name == "lm_head";
    if (m->prefill_segments_.empty() || m->prefill_segments_.back().graph == eager)
      m->prefill_segments_.push_back({i, i, !eager});
    m->prefill_segments_.back().end = i + 1;
  }
  const bool dump = env_flag("NUCLEUS_DUMP_GRAPH") && m->rank_.shard.rank == 0;  // one rank's graphs
  if (dump) {
    std::fputs(m->prefill_graph_.dump("prefill").c_str(), stderr);
    std::fputs(m->decode_graph_.dump("decode (before passes)").c_str(), stderr);
  }
  // Passes, decode graph only (never prefill): split-K outputs in f32, then prezero.
  NUCLEUS_ASSIGN_OR_RETURN(SplitKPassReport sk, apply_splitk_pass(m->decode_graph_, options.device));
  if (sk.redirected + sk.reselected > 0)
    NUCLEUS_LOG_INFO("split-K pass: {} decode GEMMs write f32, {} kept off split-K", sk.redirected, sk.reselected);
  if (options.enable_prezero) {
    NUCLEUS_ASSIGN_OR_RETURN(PrezeroPassReport r, apply_prezero_pass(m->decode_graph_));
    if (m->rank_.shard.rank == 0)  // every rank's graph is alike
      NUCLEUS_LOG_INFO("prezero pass: {} donors, {} consumers in the decode graph", r.donors, r.consumers);
  }
  if (dump) std::fputs(m->decode_graph_.dump("decode (after passes)").c_str(), stderr);
  NUCLEUS_RETURN_IF_ERROR(m->init_fault_injection());
  return m;
}

Status DeepseekModel::resolve_k_scales() {
  const bool fp8 = kv_cache_dtype_ == KvCacheDtype::kFp8E4M3;
  if (options_.kv_scale) {
    NUCLEUS_RETURN_IF_ERROR(check_k_scale(*options_.kv_scale, "--kv-scale"));
    if (!fp8)
      return invalid_argument(std::string("--kv-scale applies to an FP8 KV cache only (the cache is ") +
                              kv_cache_dtype_name(kv_cache_dtype_) +
                              ", never scaled); add --kv-cache-dtype fp8 or drop --kv-scale");
  }
  kv_k_scales_.assign(static_cast<size_t>(config_.num_hidden_layers), 1.0f);
  int64_t from_checkpoint = 0;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    const std::optional<float>& ck = weights_.layers[l].attn.k_scale;
    from_checkpoint += ck.has_value();
    if (fp8) kv_k_scales_[l] = options_.kv_scale ? *options_.kv_scale : ck.value_or(1.0f);
  }
  if (rank_.shard.rank != 0) return ok_status();  // every rank resolves the same scales: log them once
  if (from_checkpoint > 0 && !fp8)
    NUCLEUS_LOG_INFO("kv cache: the checkpoint's k_scale of {} layers is unused (a {} cache is never scaled)",
                     from_checkpoint, kv_cache_dtype_name(kv_cache_dtype_));
  else if (from_checkpoint > 0 && options_.kv_scale)
    NUCLEUS_LOG_INFO("kv cache: --kv-scale {} overrides the checkpoint's k_scale of {} layers", *options_.kv_scale,
                     from_checkpoint);
  return ok_status();
}

namespace {

// A layer's weights as the mla_front op reads them.
MlaFrontOp::Weights front_weights(const AttentionWeights& aw) {
  MlaFrontOp::Weights w;
  if (aw.q_a_proj) {
    w.q_a = &*aw.q_a_proj;
    w.q_a_norm = &aw.q_a_layernorm;
    w.q = &*aw.q_b_proj;
  } else {
    w.q = &*aw.q_proj;
  }
  w.kv_a = &aw.kv_a_proj;
  w.kv_a_norm = &aw.kv_a_layernorm;
  w.kv_b = &aw.kv_b_proj;
  return w;
}


}  // namespace

Status DeepseekModel::prepare_width_builds() {
  if (options_.width_builds == width::WidthBuildsMode::kOff || options_.device != Device::kCuda) return ok_status();
#ifdef NUCLEUS_HAVE_CUDA
  const bool strict = width::strict_widths_from_env();
  auto off = [&](const std::string& why) -> Status {
    const std::string msg = "width builds (NUCLEUS_WIDTH_BUILDS=" +
                            std::string(width::width_builds_mode_name(options_.width_builds)) +
                            ") cannot serve this model: " + why;
    if (strict) return failed_precondition(msg + " (NUCLEUS_STRICT_WIDTHS=1)");
    NUCLEUS_LOG_WARN("{}; the decode graph runs the separate ops", msg);
    return ok_status();
  };
  if (options_.cuda_graph_sizes.empty()) return off("no decode graph sizes to build for (--enforce-eager)");
  if (options_.attention_mode == AttentionMode::kExpanded) return off("attention mode is expanded");
  const ModelConfig& c = config_;
  kernels::MlaDims dims;
  dims.num_heads = c.num_attention_heads / rank_.shard.world_size;
  dims.qk_nope = c.qk_nope_head_dim;
  dims.qk_rope = c.qk_rope_head_dim;
  dims.v_head = c.v_head_dim;
  dims.kv_lora = c.kv_lora_rank;
  for (const LayerWeights& lw : weights_.layers) {
    Status s = mla_front_supported(front_weights(lw.attn), c.hidden_size, lw.attn.q_a_proj ? c.q_lora_rank : 0, dims,
                                   kv_cache_dtype_);
    if (!s.ok()) return off(s.message());
  }
  NUCLEUS_ASSIGN_OR_RETURN(width::MlaFrontBuildOptions bo, width::MlaFrontBuildOptions::from_env());
  if (!bo.cache_dir.empty()) {
    if (Status w = width::KernelCache(bo.cache_dir).check_writable(); !w.ok()) {
      NUCLEUS_LOG_WARN("{}; width builds are compiled without a cache (set NUCLEUS_KERNEL_CACHE_DIR)", w.message());
      bo.cache_dir.clear();
    }
  }
  width::MlaFrontBuilder builder(bo);
  width::OnlyVariantBuilder lean_only(builder, width::BuildVariant::kLean, "NUCLEUS_WIDTH_BUILDS=lean");
  width::WidthPlanOptions po;
  po.strict = strict;
  // Tensor-parallel ranks plan one after another: the first compiles (in
  // parallel, below), the others then load every build from the cache.
  static std::mutex plan_mutex;
  std::lock_guard<std::mutex> plan_lock(plan_mutex);
  const auto t0 = std::chrono::steady_clock::now();
  // A cold cache: the first builds the plan asks for, compiled in parallel
  // (one job per hardware thread) into the cache; the plan then loads them
  // and compiles lean rebuilds where it must (small).
  int prebuilt = 0;
  if (!bo.cache_dir.empty()) {
    const width::BuildVariant first = options_.width_builds == width::WidthBuildsMode::kLeanOnly
                                          ? width::BuildVariant::kLean
                                          : width::BuildVariant::kFused;
    const int jobs = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (const width::PrebuildResult& r : width::prebuild_widths(builder, options_.cuda_graph_sizes, {first}, jobs)) {
      prebuilt += r.compiled ? 1 : 0;
      if (!r.status.ok())  // the plan compiles it again and records the refusal
        NUCLEUS_LOG_DEBUG("width {} {} prebuild: {}", r.width, width::variant_name(r.variant), r.status.message());
    }
  }
  NUCLEUS_ASSIGN_OR_RETURN(
      std::unique_ptr<width::MlaFrontWidthBuilds> builds,
      width::MlaFrontWidthBuilds::create(options_.cuda_graph_sizes,
                                         options_.width_builds == width::WidthBuildsMode::kLeanOnly
                                             ? static_cast<width::WidthBuilder&>(lean_only)
                                             : static_cast<width::WidthBuilder&>(builder),
                                         po, bo.sm_count, bo.cooperative));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int fused = 0, lean = 0, plain = 0;
  for (const width::WidthChoice& ch : builds->choices())
    (ch.served == width::BuildVariant::kFused ? fused : ch.served == width::BuildVariant::kLean ? lean : plain)++;
  if (rank_.shard.rank == 0)
    NUCLEUS_LOG_INFO("width builds: {} widths ({} fused, {} lean, {} plain) ready in {:.2f} s, {} NVRTC compiles "
                     "(cache {})",
                     builds->choices().size(), fused, lean, plain, secs, prebuilt + builder.compiles(),
                     bo.cache_dir.empty() ? std::string("off") : bo.cache_dir);
  width_builds_ = std::move(builds);
  width_barrier_ = Tensor::empty({2}, DType::kI32, Device::kCuda);
  zero_device(width_barrier_);
  return ok_status();
#else
  return unsupported("width builds need a CUDA build");
#endif
}

void DeepseekModel::build(StepGraph& g, StepKind kind) {
  const ModelConfig& c = config_;
  // Under tensor parallelism the rank's weights hold its nh / n heads and its
  // slices of the intermediate widths and of the vocabulary.
  const int64_t tp = rank_.shard.world_size;
  const int64_t H = c.hidden_size, nh = c.num_attention_heads / tp;
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
  const size_t buffers_before = g.buffers().size();
  const int x_norm = g.buffer("x_norm", H, act);
  const int delta = g.buffer("delta", H, act);
  const int q = g.buffer("q", nh * c.qk_head_dim(), act);
  const int kv_a = g.buffer("kv_a", c.kv_cache_width(), act);
  const int attn_out = g.buffer("attn_out", nh * c.v_head_dim, act);
  const int64_t W = options_.scratch_rows;
  const int q_lat = g.scratch("mla_q_lat", W, nh * c.kv_lora_rank, DType::kF32);
  const int o_lat = g.scratch("mla_o_lat", W, nh * c.kv_lora_rank, DType::kF32);

  g.add("embed_tokens",
        std::make_unique<EmbeddingOp>(weights_.embed_tokens,
                                      VocabShard{rank_.shard.rank * (c.vocab_size / tp), rank_.comm}),
        {}, {residual});
  // The residual add + RMSNorm after a partial sum: with tensor parallelism
  // it all-reduces the delta first (fused on CUDA when it can).
  auto add_norm = [&](const Tensor& weight, bool has_delta) {
    auto op = std::make_unique<AddRmsNormOp>(weight, eps, has_delta);
    if (has_delta && rank_.comm)
      op->set_all_reduce(AllReduceSpec{rank_.comm, rank_.peer_signals, options_.fuse_allreduce_norm});
    return op;
  };

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
    g.add(p + "input_layernorm", add_norm(lw.input_layernorm, l > 0), norm_in, {residual, x_norm});
    if (kind == StepKind::kDecode && width_builds_) {
      // The whole front end as one op (width builds); attention reads its q_full.
      const int q_a = g.buffer("q_a", std::max<int64_t>(c.q_lora_rank, 8), act);
      const int q_full = g.buffer("mla_q_full", nh * c.kv_cache_width(), act);
      const int q_nope = g.buffer("mla_q_nope", nh * c.qk_nope_head_dim, act);
      g.add(p + "self_attn.mla_front",
            std::make_unique<MlaFrontOp>(
                l, front_weights(aw), H, aw.q_a_proj ? c.q_lora_rank : 0, nh, eps,
                rope_inv_freq_device_.data<float>(), static_cast<float>(rope_params(c).attention_factor),
                kv_cache_dtype_, width_builds_.get(), width_barrier_.raw()),
            {x_norm}, {q, q_full, kv_a, q_a, q_nope});
      g.add(p + "self_attn.attn_decode",
            std::make_unique<MlaDecodeAttentionOp>(l, &aw.kv_b_proj, dims, mode, kv_cache_dtype_), {q, q_full},
            {attn_out, q_lat, o_lat});
    } else {
      if (aw.q_a_proj) {
        const int q_a = g.buffer("q_a", c.q_lora_rank, act);
        g.add(p + "self_attn.q_a_proj", std::make_unique<LinearOp>(&*aw.q_a_proj, false), {x_norm}, {q_a});
        g.add(p + "self_attn.q_a_layernorm", std::make_unique<RmsNormOp>(aw.q_a_layernorm, eps), {q_a}, {q_a});
        g.add(p + "self_attn.q_b_proj", std::make_unique<LinearOp>(&*aw.q_b_proj, false), {q_a}, {q});
      } else {
        g.add(p + "self_attn.q_proj", std::make_unique<LinearOp>(&*aw.q_proj, false), {x_norm}, {q});
      }
      g.add(p + "self_attn.kv_a_proj_with_mqa", std::make_unique<LinearOp>(&aw.kv_a_proj, false), {x_norm},
            {kv_a});
      g.add(p + "self_attn.kv_a_layernorm", std::make_unique<RmsNormOp>(aw.kv_a_layernorm, eps), {kv_a}, {kv_a});
      g.add(p + "self_attn.rope_kv_cache_write",
            std::make_unique<RopeKvCacheWriteOp>(
                l, &rope_, dims, rope_inv_freq_device_.defined() ? rope_inv_freq_device_.data<float>() : nullptr,
                static_cast<float>(rope_params(c).attention_factor), kv_cache_dtype_),
            {q, kv_a}, {q});
      // The decode graph has only single-token sequences: no prefill op
      // unless expanded attention is forced.
      if (mode != AttentionMode::kExpanded)
        g.add(p + "self_attn.attn_decode",
              std::make_unique<MlaDecodeAttentionOp>(l, &aw.kv_b_proj, dims, mode, kv_cache_dtype_), {q},
              {attn_out, q_lat, o_lat});
      if (mode == AttentionMode::kExpanded || (mode == AttentionMode::kAuto && kind == StepKind::kPrefill))
        g.add(p + "self_attn.attn_prefill",
              std::make_unique<MlaPrefillAttentionOp>(l, &aw.kv_b_proj, dims, mode, options_.prefill_context_chunk,
                                                      kv_cache_dtype_),
              {q}, {attn_out});
    }
    g.add(p + "self_attn.o_proj", std::make_unique<LinearOp>(&aw.o_proj, false), {attn_out}, {delta});
    // FFN block.
    g.add(p + "post_attention_layernorm", add_norm(lw.post_attention_layernorm, true), {residual, delta},
          {residual, x_norm});
    if (lw.moe) {
      const MoeWeights& m = *lw.moe;
      const int64_t E = c.n_routed_experts, k = c.num_experts_per_tok;
      const int logits = g.buffer("router_logits", E, DType::kF32);
      const int ids = g.buffer("topk_ids", k, DType::kI32);
      const int weights = g.buffer("topk_weights", k, DType::kF32);
      g.add(p + "mlp.gate", std::make_unique<LinearOp>(&m.router, false), {x_norm}, {logits});
      g.add(p + "mlp.route",
            std::make_unique<MoeRouteOp>(moe_routing_params(c), m.e_score_correction_bias),
            {logits}, {ids, weights});
      std::vector<ExpertWeights> experts;
      for (const auto& e : m.experts) experts.push_back({&e.gate_up, &e.down});
      const int64_t inter = c.moe_intermediate_size / tp;  // each expert's slice on this rank
      const int moe_scratch = g.scratch("moe_scratch", W, k * inter, DType::kF32);
      g.add(p + "mlp.experts", std::make_unique<MoeExpertsOp>(std::move(experts), inter, k), {x_norm, ids, weights},
            {delta, moe_scratch});
      if (m.shared) add_mlp(p + "mlp.shared_experts", *m.shared, x_norm, delta, /*accumulate=*/true);
    } else {
      add_mlp(p + "mlp", *lw.mlp, x_norm, delta, /*accumulate=*/false);
    }
  }
  g.add("norm", add_norm(weights_.norm, true), {residual, delta}, {residual, x_norm});
  const int lm_in = g.buffer("lm_head_in", H, act, RowSpace::kLogits);
  const int logits = g.buffer("logits", c.vocab_size, DType::kF32, RowSpace::kLogits);
  g.add("gather_logit_rows", std::make_unique<GatherLogitRowsOp>(), {x_norm}, {lm_in});
  if (rank_.comm) {  // this rank's vocabulary slice of the logits, then everyone's
    const int local = g.buffer("logits_local", c.vocab_size / tp, DType::kF32, RowSpace::kLogits);
    const int gathered = g.buffer("logits_gathered", c.vocab_size, DType::kF32, RowSpace::kLogits);
    g.add("lm_head", std::make_unique<LinearOp>(&weights_.lm_head, false), {lm_in}, {local});
    g.add("logits_all_gather", std::make_unique<AllGatherVocabOp>(rank_.comm), {local}, {logits, gathered});
  } else {
    g.add("lm_head", std::make_unique<LinearOp>(&weights_.lm_head, false), {lm_in}, {logits});
  }
  // Buffers the CUDA backend stores in bf16 (for cpu_bf16_emulation).
  auto& rounded = kind == StepKind::kDecode ? bf16_buffers_decode_ : bf16_buffers_prefill_;
  static const char* kF32Buffers[] = {"residual", "router_logits", "topk_ids",     "topk_weights",
                                      "logits",   "mla_q_lat",     "mla_o_lat",    "moe_scratch",
                                      "logits_local", "logits_gathered"};
  for (size_t id = buffers_before; id < g.buffers().size(); ++id) {
    bool keep = false;
    for (const char* n : kF32Buffers) keep |= g.buffers()[id].name == n;
    if (!keep) rounded.push_back(static_cast<int>(id));
  }
}

KvCache DeepseekModel::make_kv_cache(int64_t num_blocks, int64_t block_size) const {
  if (group_) {
    std::vector<KvCache> caches(ranks_.size());
    on_ranks([&](DeepseekModel& m, int r) {
      caches[r] = m.make_kv_cache(num_blocks, block_size);
      return ok_status();
    });
    KvCache kv = caches[0];
    kv.ranks = std::move(caches);
    return kv;
  }
  KvCache kv;
  kv.num_layers = config_.num_hidden_layers;
  kv.num_blocks = num_blocks;
  kv.block_size = block_size;
  kv.width = config_.kv_cache_width();
  const DType dt = kv_cache_storage_dtype(kv_cache_dtype_);
  if (options_.device == Device::kCuda) {
    kv.data = Tensor::empty({kv.num_layers, num_blocks, block_size, kv.width}, dt, Device::kCuda);
    zero_device(kv.data);
  } else {
    kv.data = Tensor::zeros({kv.num_layers, num_blocks, block_size, kv.width}, dt);
  }
  if (kv_cache_dtype_ == KvCacheDtype::kFp8E4M3) kv.k_scale = kv_k_scales_;
  return kv;
}

void DeepseekModel::drop_graphs() {
  if (group_) {
    on_ranks([](DeepseekModel& m, int) {
      m.drop_graphs();
      return ok_status();
    });
    return;
  }
  decode_graphs_.clear();
  token_graphs_.clear();
}

void DeepseekModel::reserve_step_buffers(int64_t max_tokens, int64_t max_logits, int64_t max_prefill_logits) {
  if (group_) {
    on_ranks([&](DeepseekModel& m, int) {
      m.reserve_step_buffers(max_tokens, max_logits, max_prefill_logits);
      return ok_status();
    });
    return;
  }
  const int64_t prefill_logits = std::max(max_logits, max_prefill_logits);
  prefill_buffers_.for_step(prefill_graph_, max_tokens, prefill_logits, options_.device);
  decode_buffers_.for_step(decode_graph_, max_logits, max_logits, options_.device);
  if (uploader_) {
    // One sequence more than a step can hold: a padded token-graph step adds
    // its pad sequence. Without it, a step of max_num_seqs sequences padded
    // to a bucket grew (reallocated) the upload buffer under the captured
    // graphs, which then read freed memory.
    const int64_t width = std::max<int64_t>(options_.max_blocks_per_seq, 1), seqs = max_logits + 1;
    uploader_->reserve({std::max(max_tokens, max_logits), seqs, seqs * width, prefill_logits});
  }
}

int64_t DeepseekModel::kv_bytes_per_token() const {
  const auto elem = static_cast<int64_t>(dtype_size(kv_cache_storage_dtype(kv_cache_dtype_)));
  return config_.num_hidden_layers * config_.kv_cache_width() * elem;
}

DeepseekModel::WeightBytes DeepseekModel::weight_bytes() const {
  if (!ranks_.empty()) return ranks_[0]->weight_bytes();
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
  NUCLEUS_ASSIGN_OR_RETURN(Tensor logits, forward_logits(inputs, kv_cache, stats));
  return logits.device() == Device::kCuda ? to_host(logits) : logits;
}

Status DeepseekModel::init_fault_injection() {
  auto plan = parse_fault_plan(env_string("NUCLEUS_FAULT_INJECT").value_or(""));
  if (!plan.ok()) return plan.status();
  if (!plan->has_value()) return ok_status();
  std::string kinds;
  for (StepGraph* g : {&prefill_graph_, &decode_graph_})
    for (const Node& n : g->nodes())
      if (kinds.find(std::string(" ") + n.op->kind() + ",") == std::string::npos) kinds += std::string(" ") + n.op->kind() + ",";
  if (kinds.find(" " + (*plan)->kind + ",") == std::string::npos)
    return invalid_argument("NUCLEUS_FAULT_INJECT names op kind '" + (*plan)->kind + "', which no node of the model has" +
                            " (kinds:" + kinds.substr(0, kinds.size() - 1) + ")");
  if (rank_.shard.rank == 0)
    NUCLEUS_LOG_WARN("NUCLEUS_FAULT_INJECT: run {} of op {} will fail{} (a test switch)", (*plan)->nth, (*plan)->kind,
                     (*plan)->fatal ? ", fatally" : "");
  faults_ = std::make_unique<FaultInjector>(**plan);
  return ok_status();
}

Status DeepseekModel::health() {
  if (group_) {
    if (!broken_.ok()) return broken_;
    for (auto& r : ranks_)
      if (r->faults_ && r->faults_->fatal_fired()) return aborted("a fatal fault was injected (NUCLEUS_FAULT_INJECT)");
    return ok_status();
  }
  if (faults_ && faults_->fatal_fired())
    return aborted("a fatal fault was injected (NUCLEUS_FAULT_INJECT=" + faults_->plan().kind + ":" +
                   std::to_string(faults_->plan().nth) + ":fatal)");
  if (options_.device == Device::kCuda) return device_health();
  return ok_status();
}

StatusOr<Tensor> DeepseekModel::forward_group(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats) {
  NUCLEUS_CHECK(kv_cache.ranks.size() == ranks_.size(), "a KV cache of {} ranks for a model of {}",
                kv_cache.ranks.size(), ranks_.size());
  // Every rank runs the same step (same graph, same padding: their
  // collectives must match); rank 0's logits are returned (every rank has
  // them after the all-gather). Each rank records stats of its own; rank 0's
  // are reported (routing is the same on every rank).
  std::vector<Tensor> logits(ranks_.size());
  std::vector<StepStats> rank_stats(ranks_.size());
  if (!broken_.ok()) return broken_;
  Status s = group_->run([&](int r) -> Status {
    NUCLEUS_ASSIGN_OR_RETURN(logits[r], ranks_[r]->forward_logits(inputs, kv_cache.ranks[r],
                                                                   stats ? &rank_stats[r] : nullptr));
    return ok_status();
  });
  if (!s.ok()) {
    // A failed rank aborted every communicator of the group (TpGroup::run):
    // no further step can run its collectives.
    broken_ = aborted("the tensor-parallel group's communicators were aborted by a failed step (" + s.message() + ")");
    return s;
  }
  if (stats) {
    stats->moe_layers += rank_stats[0].moe_layers;
    stats->experts_activated += rank_stats[0].experts_activated;
  }
  return logits[0];
}

StatusOr<Tensor> DeepseekModel::forward_logits(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats) {
  if (group_) return forward_group(inputs, kv_cache, stats);
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
  if (op_profiling_enabled()) op_profile_set_phase(decode ? "decode" : "prefill");
  StepGraph& g = graph(decode ? StepKind::kDecode : StepKind::kPrefill);
  StepBuffers& sb = decode ? decode_buffers_ : prefill_buffers_;
  OpContext ctx;
  ctx.device = options_.device;
  ctx.kv_cache = &kv_cache;
  ctx.stats = stats;
  ctx.faults = faults_.get();
  if (options_.device != Device::kCuda) {
    const std::vector<Tensor>& buffers = sb.for_step(g, inputs.num_tokens(), inputs.num_logits(), options_.device);
    ctx.inputs = &inputs;
    if (!options_.cpu_bf16_emulation) {
      NUCLEUS_RETURN_IF_ERROR(run_nodes(g, ctx, buffers, 0, g.nodes().size()));
    } else {
      const auto& rounded = decode ? bf16_buffers_decode_ : bf16_buffers_prefill_;
      for (size_t i = 0; i < g.nodes().size(); ++i) {
        NUCLEUS_RETURN_IF_ERROR(run_nodes(g, ctx, buffers, i, i + 1));
        for (int id : g.nodes()[i].outputs) {
          if (std::find(rounded.begin(), rounded.end(), id) == rounded.end()) continue;
          float* p = buffers[id].data<float>();
          for (int64_t k = 0; k < buffers[id].numel(); ++k) p[k] = round_to_bf16(p[k]);
        }
        // Emulates a bf16 cache in an f32 one (a bf16 or FP8 cache is stored as such already).
        if (std::string(g.nodes()[i].op->kind()) == "rope_kv_cache_write" && kv_cache.dtype() == KvCacheDtype::kF32) {
          float* c = kv_cache.data.data<float>();
          for (int64_t k = 0; k < kv_cache.data.numel(); ++k) c[k] = round_to_bf16(c[k]);
        }
      }
    }
    return buffers[g.find_buffer("logits")].clone();
  }
  // CUDA: replay a captured decode graph when one fits, else run eagerly.
  const int64_t padded = decode && !stats ? graph_size_for(inputs.num_seqs()) : 0;
  // The graphs return the first rows in order: a step whose logit rows are
  // others (a sequence whose one token is a prompt position, not its last)
  // runs eagerly.
  bool leading_rows = true;
  for (int64_t i = 0; i < inputs.num_logits(); ++i) leading_rows = leading_rows && inputs.logit_indices[i] == i;
  if (padded > 0 && leading_rows && inputs.max_blocks_per_seq <= options_.max_blocks_per_seq &&
      uploader_->generation() == graphs_generation_) {
    StepInputs p = pad_decode_step(inputs, padded, static_cast<int32_t>(options_.max_blocks_per_seq));
    const std::vector<Tensor>& buffers = sb.for_step(g, padded, padded, options_.device);
    DeviceStepInputs dev = uploader_->upload(p);
    if (options_.graph_eager_pad) {
      ctx.inputs = &p;
      ctx.dev = &dev;
      NUCLEUS_RETURN_IF_ERROR(run_nodes(g, ctx, buffers, 0, g.nodes().size()));
    } else {
      decode_graphs_.at(padded).replay();
      ++graph_replays_;
    }
    return buffers[g.find_buffer("logits")].rows(0, inputs.num_logits());
  }
  if (!decode && !stats) {
    const int64_t bucket = token_bucket_for(inputs.num_tokens());
    if (bucket > 0 && uploader_->generation() == graphs_generation_) return forward_token_graph(inputs, kv_cache, bucket);
    NUCLEUS_LOG_DEBUG("prefill step of {} tokens runs eagerly ({})", inputs.num_tokens(),
                      token_graphs_.empty() ? "no token graphs" : "larger than the largest bucket");
  }
  const std::vector<Tensor>& buffers = sb.for_step(g, inputs.num_tokens(), inputs.num_logits(), options_.device);
  DeviceStepInputs dev = uploader_->upload(inputs);
  ctx.inputs = &inputs;
  ctx.dev = &dev;
  NUCLEUS_RETURN_IF_ERROR(run_nodes(g, ctx, buffers, 0, g.nodes().size()));
  return buffers[g.find_buffer("logits")];
}

StatusOr<Tensor> DeepseekModel::forward_token_graph(const StepInputs& inputs, KvCache& kv_cache, int64_t bucket) {
  StepGraph& g = prefill_graph_;
  const int64_t T = inputs.num_tokens();
  StepInputs padded = pad_prefill_step(inputs, bucket);
  const std::vector<Tensor>& full = prefill_buffers_.for_step(g, bucket, inputs.num_logits(), options_.device);
  std::vector<Tensor> full_copy = full;  // views at bucket height
  const std::vector<Tensor>& real = prefill_buffers_.for_step(g, T, inputs.num_logits(), options_.device);
  DeviceStepInputs dev = uploader_->upload(padded);
  if (uploader_->generation() != graphs_generation_) {
    // The padded step outgrew the upload buffer, which moved: the graphs
    // hold the old addresses. Run this step eagerly (the buffer now fits).
    NUCLEUS_LOG_DEBUG("prefill step of {} tokens runs eagerly (the padded metadata outgrew the reserved buffer)", T);
    const std::vector<Tensor>& buffers = prefill_buffers_.for_step(g, T, inputs.num_logits(), options_.device);
    DeviceStepInputs eager_dev = uploader_->upload(inputs);
    OpContext ectx;
    ectx.device = options_.device;
    ectx.kv_cache = &kv_cache;
    ectx.inputs = &inputs;
    ectx.dev = &eager_dev;
    ectx.faults = faults_.get();
    NUCLEUS_RETURN_IF_ERROR(run_nodes(g, ectx, buffers, 0, g.nodes().size()));
    return buffers[g.find_buffer("logits")];
  }
  // The eager regions see the real rows only: the pad sequence (the last
  // one) must not count among the one-token rows that decode attention
  // serves, as it would when the pad is a single row.
  DeviceStepInputs dev_real = dev;
  dev_real.num_single_token_rows = 0;
  for (int64_t s = 0; s < inputs.num_seqs(); ++s) dev_real.num_single_token_rows += inputs.query_len(s) == 1;
  OpContext ctx;
  ctx.device = options_.device;
  ctx.kv_cache = &kv_cache;
  ctx.faults = faults_.get();
  const int attn_out = g.find_buffer("attn_out");
  size_t graph_index = 0;
  for (const Segment& seg : prefill_segments_) {
    if (seg.graph) {
      if (options_.token_graph_eager_pad) {
        ctx.inputs = &padded;
        ctx.dev = &dev;
        NUCLEUS_RETURN_IF_ERROR(run_nodes(g, ctx, full_copy, seg.begin, seg.end));
      } else {
        token_graphs_.at(bucket)[graph_index].replay();
      }
      ++graph_index;
      continue;
    }
    // Eager region on the real rows; attention hands back zero pad rows.
    ctx.inputs = &inputs;
    ctx.dev = &dev_real;
    NUCLEUS_RETURN_IF_ERROR(run_nodes(g, ctx, real, seg.begin, seg.end));
    const std::string kind = g.nodes()[seg.begin].op->kind();
    if (kind == "mla_decode" || kind == "mla_prefill") zero_rows_async(full_copy[attn_out], T, bucket - T);
  }
  if (!options_.token_graph_eager_pad) ++token_graph_replays_;
  return real[g.find_buffer("logits")];
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

StatusOr<std::vector<int64_t>> token_graph_sizes_from_env(int64_t max_num_batched_tokens) {
  std::vector<int64_t> sizes = {256, 512, 1024, 2048, 3072};
  if (auto env = env_string("NUCLEUS_TOKEN_GRAPH_SIZES")) {
    sizes.clear();
    std::stringstream ss(*env);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.empty()) continue;
      char* end = nullptr;
      const long long v = std::strtoll(item.c_str(), &end, 10);
      if (*end != '\0' || v < 1)
        return invalid_argument("NUCLEUS_TOKEN_GRAPH_SIZES: '" + item + "' is not a positive integer");
      sizes.push_back(v);
    }
  }
  std::vector<int64_t> out;
  for (int64_t s : sizes)
    if (s <= max_num_batched_tokens) out.push_back(s);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
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

int64_t DeepseekModel::token_bucket_for(int64_t num_tokens) const {
  if (!ranks_.empty()) return ranks_[0]->token_bucket_for(num_tokens);
  auto it = token_graphs_.lower_bound(num_tokens);
  return it == token_graphs_.end() ? 0 : it->first;
}

int64_t DeepseekModel::graph_size_for(int64_t num_seqs) const {
  if (!ranks_.empty()) return ranks_[0]->graph_size_for(num_seqs);
  auto it = decode_graphs_.lower_bound(num_seqs);
  return it == decode_graphs_.end() ? 0 : it->first;
}

StatusOr<size_t> DeepseekModel::capture_decode_graphs(KvCache& kv_cache) {
  if (group_) {  // every rank captures at once (their warm-up steps run collectives); rank 0's bytes
    NUCLEUS_CHECK(kv_cache.ranks.size() == ranks_.size(), "a KV cache of {} ranks for a model of {}",
                  kv_cache.ranks.size(), ranks_.size());
    std::vector<size_t> bytes(ranks_.size());
    NUCLEUS_RETURN_IF_ERROR(group_->run([&](int r) -> Status {
      NUCLEUS_ASSIGN_OR_RETURN(bytes[r], ranks_[r]->capture_decode_graphs(kv_cache.ranks[r]));
      return ok_status();
    }));
    return bytes[0];
  }
  decode_graphs_.clear();
  token_graphs_.clear();
  if (options_.device != Device::kCuda) return size_t{0};
  if (op_profiling_enabled()) op_profile_set_phase("graph warm-up");
  const int64_t largest = options_.cuda_graph_sizes.empty() ? 1 : options_.cuda_graph_sizes.back();
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
    // Warm-up (plans, lazy state), then the capture; neither counts toward NUCLEUS_FAULT_INJECT.
    NUCLEUS_RETURN_IF_ERROR(run_nodes(decode_graph_, ctx, buffers, 0, decode_graph_.nodes().size())
                                .with_context("decode graph warm-up of batch " + std::to_string(size)));
    auto g = CudaGraph::capture([&] { return run_nodes(decode_graph_, ctx, buffers, 0, decode_graph_.nodes().size()); });
    if (!g.ok()) return g.status().with_context("decode graph of batch " + std::to_string(size));
    decode_graphs_.emplace(size, std::move(*g));
  }
  // Token graphs: the prefill graph's segments at each bucket height, captured
  // from a request-less step (every row a pad row).
  token_graphs_.clear();
  for (int64_t bucket : options_.token_graph_sizes) {
    StepInputs empty_prefill;
    empty_prefill.query_start = {0};
    StepInputs dummy = pad_prefill_step(empty_prefill, bucket);
    const std::vector<Tensor>& buffers = prefill_buffers_.for_step(prefill_graph_, bucket, 0, options_.device);
    std::vector<Tensor> views = buffers;
    DeviceStepInputs dev = uploader_->upload(dummy);
    OpContext ctx;
    ctx.device = options_.device;
    ctx.kv_cache = &kv_cache;
    ctx.inputs = &dummy;
    ctx.dev = &dev;
    std::vector<CudaGraph> graphs;
    for (const Segment& seg : prefill_segments_) {
      if (!seg.graph) continue;
      NUCLEUS_RETURN_IF_ERROR(run_nodes(prefill_graph_, ctx, views, seg.begin, seg.end)  // warm-up
                                  .with_context("token graph warm-up of bucket " + std::to_string(bucket)));
      auto cg = CudaGraph::capture([&] { return run_nodes(prefill_graph_, ctx, views, seg.begin, seg.end); });
      if (!cg.ok()) return cg.status().with_context("token graph of bucket " + std::to_string(bucket));
      graphs.push_back(std::move(*cg));
    }
    token_graphs_.emplace(bucket, std::move(graphs));
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
  return build_deepseek_model(config, options, [&](WeightBackend& backend, const TpShard& shard) {
    LoadOptions lo;
    lo.show_progress = show_progress && shard.rank == 0;
    lo.check_values = options.check_weights;
    return load_weights(ckpt, config, backend, lo, shard);
  });
}

StatusOr<std::unique_ptr<DeepseekModel>> build_deepseek_model(const ModelConfig& config, const ModelOptions& options,
                                                              const WeightFactory& make_weights) {
  const int n = static_cast<int>(options.tensor_parallel_size);
  if (n == 1 && !options.force_tp_group) {
    auto backend = make_weight_backend(options.device);
    if (!backend) return unsupported("no weight backend for device " + std::string(device_name(options.device)));
    NUCLEUS_ASSIGN_OR_RETURN(ModelWeights weights, make_weights(*backend, TpShard{}));
    return DeepseekModel::create(config, std::move(weights), options);
  }
  NUCLEUS_RETURN_IF_ERROR(check_tp_config(config, n));
  NUCLEUS_ASSIGN_OR_RETURN(std::unique_ptr<TpGroup> group, TpGroup::create(n, options.device));
  std::vector<void*> signals;
#ifdef NUCLEUS_HAVE_CUDA
  if (options.device == Device::kCuda && options.fuse_allreduce_norm) {
    auto s = group->make_peer_buffers(cuda_ops::fused_allreduce_signal_bytes());
    if (s.ok()) {
      signals = std::move(*s);
    } else {
      NUCLEUS_LOG_WARN("fused all-reduce + RMSNorm unavailable, using NCCL then add+norm: {}", s.status().message());
    }
  }
#endif
  std::vector<std::unique_ptr<DeepseekModel>> ranks(n);
  NUCLEUS_RETURN_IF_ERROR(group->run([&](int r) -> Status {
    auto backend = make_weight_backend(options.device);
    if (!backend) return unsupported("no weight backend for device " + std::string(device_name(options.device)));
    const TpShard shard{r, n};
    NUCLEUS_ASSIGN_OR_RETURN(ModelWeights weights, make_weights(*backend, shard));
    ModelOptions rank_options = options;
    rank_options.tensor_parallel_size = 1;  // a rank is one model; the group is the facade's
    NUCLEUS_ASSIGN_OR_RETURN(ranks[r], DeepseekModel::create_rank(config, std::move(weights), rank_options,
                                                                  {shard, &group->comm(r), signals}));
    return ok_status();
  }));
  NUCLEUS_LOG_INFO("tensor parallelism: {} ranks on {} ({} communicators{})", n, device_name(options.device),
                   group->comm(0).backend(),
                   options.device == Device::kCuda
                       ? (signals.empty() ? ", all-reduce + RMSNorm unfused" : ", all-reduce + RMSNorm fused")
                       : "");
  return DeepseekModel::create_group(config, options, std::move(group), std::move(ranks));
}

}  // namespace nucleus
