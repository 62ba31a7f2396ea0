#include "model/deepseek/deepseek_model.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <optional>

#include "core/check.h"
#include "core/device.h"
#include "core/knobs.h"
#include "core/logging.h"
#include "graph/op_profiler.h"
#include "graph/passes/prezero_pass.h"
#include "graph/passes/splitk_pass.h"
#include "model/deepseek/kernel_params.h"
#include "ops/basic_ops.h"
#include "ops/collective_ops.h"
#include "ops/linear_op.h"
#include "ops/mla_decode.h"
#include "ops/mla_front_op.h"
#include "ops/mla_prefill.h"
#include "ops/moe_decode.h"
#include "ops/moe_ops.h"
#include "ops/decode_program.h"
#include "ops/front_program_op.h"
#include "ops/moe_program_op.h"
#include "ops/prezero.h"
#include "ops/rope_kv_cache_write.h"
#include "ops/skinny.h"
#include "ops/splitk.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "jit/mla_front_builds.h"
#endif

namespace nucleus {

DeepseekModel::DeepseekModel(const ModelConfig& config, ModelWeights weights, const ModelOptions& options,
                             RankContext rank)
    : config_(config), weights_(std::move(weights)), options_(options), rank_(std::move(rank)) {
  // The CPU reference's cos/sin cache: 2^16 positions at most (16 MiB at
  // qk_rope_head_dim 64); later positions are computed (rope_ref.h).
  rope_ = kernels::make_rope_table(rope_params(config_),
                                  std::min<int64_t>(config_.max_position_embeddings, int64_t{1} << 16));
  if (options_.device == Device::kCuda)
    rope_inv_freq_device_ = to_device(Tensor::from_f32({static_cast<int64_t>(rope_.inv_freq.size())}, rope_.inv_freq));
}

DeepseekModel::~DeepseekModel() = default;

StatusOr<std::unique_ptr<DeepseekModel>> DeepseekModel::create(const ModelConfig& config, ModelWeights weights,
                                                                const ModelOptions& options, RankContext rank) {
  NUCLEUS_CHECK(rank.shard.world_size == 1 || (rank.comm && rank.comm->world_size() == rank.shard.world_size &&
                                               rank.comm->rank() == rank.shard.rank),
                "rank {} of {} without its communicator", rank.shard.rank, rank.shard.world_size);
  NUCLEUS_CHECK(options.tensor_parallel_size == 1, "DeepseekModel::create of tensor-parallel size {} (a rank is one model)",
                options.tensor_parallel_size);
  std::unique_ptr<DeepseekModel> m(new DeepseekModel(config, std::move(weights), options, std::move(rank)));
  NUCLEUS_RETURN_IF_ERROR(env_status());
  NUCLEUS_ASSIGN_OR_RETURN(m->kv_cache_dtype_, resolve_kv_cache_dtype(options.kv_cache_dtype, options.device));
  NUCLEUS_RETURN_IF_ERROR(check_kv_cache_dims(m->kv_cache_dtype_, config.kv_lora_rank, config.qk_rope_head_dim));
  NUCLEUS_RETURN_IF_ERROR(m->resolve_k_scales());
  NUCLEUS_RETURN_IF_ERROR(m->prepare_width_builds());
  return m;
}

Status DeepseekModel::env_status() {
  NUCLEUS_RETURN_IF_ERROR(flag_env_status());
  NUCLEUS_RETURN_IF_ERROR(splitk_env_status());
  NUCLEUS_RETURN_IF_ERROR(skinny_env_status());
  NUCLEUS_RETURN_IF_ERROR(moe_decode_env_status());
  NUCLEUS_RETURN_IF_ERROR(moe_up_splits_env_status());
  NUCLEUS_RETURN_IF_ERROR(mla_decode_env_status());
  NUCLEUS_RETURN_IF_ERROR(decode_program_env_status());
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kFuseKvANorm));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMtpDeviceHidden));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMoeCombineNorm));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kPackedUpload));
  // Integer switches whose readers run at a kernel's first launch (CUDA):
  // refused here on every device, before the weights are read.
  NUCLEUS_RETURN_IF_ERROR(int_knob_env_status(Knob::kMoeChunkTokens, std::numeric_limits<int64_t>::min(),
                                              std::numeric_limits<int64_t>::max(), "an integer"));
  NUCLEUS_RETURN_IF_ERROR(int_knob_env_status(Knob::kFusedAllreduceMaxBytes, 0, std::numeric_limits<int64_t>::max(),
                                              "a non-negative integer"));
  NUCLEUS_RETURN_IF_ERROR(int_knob_env_status(Knob::kCudaPoisonAllocs, 0, 255,
                                              "0, 1 or a byte value 0..255 (e.g. 0x7e)", /*base=*/0));
  NUCLEUS_RETURN_IF_ERROR(profile_ops_env_status());
  return prezero_env_status();
}

