#include "runtime/model_executor.h"

#include <filesystem>

#include "core/check.h"
#include "core/device.h"
#include "core/knobs.h"
#include "core/logging.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/tp_shard.h"
#include "model/weights.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "kernels/gather/gather_rows.cuh"
#include "ops/collective_ops_cuda.h"
#endif

namespace nucleus {

namespace {

// The MTP module as a model of its own: one decoder layer (its own
// one-layer cache). On CUDA its decode steps replay decode graphs (of the
// target's sizes; StepExecutor copies the step's hidden states into the
// graphs' own buffer); prefill steps run eagerly (no token graphs: their
// graphed segments would read a captured mtp_hidden); no width builds.
// Under tensor parallelism rank `rank`'s shard of it, built like the rank's
// model (its communicator and signal buffers).
StatusOr<std::unique_ptr<DeepseekModel>> make_mtp_model(const ModelConfig& config, const ModelOptions& options,
                                                        ModelWeights weights,
                                                        DeepseekModel::RankContext rank = {}) {
  ModelConfig mc = config;
  mc.num_hidden_layers = 1;
  mc.first_k_dense_replace = 0;
  mc.num_nextn_predict_layers = 0;
  ModelOptions mo = options;
  mo.token_graph_sizes.clear();
  mo.width_builds = width::WidthBuildsMode::kOff;
  mo.enable_prezero = false;
  mo.load_mtp = false;
  mo.tensor_parallel_size = 1;  // a rank is one model
  return DeepseekModel::create(mc, std::move(weights), mo, std::move(rank));
}

#ifdef NUCLEUS_HAVE_CUDA
// NUCLEUS_MTP_DEVICE_HIDDEN: the MTP module's input rows gathered on the
// device (auto, 1) or through the host (0). DeepseekModel::env_status
// refuses a malformed value before any weight is read.
bool mtp_device_hidden() {
  return env_auto_switch(Knob::kMtpDeviceHidden).value_or(AutoSwitch::kAuto) != AutoSwitch::kOff;
}

// Rows gather_hidden_rows keeps a buffer for (a decode step's MTP pass at
// k + 1 rows a sequence fits); a wider gather (a prefill chunk's rows) takes
// a buffer of its own, freed with the step's inputs.
constexpr int64_t kGatherBufferRows = 512;
#endif

ExecutorOptions executor_options(const ModelOptions& o, int rank) {
  ExecutorOptions e;
  e.device = o.device;
  e.cuda_graph_sizes = o.cuda_graph_sizes;
  e.token_graph_sizes = o.token_graph_sizes;
  e.graph_eager_pad = o.graph_eager_pad;
  e.token_graph_eager_pad = o.token_graph_eager_pad;
  e.multi_token_decode = o.multi_token_decode;
  e.cpu_bf16_emulation = o.cpu_bf16_emulation;
  e.max_blocks_per_seq = o.max_blocks_per_seq;
  e.rank = rank;
  return e;
}

}  // namespace

ModelExecutor::~ModelExecutor() {
  // A group's ranks free their device state on their own threads.
  if (group_) {
    Status s = group_->run([this](int r) {
      if (!mtp_.empty()) {
        mtp_[r].executor.reset();
        mtp_[r].model.reset();
      }
      ranks_[r].executor.reset();
      ranks_[r].model.reset();
      return ok_status();
    });
    NUCLEUS_CHECK(s.ok(), "tensor-parallel ranks: {}", s.to_string());
  }
}

StatusOr<ModelExecutor::Rank> ModelExecutor::make_rank(std::unique_ptr<DeepseekModel> model, bool mtp) {
  NUCLEUS_ASSIGN_OR_RETURN(BuiltGraph prefill, model->build_graph(StepKind::kPrefill));
  NUCLEUS_ASSIGN_OR_RETURN(BuiltGraph decode, model->build_graph(StepKind::kDecode));
  Rank r;
  ExecutorOptions eo = executor_options(model->options(), model->rank().shard.rank);
  if (mtp) eo.mtp_hidden_width = model->config().hidden_size;
  NUCLEUS_ASSIGN_OR_RETURN(r.executor, StepExecutor::create(std::move(prefill), std::move(decode), eo));
  r.model = std::move(model);
  return r;
}

StatusOr<std::unique_ptr<ModelExecutor>> ModelExecutor::create(std::unique_ptr<DeepseekModel> model,
                                                                std::unique_ptr<DeepseekModel> mtp) {
  std::unique_ptr<ModelExecutor> e(new ModelExecutor(model->options()));
  NUCLEUS_ASSIGN_OR_RETURN(Rank r, make_rank(std::move(model)));
  e->ranks_.push_back(std::move(r));
  if (mtp) {
    NUCLEUS_ASSIGN_OR_RETURN(Rank m, make_rank(std::move(mtp), /*mtp=*/true));
    e->mtp_.push_back(std::move(m));
  }
  return e;
}

StatusOr<Tensor> ModelExecutor::hidden_states() { return ranks_[0].executor->last_step_buffer("x_norm"); }

StatusOr<Tensor> ModelExecutor::mtp_forward(const StepInputs& inputs, KvCache& mtp_cache) {
  NUCLEUS_ASSIGN_OR_RETURN(Tensor logits, mtp_forward_logits(inputs, mtp_cache));
  return logits.device() == Device::kCuda ? to_host(logits) : logits;
}

StatusOr<Tensor> ModelExecutor::mtp_forward_logits(const StepInputs& inputs, KvCache& mtp_cache) {
  if (!has_mtp()) return failed_precondition("the model was loaded without its MTP module");
  for (int32_t p : inputs.positions)
    NUCLEUS_CHECK(p >= 0 && p < config().max_position_embeddings, "MTP position {} outside [0, {})", p,
                  config().max_position_embeddings);
  if (!group_) {
    return mtp_[0].executor->forward_logits(inputs, mtp_cache);
  }
  NUCLEUS_CHECK(mtp_cache.ranks.size() == mtp_.size(), "an MTP cache of {} ranks for a model of {}",
                mtp_cache.ranks.size(), mtp_.size());
  if (!broken_.ok()) return broken_;
  // Every rank reads the same rows: a host tensor, which each rank's
  // executor moves to its own device (StepExecutor::forward_logits; a device
  // tensor, GPU 0's, goes through the host).
  StepInputs in = inputs;
  if (in.mtp_hidden.defined() && in.mtp_hidden.device() == Device::kCuda) in.mtp_hidden = to_host(in.mtp_hidden);
  std::vector<Tensor> logits(mtp_.size());
  Status s = on_ranks([&](Rank&, int r) -> Status {
    NUCLEUS_ASSIGN_OR_RETURN(logits[r], mtp_[r].executor->forward_logits(in, mtp_cache.ranks[r]));
    return ok_status();
  });
  if (!s.ok()) {
    broken_ = aborted("the tensor-parallel group's communicators were aborted by a failed MTP step (" + s.message() +
                      ")");
    return s;
  }
  return logits[0];
}

StatusOr<Tensor> ModelExecutor::mtp_hidden_states() {
  if (!has_mtp()) return failed_precondition("the model was loaded without its MTP module");
  return mtp_[0].executor->last_step_buffer("residual");
}

#ifdef NUCLEUS_HAVE_CUDA
namespace {
// out[i] = f32(source[rows[i]]) on the engine stream: the indices uploaded
// into `index` (a pageable copy, staged before the call returns and ordered
// after every earlier reader of `index`), then one gather kernel.
Status gather_rows_f32_on_device(const Tensor& source, const std::vector<int32_t>& rows, const Tensor& index,
                                 const Tensor& out) {
  cudaStream_t stream = cuda::context().stream;
  cudaError_t e = cudaMemcpyAsync(index.raw(), rows.data(), rows.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                  stream);
  if (e == cudaSuccess)
    e = kernels::launch_gather_rows_f32(source.raw(), source.dtype() == DType::kBF16, index.data<int32_t>(),
                                        static_cast<int64_t>(rows.size()), source.dim(1),
                                        static_cast<float*>(out.raw()), stream);
  if (e != cudaSuccess) return internal_error(std::string("gather_hidden_rows: ") + cudaGetErrorString(e));
  return ok_status();
}
}  // namespace
#endif

StatusOr<Tensor> ModelExecutor::gather_hidden_rows(const Tensor& source, const std::vector<int32_t>& rows) {
  if (source.rank() != 2 || (source.dtype() != DType::kBF16 && source.dtype() != DType::kF32))
    return invalid_argument("gather_hidden_rows: the source is " + std::string(dtype_name(source.dtype())) + " " +
                            source.shape_string() + ", not [rows, hidden] bf16 or f32");
  const int64_t R = source.dim(0), H = source.dim(1), n = static_cast<int64_t>(rows.size());
  for (int32_t r : rows)
    if (r < 0 || r >= R)
      return invalid_argument("gather_hidden_rows: row " + std::to_string(r) + " outside the source's " +
                              std::to_string(R) + " rows");
#ifdef NUCLEUS_HAVE_CUDA
  if (source.device() == Device::kCuda && !group_ && mtp_device_hidden()) {
    if (n == 0) return Tensor::empty({0, H}, DType::kF32, Device::kCuda);
    if (!gather_index_.defined()) {  // once: the index and row buffers
      gather_index_ = Tensor::empty({kGatherBufferRows}, DType::kI32, Device::kCuda);
      gather_rows_ = Tensor::empty({kGatherBufferRows, H}, DType::kF32, Device::kCuda);
    }
    if (n > kGatherBufferRows || gather_rows_.dim(1) != H) {
      // Rare (a long prefill chunk): buffers of this call's own; their
      // release waits for the device (cudaFree).
      Tensor index = Tensor::empty({n}, DType::kI32, Device::kCuda);
      Tensor out = Tensor::empty({n, H}, DType::kF32, Device::kCuda);
      NUCLEUS_RETURN_IF_ERROR(gather_rows_f32_on_device(source, rows, index, out));
      return out;
    }
    NUCLEUS_RETURN_IF_ERROR(gather_rows_f32_on_device(source, rows, gather_index_, gather_rows_));
    return gather_rows_.rows(0, n);
  }
#endif
  Tensor host = source.device() == Device::kCuda ? to_host(source) : source;
  Tensor out = Tensor::empty({n, H}, DType::kF32);
  for (int64_t i = 0; i < n; ++i)
    convert_to_f32(static_cast<const char*>(host.raw()) + rows[static_cast<size_t>(i)] * H * dtype_size(host.dtype()),
                   host.dtype(), out.data<float>() + i * H, static_cast<size_t>(H));
  return out;
}

KvCache ModelExecutor::make_mtp_kv_cache(int64_t num_blocks, int64_t block_size) {
  NUCLEUS_CHECK(has_mtp(), "make_mtp_kv_cache without an MTP module");
  if (!group_) return mtp_[0].model->make_kv_cache(num_blocks, block_size);
  std::vector<KvCache> caches(mtp_.size());
  Status s = on_ranks([&](Rank&, int r) {
    caches[r] = mtp_[r].model->make_kv_cache(num_blocks, block_size);
    return ok_status();
  });
  NUCLEUS_CHECK(s.ok(), "tensor-parallel ranks: {}", s.to_string());
  KvCache kv = caches[0];
  kv.ranks = std::move(caches);
  return kv;
}

std::unique_ptr<ModelExecutor> ModelExecutor::create_group(const ModelOptions& options, std::unique_ptr<TpGroup> group,
                                                           std::vector<Rank> ranks, std::vector<Rank> mtp) {
  NUCLEUS_CHECK(group && static_cast<int>(ranks.size()) == group->world_size(), "group of {} ranks, {} models",
                group ? group->world_size() : 0, ranks.size());
  NUCLEUS_CHECK(mtp.empty() || mtp.size() == ranks.size(), "group of {} ranks, {} MTP modules", ranks.size(),
                mtp.size());
  // Every rank resolves the same cache dtype and k_scale (k_scale tensors are replicated).
  for (const Rank& r : ranks)
    NUCLEUS_CHECK(r.model->kv_cache_dtype() == ranks[0].model->kv_cache_dtype() &&
                      r.model->kv_k_scales() == ranks[0].model->kv_k_scales(),
                  "tensor-parallel ranks disagree on the KV cache dtype or k_scale");
  std::unique_ptr<ModelExecutor> e(new ModelExecutor(options));
  e->group_ = std::move(group);
  e->ranks_ = std::move(ranks);
  e->mtp_ = std::move(mtp);
  return e;
}

Status ModelExecutor::on_ranks(const std::function<Status(Rank&, int)>& fn) {
  if (!group_) return fn(ranks_[0], 0);
  return group_->run([&](int r) { return fn(ranks_[r], r); });
}

StatusOr<Tensor> ModelExecutor::forward(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats) {
  NUCLEUS_ASSIGN_OR_RETURN(Tensor logits, forward_logits(inputs, kv_cache, stats));
  return logits.device() == Device::kCuda ? to_host(logits) : logits;
}

StatusOr<Tensor> ModelExecutor::forward_logits(const StepInputs& inputs, KvCache& kv_cache, StepStats* stats) {
  for (int32_t p : inputs.positions)
    NUCLEUS_CHECK(p >= 0 && p < config().max_position_embeddings, "position {} outside [0, {})", p,
                  config().max_position_embeddings);
  if (!group_) return ranks_[0].executor->forward_logits(inputs, kv_cache, stats);
  NUCLEUS_CHECK(kv_cache.ranks.size() == ranks_.size(), "a KV cache of {} ranks for a model of {}",
                kv_cache.ranks.size(), ranks_.size());
  if (!broken_.ok()) return broken_;
  std::vector<Tensor> logits(ranks_.size());
  std::vector<StepStats> rank_stats(ranks_.size());
  Status s = on_ranks([&](Rank& rank, int r) -> Status {
    NUCLEUS_ASSIGN_OR_RETURN(logits[r], rank.executor->forward_logits(inputs, kv_cache.ranks[r],
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

Status ModelExecutor::health() {
  if (!group_) return ranks_[0].executor->health();
  if (!broken_.ok()) return broken_;
  for (const Rank& r : ranks_)
    if (r.executor->fatal_fault_fired()) return aborted("a fatal fault was injected (NUCLEUS_FAULT_INJECT)");
  return ok_status();
}

KvCache ModelExecutor::make_kv_cache(int64_t num_blocks, int64_t block_size) {
  if (!group_) return ranks_[0].model->make_kv_cache(num_blocks, block_size);
  std::vector<KvCache> caches(ranks_.size());
  Status s = on_ranks([&](Rank& rank, int r) {
    caches[r] = rank.model->make_kv_cache(num_blocks, block_size);
    return ok_status();
  });
  NUCLEUS_CHECK(s.ok(), "tensor-parallel ranks: {}", s.to_string());
  KvCache kv = caches[0];
  kv.ranks = std::move(caches);
  return kv;
}

void ModelExecutor::reserve_step_buffers(int64_t max_tokens, int64_t max_logits, int64_t max_prefill_logits) {
  Status s = on_ranks([&](Rank& rank, int r) {
    rank.executor->reserve(max_tokens, max_logits, max_prefill_logits);
    // The MTP module's steps: a target step's rows, and every row may give logits.
    if (has_mtp()) mtp_[r].executor->reserve(max_tokens, std::max(max_logits, max_prefill_logits), max_tokens);
    return ok_status();
  });
  NUCLEUS_CHECK(s.ok(), "tensor-parallel ranks: {}", s.to_string());
}

StatusOr<size_t> ModelExecutor::capture_decode_graphs(KvCache& kv_cache) {
  if (!group_) return ranks_[0].executor->capture(kv_cache);
  NUCLEUS_CHECK(kv_cache.ranks.size() == ranks_.size(), "a KV cache of {} ranks for a model of {}",
                kv_cache.ranks.size(), ranks_.size());
  std::vector<size_t> bytes(ranks_.size());
  NUCLEUS_RETURN_IF_ERROR(on_ranks([&](Rank& rank, int r) -> Status {
    NUCLEUS_ASSIGN_OR_RETURN(bytes[r], rank.executor->capture(kv_cache.ranks[r]));
    return ok_status();
  }));
  return bytes[0];
}

Status ModelExecutor::capture_mtp_graphs(KvCache& mtp_cache) {
  if (!has_mtp()) return failed_precondition("the model was loaded without its MTP module");
  if (!group_) return mtp_[0].executor->capture(mtp_cache).status();
  NUCLEUS_CHECK(mtp_cache.ranks.size() == mtp_.size(), "an MTP cache of {} ranks for a model of {}",
                mtp_cache.ranks.size(), mtp_.size());
  // Every rank at once: the warm-up steps run collectives.
  return group_->run([&](int r) { return mtp_[r].executor->capture(mtp_cache.ranks[r]).status(); });
}

void ModelExecutor::drop_graphs() {
  Status s = on_ranks([](Rank& rank, int) {
    rank.executor->drop_graphs();
    return ok_status();
  });
  NUCLEUS_CHECK(s.ok(), "tensor-parallel ranks: {}", s.to_string());
}

void ModelExecutor::set_max_blocks_per_seq(int64_t n) {
  options_.max_blocks_per_seq = n;
  for (Rank& r : ranks_) r.executor->set_max_blocks_per_seq(n);
  for (Rank& r : mtp_) r.executor->set_max_blocks_per_seq(n);
}

StatusOr<std::unique_ptr<ModelExecutor>> load_deepseek_model(const std::string& model_dir,
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
    lo.load_mtp = options.load_mtp;
    return load_weights(ckpt, config, backend, lo, shard);
  });
}

StatusOr<std::unique_ptr<ModelExecutor>> build_deepseek_model(const ModelConfig& config, const ModelOptions& options,
                                                              const WeightFactory& make_weights) {
  NUCLEUS_RETURN_IF_ERROR(DeepseekModel::env_status());  // before any weight is read
  const int n = static_cast<int>(options.tensor_parallel_size);
  if (n == 1 && !options.force_tp_group) {
    auto backend = make_weight_backend(options.device);
    if (!backend) return unsupported("no weight backend for device " + std::string(device_name(options.device)));
    NUCLEUS_ASSIGN_OR_RETURN(ModelWeights weights, make_weights(*backend, TpShard{}));
    std::unique_ptr<DeepseekModel> mtp;
    if (options.load_mtp) {
      if (!weights.mtp)
        return failed_precondition("speculative decoding needs the checkpoint's MTP module, which the weights lack");
      NUCLEUS_ASSIGN_OR_RETURN(mtp, make_mtp_model(config, options, std::move(*weights.mtp)));
      weights.mtp.reset();
    }
    NUCLEUS_ASSIGN_OR_RETURN(std::unique_ptr<DeepseekModel> model,
                             DeepseekModel::create(config, std::move(weights), options));
    return ModelExecutor::create(std::move(model), std::move(mtp));
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
  std::vector<ModelExecutor::Rank> ranks(n), mtp(options.load_mtp ? n : 0);
  NUCLEUS_RETURN_IF_ERROR(group->run([&](int r) -> Status {
    auto backend = make_weight_backend(options.device);
    if (!backend) return unsupported("no weight backend for device " + std::string(device_name(options.device)));
    const TpShard shard{r, n};
    NUCLEUS_ASSIGN_OR_RETURN(ModelWeights weights, make_weights(*backend, shard));
    ModelOptions rank_options = options;
    rank_options.tensor_parallel_size = 1;  // a rank is one model; the group is the executor's
    if (options.load_mtp) {  // the rank's shard of the MTP module, in the same group
      if (!weights.mtp)
        return failed_precondition("speculative decoding needs the checkpoint's MTP module, which the weights lack");
      NUCLEUS_ASSIGN_OR_RETURN(std::unique_ptr<DeepseekModel> m,
                               make_mtp_model(config, rank_options, std::move(*weights.mtp),
                                              {shard, &group->comm(r), signals}));
      weights.mtp.reset();
      NUCLEUS_ASSIGN_OR_RETURN(mtp[r], ModelExecutor::make_rank(std::move(m), /*mtp=*/true));
    }
    NUCLEUS_ASSIGN_OR_RETURN(std::unique_ptr<DeepseekModel> model,
                             DeepseekModel::create(config, std::move(weights), rank_options,
                                                   {shard, &group->comm(r), signals}));
    NUCLEUS_ASSIGN_OR_RETURN(ranks[r], ModelExecutor::make_rank(std::move(model)));
    return ok_status();
  }));
  NUCLEUS_LOG_INFO("tensor parallelism: {} ranks on {} ({} communicators{})", n, device_name(options.device),
                   group->comm(0).backend(),
                   options.device == Device::kCuda
                       ? (signals.empty() ? ", all-reduce + RMSNorm unfused" : ", all-reduce + RMSNorm fused")
                       : "");
  return ModelExecutor::create_group(options, std::move(group), std::move(ranks), std::move(mtp));
}

}  // namespace nucleus