StatusOr<std::unique_ptr<DeepseekModel>> DeepseekModel::create(const ModelConfig& config, ModelWeights weights,
                                                                const ModelOptions& options) {
  return create(config, std::move(weights), options, RankContext{});
}

StatusOr<BuiltGraph> DeepseekModel::build_graph(StepKind kind) {
  BuiltGraph b;
  StepGraph& g = b.graph;
  build(g, kind, &b.bf16_buffers);
  const bool decode = kind == StepKind::kDecode;
  // Decode GEMMs may run split-K (ops/splitk.h); prefill GEMMs never do.
  // Decode graphs are captured (unless every step runs eagerly): backends
  // that cannot be captured refuse their ops.
  if (decode)
    for (Node& n : g.nodes()) {
      if (auto* lin = dynamic_cast<LinearOp*>(n.op.get())) lin->set_splitk_allowed(true);
      n.op->set_captured(!options_.cuda_graph_sizes.empty());
    }
  NUCLEUS_RETURN_IF_ERROR(g.select_backends(options_.device).with_context(decode ? "decode graph" : "prefill graph"));
  const bool dump = env_flag(Knob::kDumpGraph) && rank_.shard.rank == 0;  // one rank's graphs
  if (!decode) {
    if (dump) std::fputs(g.dump("prefill").c_str(), stderr);
    return b;
  }
  if (dump) std::fputs(g.dump("decode (before passes)").c_str(), stderr);
  // Passes, decode graph only (never prefill): split-K outputs in f32, then prezero.
  NUCLEUS_ASSIGN_OR_RETURN(SplitKPassReport sk, apply_splitk_pass(g, options_.device));
  if (sk.redirected + sk.reselected > 0)
    NUCLEUS_LOG_INFO("split-K pass: {} decode GEMMs write f32, {} kept off split-K", sk.redirected, sk.reselected);
  // The prezero pass rewrites the layers' add + norm donors by name; decode
  // programs (NUCLEUS_DECODE_PROGRAMS) hold those ops inside them.
  bool programs = false;
  for (const Node& n : g.nodes())
    programs |= std::string(n.op->kind()) == "front_program" || std::string(n.op->kind()) == "moe_program";
  if (options_.enable_prezero && programs && rank_.shard.rank == 0)
    NUCLEUS_LOG_WARN("prezero pass skipped: the decode graph runs decode programs (NUCLEUS_DECODE_PROGRAMS=1)");
  if (options_.enable_prezero && !programs) {
    NUCLEUS_ASSIGN_OR_RETURN(PrezeroPassReport r, apply_prezero_pass(g));
    if (rank_.shard.rank == 0)  // every rank's graph is alike
      NUCLEUS_LOG_INFO("prezero pass: {} donors, {} consumers in the decode graph", r.donors, r.consumers);
  }
  if (dump) std::fputs(g.dump("decode (after passes)").c_str(), stderr);
  return b;
}

Status DeepseekModel::resolve_k_scales() {
  const bool fp8 = kv_cache_dtype_ == KvCacheDtype::kFp8E4M3;
  if (options_.kv_scale) {
    NUCLEUS_RETURN_IF_ERROR(check_k_scale(*options_.kv_scale, "--kv-scale"));
    if (kv_cache_dtype_ == KvCacheDtype::kFp8DsMla)
      return invalid_argument(
          "--kv-scale applies to the per-layer-scaled fp8 cache only; fp8_ds_mla keeps one scale per 128 latent "
          "values of each row and reads no k_scale: drop --kv-scale or use --kv-cache-dtype fp8");
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
  NUCLEUS_ASSIGN_OR_RETURN(width_builds_, width::plan_mla_front_builds(options_.cuda_graph_sizes, options_.width_builds,
                                                                        strict, rank_.shard.rank));
  width_barrier_ = Tensor::empty({2}, DType::kI32, Device::kCuda);
  zero_device(width_barrier_);
  return ok_status();
#else
  return unsupported("width builds need a CUDA build");
#endif
}

void DeepseekModel::build(StepGraph& g, StepKind kind, std::vector<int>* bf16_buffers) {
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
  // Rows the attention's scratch holds. A decode program's step runs the attention in one piece (its
  // splits left to the program): at least the widest program's rows.
  const int64_t W = kind == StepKind::kDecode && options_.device == Device::kCuda && env_flag(Knob::kDecodePrograms)
                        ? std::max<int64_t>(options_.scratch_rows, decode_program_max_rows())
                        : options_.scratch_rows;
  const int q_lat = g.scratch("mla_q_lat", W, nh * c.kv_lora_rank, DType::kF32);
  const int o_lat = g.scratch("mla_o_lat", W, nh * c.kv_lora_rank, DType::kF32);

  const bool mtp = weights_.mtp_front.has_value();
  if (mtp) {
    // An MTP module (design.md "Speculative decoding (MTP)"): the layer's
    // input eh_proj([enorm(embed) | hnorm(h)]) enters as the first delta over
    // a zeroed residual. Under tensor parallelism the embedding is
    // vocabulary-parallel as the model's (the whole lookup on every rank),
    // h is the same on every rank and eh_proj is replicated: the delta is
    // whole, and the first add + norm does not all-reduce it.
    const MtpFrontWeights& f = *weights_.mtp_front;
    const int embed = g.buffer("mtp_embed", H, DType::kF32);
    const int cat = g.buffer("mtp_cat", 2 * H, act);
    g.add("mtp.embed_tokens",
          std::make_unique<EmbeddingOp>(weights_.embed_tokens,
                                        VocabShard{rank_.shard.rank * (c.vocab_size / tp), rank_.comm}),
          {}, {embed});
    g.add("mtp.input", std::make_unique<MtpInputOp>(f.enorm, f.hnorm, eps, options_.mtp_zero_embed_at_position0),
          {embed}, {cat, residual});
    g.add("mtp.eh_proj", std::make_unique<LinearOp>(&f.eh_proj, false), {cat}, {delta});
  } else {
    g.add("embed_tokens",
          std::make_unique<EmbeddingOp>(weights_.embed_tokens,
                                        VocabShard{rank_.shard.rank * (c.vocab_size / tp), rank_.comm}),
          {}, {residual});
  }
  // The residual add + RMSNorm after a partial sum: with tensor parallelism
  // it all-reduces the delta first (fused on CUDA when it can).
  auto add_norm = [&](const Tensor& weight, bool has_delta, bool partial_delta = true) {
    auto op = std::make_unique<AddRmsNormOp>(weight, eps, has_delta);
    if (has_delta && partial_delta && rank_.comm)
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

  // Decode graphs fold the add + norm after a MoE layer into its MoE op
  // where that op is the delta's last writer (NUCLEUS_MOE_COMBINE_NORM; the
  // shared experts inside it or absent, one rank, and not under the CPU's
  // bf16 emulation, which rounds the delta between the two ops).
  const AutoSwitch combine_norm_switch = env_auto_switch(Knob::kMoeCombineNorm).value_or(AutoSwitch::kAuto);
  const bool combine_norm = kind == StepKind::kDecode && !rank_.comm && !options_.cpu_bf16_emulation &&
                            combine_norm_switch != AutoSwitch::kOff;
  MoeExpertsOp* norm_in_moe = nullptr;  // the MoE op that runs the next add + norm, if any
  // MoE blocks as decode programs (ops/moe_program_op.h): CUDA decode graphs, NUCLEUS_DECODE_PROGRAMS=1.
  const bool decode_programs =
      kind == StepKind::kDecode && options_.device == Device::kCuda && env_flag(Knob::kDecodePrograms);
  static std::atomic<bool> said_why_no_program{false}, said_why_no_front{false}, said_why_no_dense{false};
  // A MoE program not yet added to the graph: the next layer's front may
  // join it (NUCLEUS_DECODE_PROGRAM_JOIN: one launch a layer boundary).
  const bool join_programs = decode_programs && env_flag(Knob::kDecodeProgramJoin);
  // Front programs that also absorb the attention's query (NUCLEUS_DECODE_PROGRAM_ABSORB).
  const bool absorb_in_program = decode_programs && env_flag(Knob::kDecodeProgramAbsorb);
  // MoE programs that also merge the attention's splits and apply W_UV (NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT).
  const bool attn_output_in_program = decode_programs && env_flag(Knob::kDecodeProgramAttnOutput);
  // Steps of at most this many rows run as programs (NUCLEUS_DECODE_PROGRAM_MAX_ROWS).
  const int64_t program_rows = decode_program_max_rows();
  // Fronts that also run the attention (NUCLEUS_DECODE_PROGRAM_ATTENTION): their partials, one buffer.
  const bool attention_in_program = decode_programs && env_flag(Knob::kDecodeProgramAttention) && absorb_in_program &&
                                    attn_output_in_program;
  const auto attention_buffer = attention_in_program ? std::make_shared<ProgramAttentionBuffer>() : nullptr;
  int program_fronts = 0, program_blocks = 0, joined_fronts = 0, absorbing_fronts = 0, attention_outputs = 0,
      attending_fronts = 0, dense_blocks = 0;
  // Dense layers' MLPs as programs too (NUCLEUS_DECODE_PROGRAM_DENSE).
  const bool dense_in_program = decode_programs && env_flag(Knob::kDecodeProgramDense);
  static std::atomic<bool> said_programs{false};
  static std::atomic<bool> said_why_no_absorb{false}, said_why_no_attn_output{false}, said_why_no_attention{false};
  struct PendingMoe {
    std::string name;
    std::unique_ptr<MoeProgramOp> op;
    std::vector<int> in, out;
  };
  std::optional<PendingMoe> pending_moe;
  auto add_pending_moe = [&] {
    if (!pending_moe) return;
    g.add(pending_moe->name, std::move(pending_moe->op), pending_moe->in, pending_moe->out);
    pending_moe.reset();
  };
  int moe_layers = 0, folded_norms = 0;
  // The add + norm of the delta (as add_norm), or its fold into that op.
  auto add_delta_norm = [&](const std::string& name, const Tensor& weight, bool partial_delta) {
    if (norm_in_moe) {
      norm_in_moe->fuse_add_rmsnorm(weight, eps);
      norm_in_moe = nullptr;
      ++folded_norms;
      return;
    }
    g.add(name, add_norm(weight, true, partial_delta), {residual, delta}, {residual, x_norm});
  };

  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = weights_.layers[l];
    const AttentionWeights& aw = lw.attn;
    const std::string p = "layers." + std::to_string(l) + ".";
    // Attention block. Its front (the input add + norm, the q projections,
    // kv_a, RoPE and the cache write) as one decode program in CUDA decode
    // graphs with NUCLEUS_DECODE_PROGRAMS=1 (ops/front_program_op.h): a bf16
    // cache, the kv norm fused, one rank, the main model (not MTP), the input
    // norm not folded into the MoE op before.
    const bool fuse_kv_norm = env_auto_switch(Knob::kFuseKvANorm).value_or(AutoSwitch::kAuto) != AutoSwitch::kOff;
    bool front_in_program = false;
    int front_q_full = -1;                      // the absorbed query a front program writes, if it does
    MlaDecodeAttentionOp* program_attn = nullptr;  // the attention op after a front program
    FrontProgramOp* program_front = nullptr;       // the front program, while it may still run the attention
    if (decode_programs && !mtp && !norm_in_moe && !rank_.comm && !width_builds_ &&
        mode != AttentionMode::kExpanded && fuse_kv_norm && kv_cache_dtype_ == KvCacheDtype::kBF16) {
      FrontProgramOp::Parts parts;
      parts.norm = std::make_unique<AddRmsNormOp>(lw.input_layernorm, eps, /*has_delta=*/l > 0);
      if (aw.q_a_proj) {
        parts.q_a = std::make_unique<LinearOp>(&*aw.q_a_proj, false);
        parts.q_a_norm = std::make_unique<RmsNormOp>(aw.q_a_layernorm, eps);
        parts.q_b = std::make_unique<LinearOp>(&*aw.q_b_proj, false);
      } else {
        parts.q_proj = std::make_unique<LinearOp>(&*aw.q_proj, false);
      }
      parts.kv_a = std::make_unique<LinearOp>(&aw.kv_a_proj, false);
      parts.rope = std::make_unique<RopeKvCacheWriteOp>(
          l, &rope_, dims, rope_inv_freq_device_.defined() ? rope_inv_freq_device_.data<float>() : nullptr,
          static_cast<float>(rope_params(c).attention_factor), kv_cache_dtype_);
      parts.rope->fuse_kv_norm(aw.kv_a_layernorm, eps);
      auto front = std::make_unique<FrontProgramOp>(l, std::move(parts), H);
      front->set_max_rows(program_rows);
      Status why = front_program_supported(*front);
      // The attention's query absorption too (NUCLEUS_DECODE_PROGRAM_ABSORB), where the program can run it.
      if (why.ok() && absorb_in_program) {
        front->parts().kv_b = &aw.kv_b_proj;
        if (Status no = front_program_supported(*front); !no.ok()) {
          if (!said_why_no_absorb.exchange(true))
            NUCLEUS_LOG_WARN("NUCLEUS_DECODE_PROGRAM_ABSORB: the attention op absorbs the query: {}", no.message());
          front->parts().kv_b = nullptr;
        }
      }
      // The attention too, for layers whose program (MoE block or dense MLP) can merge it (checked there; taken back if not).
      const std::string forced_attention = forced_backend("mla_decode");
      if (why.ok() && attention_in_program && front->absorbs() && (lw.moe || (lw.mlp && dense_in_program)) &&
          (forced_attention.empty() || forced_attention == "nucleus")) {
        front->set_attend(true, dims.scale, attention_buffer);
        if (!front_program_supported(*front).ok()) front->set_attend(false);
      }
      if (why.ok()) {
        program_front = front.get();
        std::vector<int> outs = {residual, x_norm, q, kv_a};
        if (aw.q_a_proj) outs.push_back(g.buffer("q_a", c.q_lora_rank, act));
        if (front->absorbs()) {
          front_q_full = g.buffer("mla_q_full", nh * c.kv_cache_width(), act);
          outs.push_back(front_q_full);
        }
        if (pending_moe) {  // the previous layer's MoE program runs this front too
          pending_moe->op->set_next_front(std::move(front));
          if (Status join = moe_program_supported(*pending_moe->op); join.ok()) {
            for (size_t i = 2; i < outs.size(); ++i) pending_moe->out.push_back(outs[i]);
            pending_moe->name += "+next_front";
            ++joined_fronts;
          } else {
            front = pending_moe->op->take_next_front();
            NUCLEUS_LOG_WARN("NUCLEUS_DECODE_PROGRAM_JOIN: layer {}'s front runs as its own program: {}", l,
                             join.message());
          }
        }
        add_pending_moe();
        ++program_fronts;
        if (front_q_full >= 0) ++absorbing_fronts;
        if (front && l > 0)
          g.add(p + "self_attn.front_program", std::move(front), {residual, delta}, outs);
        else if (front)
          g.add(p + "self_attn.front_program", std::move(front), {residual}, outs);
        front_in_program = true;
      } else if (!said_why_no_front.exchange(true)) {
        NUCLEUS_LOG_WARN("NUCLEUS_DECODE_PROGRAMS=1: the attention fronts run the separate ops: {}", why.message());
      }
    }
    add_pending_moe();  // (when this layer's front did not join it)
    if (front_in_program) {
      auto attn = std::make_unique<MlaDecodeAttentionOp>(l, &aw.kv_b_proj, dims, mode, kv_cache_dtype_);
      std::vector<int> attn_in = {q};
      if (front_q_full >= 0) {  // the front program's absorbed query, for the steps a program runs
        attn->set_absorbed_input_rows(program_rows);
        attn_in.push_back(front_q_full);
      }
      if (program_front && program_front->attends()) attn->set_attention_in_program_rows(program_rows);
      program_attn = attn.get();
      g.add(p + "self_attn.attn_decode", std::move(attn), attn_in, {attn_out, q_lat, o_lat});
    } else if (l > 0 || mtp) {
      add_delta_norm(p + "input_layernorm", lw.input_layernorm, /*partial_delta=*/l > 0);
    } else {
      g.add(p + "input_layernorm", add_norm(lw.input_layernorm, false), {residual}, {residual, x_norm});
    }
    if (!front_in_program && kind == StepKind::kDecode && width_builds_) {
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
    } else if (!front_in_program) {
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
      auto rope_op = std::make_unique<RopeKvCacheWriteOp>(
          l, &rope_, dims, rope_inv_freq_device_.defined() ? rope_inv_freq_device_.data<float>() : nullptr,
          static_cast<float>(rope_params(c).attention_factor), kv_cache_dtype_);
      // kv_a_layernorm: inside the RoPE + cache-write op (NUCLEUS_FUSE_KV_A_NORM, default), or its own op.
      if (fuse_kv_norm)
        rope_op->fuse_kv_norm(aw.kv_a_layernorm, eps);
      else
        g.add(p + "self_attn.kv_a_layernorm", std::make_unique<RmsNormOp>(aw.kv_a_layernorm, eps), {kv_a}, {kv_a});
      g.add(p + "self_attn.rope_kv_cache_write", std::move(rope_op), {q, kv_a}, {q});
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
    // A front that would run the attention, where this layer's MoE program
    // cannot merge it: the attention op runs it after all.
    auto take_back_attention = [&] {
      if (!program_front || !program_front->attends()) return;
      program_front->set_attend(false);
      if (program_attn) program_attn->set_attention_in_program_rows(0);
    };
    // The output projection and a MoE block of a CUDA decode graph as one
    // decode program (NUCLEUS_DECODE_PROGRAMS=1, ops/moe_program_op.h):
    // o_proj, the post-attention add + norm, router, routing and experts
    // (shared ones fused) in one launch for steps of at most 8 rows; the op
    // holds the separate ops for wider steps.
    if (decode_programs && lw.moe && (lw.moe->shared || rank_.comm)) {
      if (!said_why_no_program.exchange(true))
        NUCLEUS_LOG_WARN("NUCLEUS_DECODE_PROGRAMS=1: the MoE blocks run the separate ops: {}",
                         rank_.comm ? "tensor parallelism all-reduces the delta before the norm"
                                    : "the shared experts run as one MLP, not as pieces the program can stream");
    } else if (decode_programs && (lw.moe || (lw.mlp && dense_in_program && !rank_.comm))) {
      // (Not a dense layer under tensor parallelism: its norm must all-reduce o_proj's partial delta first.)
      // (A dense layer's MLP the same way: o_proj, the add + norm and the MLP
      // as one program, MoeProgramOp::dense.)
      MoeProgramOp::Parts parts;
      parts.o_proj = std::make_unique<LinearOp>(&aw.o_proj, false);
      parts.norm = std::make_unique<AddRmsNormOp>(lw.post_attention_layernorm, eps, true);
      kernels::MoeRoutingParams routing = moe_routing_params(c);
      int64_t inter = 0;
      if (lw.moe) {
        const MoeWeights& m = *lw.moe;
        routing.shared_slots = static_cast<int64_t>(m.shared_experts.size());
        std::vector<ExpertWeights> experts;
        for (const auto& e : m.experts) experts.push_back({&e.gate_up, &e.down});
        for (const auto& e : m.shared_experts) experts.push_back({&e.gate_up, &e.down});
        inter = c.moe_intermediate_size / tp;
        parts.router = std::make_unique<LinearOp>(&m.router, false);
        parts.route = std::make_unique<MoeRouteOp>(routing, m.e_score_correction_bias);
        parts.experts = std::make_unique<MoeExpertsOp>(std::move(experts), inter, routing.slots());
      } else {
        inter = lw.mlp->inter;
        parts.gate_up = std::make_unique<LinearOp>(&lw.mlp->gate_up, false);
        parts.act = std::make_unique<SiluMulOp>();
        parts.down = std::make_unique<LinearOp>(&lw.mlp->down, false);
      }
      auto program = std::make_unique<MoeProgramOp>(l, std::move(parts), H, lw.moe ? routing.shared_slots : 0);
      program->set_max_rows(program_rows);
      Status why = moe_program_supported(*program);
      // The attention's split merge and W_UV too, where the program can run them.
      bool attn_output = false;
      // The attention itself ran in this layer's front program: merge its partials.
      if (why.ok() && program_front && program_front->attends() && program_attn) {
        program->set_attention(program_attn);
        program->set_attention_buffer(attention_buffer);
        if (Status no = moe_program_supported(*program); no.ok()) {
          attn_output = true;
          ++attention_outputs;
          ++attending_fronts;
        } else {
          program->set_attention(nullptr);
          program->set_attention_buffer(nullptr);
          if (!said_why_no_attention.exchange(true))
            NUCLEUS_LOG_WARN("NUCLEUS_DECODE_PROGRAM_ATTENTION: the attention op runs the attention: {}", no.message());
        }
      }
      if (!attn_output) take_back_attention();
      // (Not where NUCLEUS_FORCE_KERNEL names another attention backend: only nucleus leaves its splits.)
      const std::string forced_attention = forced_backend("mla_decode");
      if (!attn_output && why.ok() && attn_output_in_program && program_attn &&
          (forced_attention.empty() || forced_attention == "nucleus")) {
        program_attn->set_output_in_program_rows(program_rows);
        program->set_attention(program_attn);
        if (Status no = moe_program_supported(*program); no.ok()) {
          attn_output = true;
          ++attention_outputs;
        } else {
          program_attn->set_output_in_program_rows(0);
          program->set_attention(nullptr);
          if (!said_why_no_attn_output.exchange(true))
            NUCLEUS_LOG_WARN("NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT: the attention op writes its own output: {}",
                             no.message());
        }
      }
      if (why.ok()) {
        std::vector<int> moe_in = {attn_out, residual};
        if (attn_output && !program->attention_buffer()) moe_in.push_back(o_lat);  // the attention's o_lat (one split)
        std::vector<int> moe_out = {residual, delta, x_norm};
        if (lw.moe) {
          const int logits = g.buffer("router_logits", c.n_routed_experts, DType::kF32);
          const int ids = g.buffer("topk_ids", routing.slots(), DType::kI32);
          const int weights = g.buffer("topk_weights", routing.slots(), DType::kF32);
          const int moe_scratch = g.scratch("moe_scratch", W, routing.slots() * inter, DType::kF32);
          moe_out.insert(moe_out.end(), {logits, ids, weights, moe_scratch});
        } else {  // the MLP's held ops' buffers (add_mlp's)
          moe_out.push_back(g.buffer("gate_up." + std::to_string(inter), 2 * inter, act));
          moe_out.push_back(g.buffer("mlp_act." + std::to_string(inter), inter, act));
        }
        PendingMoe pm{p + "mlp.program", std::move(program), moe_in, moe_out};
        if (join_programs && l + 1 < c.num_hidden_layers) {
          pending_moe = std::move(pm);  // the next layer's front may join it
        } else {
          g.add(pm.name, std::move(pm.op), pm.in, pm.out);
        }
        if (lw.moe) {
          ++moe_layers;
          ++program_blocks;
        } else {
          ++dense_blocks;
        }
        continue;
      } else if (lw.moe ? !said_why_no_program.exchange(true) : !said_why_no_dense.exchange(true)) {
        NUCLEUS_LOG_WARN("NUCLEUS_DECODE_PROGRAMS=1: the {} run the separate ops: {}",
                         lw.moe ? "MoE blocks" : "dense layers' MLPs", why.message());
      }
    }
    take_back_attention();  // (no MoE program took it: a dense layer, or a block the program cannot run)
    g.add(p + "self_attn.o_proj", std::make_unique<LinearOp>(&aw.o_proj, false), {attn_out}, {delta});
    // FFN block.
    g.add(p + "post_attention_layernorm", add_norm(lw.post_attention_layernorm, true), {residual, delta},
          {residual, x_norm});
    if (lw.moe) {
      const MoeWeights& m = *lw.moe;
      const int64_t E = c.n_routed_experts;
      // Decode steps run the shared experts' pieces as routed experts E, E + 1, ...
      // with weight 1 (NUCLEUS_MOE_FUSE_SHARED, auto on CUDA; MoeWeights::shared_experts):
      // one op instead of their own GEMMs, SiLU·mul and accumulate.
      const bool fuse_shared = kind == StepKind::kDecode && !m.shared_experts.empty();
      kernels::MoeRoutingParams routing = moe_routing_params(c);
      routing.shared_slots = fuse_shared ? static_cast<int64_t>(m.shared_experts.size()) : 0;
      const int64_t slots = routing.slots();
      const int logits = g.buffer("router_logits", E, DType::kF32);
      const int ids = g.buffer("topk_ids", slots, DType::kI32);
      const int weights = g.buffer("topk_weights", slots, DType::kF32);
      g.add(p + "mlp.gate", std::make_unique<LinearOp>(&m.router, false), {x_norm}, {logits});
      g.add(p + "mlp.route", std::make_unique<MoeRouteOp>(routing, m.e_score_correction_bias), {logits},
            {ids, weights});
      std::vector<ExpertWeights> experts;
      for (const auto& e : m.experts) experts.push_back({&e.gate_up, &e.down});
      if (fuse_shared)
        for (const auto& e : m.shared_experts) experts.push_back({&e.gate_up, &e.down});
      const int64_t inter = c.moe_intermediate_size / tp;  // each expert's slice on this rank
      const int moe_scratch = g.scratch("moe_scratch", W, slots * inter, DType::kF32);
      auto experts_op = std::make_unique<MoeExpertsOp>(std::move(experts), inter, slots);
      ++moe_layers;
      // The last writer of the delta: the next add + norm can run inside it.
      const bool last_writer = !m.shared && (fuse_shared || m.shared_experts.empty());
      if (combine_norm && last_writer) {
        norm_in_moe = experts_op.get();
        g.add(p + "mlp.experts", std::move(experts_op), {x_norm, ids, weights, residual},
              {delta, moe_scratch, residual, x_norm});
      } else {
        g.add(p + "mlp.experts", std::move(experts_op), {x_norm, ids, weights}, {delta, moe_scratch});
      }
      if (m.shared) add_mlp(p + "mlp.shared_experts", *m.shared, x_norm, delta, /*accumulate=*/true);
      if (!fuse_shared)
        for (size_t i = 0; i < m.shared_experts.size(); ++i)
          add_mlp(p + "mlp.shared_experts" + (m.shared_experts.size() > 1 ? "." + std::to_string(i) : ""),
                  m.shared_experts[i], x_norm, delta, /*accumulate=*/true);
    } else {
      add_mlp(p + "mlp", *lw.mlp, x_norm, delta, /*accumulate=*/false);
    }
  }
  add_pending_moe();
  // Which steps and which parts of the layers run as programs, once.
  if ((program_fronts > 0 || program_blocks > 0 || dense_blocks > 0) && rank_.shard.rank == 0 &&
      !said_programs.exchange(true))
    NUCLEUS_LOG_INFO("decode programs: {}; {} attention fronts ({} absorbing the query, {} running the attention), "
                     "{} MoE blocks and {} dense MLPs ({} with the attention's output, {} joined with the next "
                     "layer's front) of {} layers",
                     decode_program_widths_text(program_rows), program_fronts, absorbing_fronts, attending_fronts,
                     program_blocks, dense_blocks, attention_outputs, joined_fronts, c.num_hidden_layers);
  add_delta_norm("norm", weights_.norm, /*partial_delta=*/true);
  // Asked for by name (=1) but nowhere possible: say why, once.
  static std::atomic<bool> said_why_not_folded{false};
  if (kind == StepKind::kDecode && combine_norm_switch == AutoSwitch::kOn && moe_layers > 0 && folded_norms == 0 &&
      !said_why_not_folded.exchange(true))
    NUCLEUS_LOG_INFO("NUCLEUS_MOE_COMBINE_NORM=1: no MoE op runs the add + norm after it: {}",
                     rank_.comm                    ? "with tensor parallelism the norm all-reduces the delta first"
                     : options_.cpu_bf16_emulation ? "the CPU's bf16 emulation rounds the delta between the ops"
                                                   : "the shared experts run as their own MLP after the MoE op "
                                                     "(NUCLEUS_MOE_FUSE_SHARED)");
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
  auto& rounded = *bf16_buffers;
  static const char* kF32Buffers[] = {"residual", "mtp_embed", "router_logits", "topk_ids",     "topk_weights",
                                      "logits",   "mla_q_lat",     "mla_o_lat",    "moe_scratch",
                                      "logits_local", "logits_gathered"};
  for (size_t id = buffers_before; id < g.buffers().size(); ++id) {
    bool keep = false;
    for (const char* n : kF32Buffers) keep |= g.buffers()[id].name == n;
    if (!keep) rounded.push_back(static_cast<int>(id));
  }
}

KvCache DeepseekModel::make_kv_cache(int64_t num_blocks, int64_t block_size) const {
  KvCache kv;
  kv.num_layers = config_.num_hidden_layers;
  kv.num_blocks = num_blocks;
  kv.block_size = block_size;
  kv.width = config_.kv_cache_width();
  const DType dt = kv_cache_storage_dtype(kv_cache_dtype_);
  // Elements a row: width, or 656 bytes for fp8_ds_mla.
  const int64_t row = kv_cache_row_bytes(kv_cache_dtype_, kv.width) / static_cast<int64_t>(dtype_size(dt));
  if (options_.device == Device::kCuda) {
    kv.data = Tensor::empty({kv.num_layers, num_blocks, block_size, row}, dt, Device::kCuda);
    zero_device(kv.data);
  } else {
    kv.data = Tensor::zeros({kv.num_layers, num_blocks, block_size, row}, dt);
  }
  if (kv_cache_dtype_ == KvCacheDtype::kFp8E4M3) kv.k_scale = kv_k_scales_;
  return kv;
}

int64_t DeepseekModel::kv_bytes_per_token() const {
  return config_.num_hidden_layers * kv_cache_row_bytes(kv_cache_dtype_, config_.kv_cache_width());
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
      for (const MlpWeights& piece : l.moe->shared_experts) b.dense += mlp(piece);
      if (!l.moe->experts.empty()) b.per_expert = mlp(l.moe->experts[0]);
    }
  }
  return b;
}

}  // namespace nucleus
