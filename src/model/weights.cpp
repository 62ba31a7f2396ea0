#include "model/weights.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <regex>
#include <cstring>
#include <set>
#include <utility>

#include "core/check.h"
#include "core/knobs.h"
#include "core/logging.h"
#include "core/parallel.h"
#include "model/weight_check.h"
#include "ops/kv_cache_dtype.h"

namespace nucleus {

namespace {

std::string layer_prefix(int64_t l) { return "model.layers." + std::to_string(l) + "."; }

// The part of a 2-D tensor a rank loads (tensor parallelism): rows or
// columns [begin, end), or all of it.
struct SliceSpec {
  ShardSplit split = ShardSplit::kReplicated;
  int64_t begin = 0, end = 0;
};

// Where tensors come from: a checkpoint, or a dummy generator.
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // The tensor `name`, which must have exactly `shape`, or an error naming
  // it; only its `slice` (a host copy) when the slice is not kReplicated.
  virtual StatusOr<Tensor> get(const std::string& name, const std::vector<int64_t>& shape, bool linear,
                               const SliceSpec& slice = {}) = 0;
  // The whole FP8 scale for `weight_name` ([weight_shape]) if the weight is
  // FP8 (undefined otherwise).
  virtual StatusOr<Tensor> scale_for(const std::string& weight_name, DType weight_dtype,
                                     const std::vector<int64_t>& weight_shape,
                                     const std::vector<int64_t>& scale_shape) = 0;
  // The scalar tensor `name` as f32 when present (a float dtype, one
  // element), nullopt when absent.
  virtual StatusOr<std::optional<float>> optional_scalar(const std::string& name) { return std::optional<float>(); }
  virtual int64_t progress_total() const { return 0; }
  virtual int64_t progress_done() const { return 0; }
};

bool is_float_dtype(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

class CheckpointSource : public TensorSource {
 public:
  CheckpointSource(const Checkpoint& ckpt, const ModelConfig& config, bool check_values)
      : ckpt_(ckpt), config_(config), check_values_(check_values) {}

  StatusOr<Tensor> get(const std::string& name, const std::vector<int64_t>& shape, bool linear,
                       const SliceSpec& slice) override {
    NUCLEUS_ASSIGN_OR_RETURN(TensorEntry e, ckpt_.get(name));
    used_.insert(name);
    if (e.shape != shape)
      return invalid_argument(e.file + ": tensor '" + name + "' has shape " + shape_to_string(e.shape) +
                              " but config.json implies " + shape_to_string(shape));
    bool ok_dtype = is_float_dtype(e.dtype) || (linear && e.dtype == DType::kF8E4M3);
    if (!ok_dtype)
      return unsupported(e.file + ": tensor '" + name + "' has dtype " + dtype_name(e.dtype) +
                         (linear ? " (expected F32, BF16, F16 or F8_E4M3)" : " (expected F32, BF16 or F16)"));
    if (e.dtype == DType::kF8E4M3 && !config_.fp8)
      return unsupported(e.file + ": tensor '" + name +
                         "' is F8_E4M3 but config.json has no fp8 quantization_config");
    // F16 bytes in a bf16 checkpoint (or the reverse) are converted by their
    // header dtype, but mean the checkpoint is not what config.json says.
    if (is_float_dtype(e.dtype) && config_.torch_dtype && e.dtype != *config_.torch_dtype && e.dtype != DType::kF32)
      return invalid_argument(e.file + ": tensor '" + name + "' has dtype " + dtype_name(e.dtype) +
                              " but config.json torch_dtype says " + dtype_name(*config_.torch_dtype) +
                              " (F32 is also accepted)");
    Tensor t = slice_host(ckpt_.view(e), slice.split, slice.begin, slice.end);
    NUCLEUS_RETURN_IF_ERROR(check(e.file, name, t, ValueCheck::kFinite, shape, slice));
    return t;
  }

  StatusOr<Tensor> scale_for(const std::string& weight_name, DType weight_dtype,
                             const std::vector<int64_t>& weight_shape,
                             const std::vector<int64_t>& scale_shape) override {
    std::string base = weight_name.substr(0, weight_name.size() - std::string("weight").size());
    std::string scale_name = base + "weight_scale_inv";
    if (weight_dtype != DType::kF8E4M3) {
      if (ckpt_.contains(scale_name))
        return invalid_argument("checkpoint '" + ckpt_.dir() + "': '" + scale_name + "' is present but '" +
                                weight_name + "' is not F8_E4M3");
      return Tensor();
    }
    auto e = ckpt_.get(scale_name);
    if (!e.ok())
      return not_found("checkpoint '" + ckpt_.dir() + "': F8_E4M3 tensor '" + weight_name + "' has no '" +
                       scale_name + "'");
    used_.insert(scale_name);
    if (e->dtype != DType::kF32 && e->dtype != DType::kU8)
      return unsupported(e->file + ": tensor '" + scale_name + "' has dtype " + dtype_name(e->dtype) +
                         " (expected F32, or U8 holding E8M0 exponents)");
    if (e->shape != scale_shape)
      return invalid_argument(e->file + ": tensor '" + scale_name + "' has shape " + shape_to_string(e->shape) +
                              " but a " + shape_to_string(weight_shape) + " weight with " +
                              std::to_string(config_.weight_block_n) + "x" + std::to_string(config_.weight_block_k) +
                              " blocks needs " + shape_to_string(scale_shape));
    Tensor t = ckpt_.view(*e);
    NUCLEUS_RETURN_IF_ERROR(check(e->file, scale_name, t, ValueCheck::kBlockScale, scale_shape, {}));
    return t;
  }

  StatusOr<std::optional<float>> optional_scalar(const std::string& name) override {
    if (!ckpt_.contains(name)) return std::optional<float>();
    NUCLEUS_ASSIGN_OR_RETURN(TensorEntry e, ckpt_.get(name));
    used_.insert(name);
    if (!is_float_dtype(e.dtype) || shape_numel(e.shape) != 1 || e.shape.size() > 1)
      return invalid_argument(e.file + ": tensor '" + name + "' is " + dtype_name(e.dtype) + " " +
                              shape_to_string(e.shape) + "; a KV-cache scale is one F32, BF16 or F16 value ([] or [1])");
    const Tensor t = ckpt_.view(e);
    float v = 0.0f;
    convert_to_f32(t.raw(), t.dtype(), &v, 1);
    return std::optional<float>(v);
  }

  // Tensors in the checkpoint that the model did not read (ignoring layers
  // past num_hidden_layers and rotary buffers).
  Status check_unused() const {
    static const std::regex layer_re(R"(^model\.layers\.(\d+)\.)");
    for (const auto& [name, e] : ckpt_.entries()) {
      if (used_.count(name)) continue;
      std::smatch m;
      if (std::regex_search(name, m, layer_re)) {
        // Layers past num_hidden_layers are skipped (a truncated model); an index
        // that does not fit an int64 is no layer of any model.
        int64_t layer = 0;
        const std::string digits = m[1].str();
        const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), layer);
        if (ec != std::errc() || end != digits.data() + digits.size())
          return invalid_argument(e.file + ": unexpected tensor '" + name + "' (layer index out of range)");
        if (layer >= config_.num_hidden_layers) continue;
      }
      if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;
      return invalid_argument(e.file + ": unexpected tensor '" + name + "' (not part of a " + config_.model_type +
                              " model with this config.json)");
    }
    return ok_status();
  }

  int64_t progress_total() const override { return static_cast<int64_t>(ckpt_.entries().size()); }
  int64_t progress_done() const override { return static_cast<int64_t>(used_.size()); }
  // Bytes the value checks read, and the seconds they took.
  int64_t checked_bytes() const { return checked_bytes_; }
  double check_seconds() const { return check_seconds_; }

 private:
  Status check(const std::string& file, const std::string& name, const Tensor& t, ValueCheck what,
               const std::vector<int64_t>& full_shape, const SliceSpec& slice) {
    if (!check_values_) return ok_status();
    const auto t0 = std::chrono::steady_clock::now();
    Status s = check_tensor_values(file, name, t, what, full_shape, slice.split, slice.begin);
    check_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    checked_bytes_ += static_cast<int64_t>(t.nbytes());
    return s;
  }

  const Checkpoint& ckpt_;
  const ModelConfig& config_;
  const bool check_values_;
  std::set<std::string> used_;
  int64_t checked_bytes_ = 0;
  double check_seconds_ = 0.0;
};

// Dummy weights: uniform values with the standard deviation of N(0, 0.02)
// from a counter-based hash (deterministic for a seed, whatever the thread
// count); FP8 weights as e4m3 of values in +-16*sqrt(3) with scale 0.02/16.
class DummySource : public TensorSource {
 public:
  DummySource(const ModelConfig& config, uint64_t seed) : config_(config), seed_(seed) {}

  StatusOr<Tensor> get(const std::string& name, const std::vector<int64_t>& shape, bool linear,
                       const SliceSpec& slice) override {
    const bool is_norm = name.find("norm") != std::string::npos;
    const bool is_bias = name.find("e_score_correction_bias") != std::string::npos;
    const uint64_t key = seed_ ^ std::hash<std::string>{}(name);
    constexpr float kHalfWidth = 0.02f * 1.7320508f;  // uniform(-a, a) has std a / sqrt(3)
    // Only the slice is generated; value i of it is the full tensor's value
    // at full_index(i), so shards equal slices of the whole.
    std::vector<int64_t> out_shape = shape;
    int64_t row0 = 0, col0 = 0;
    if (slice.split == ShardSplit::kRows) {
      out_shape[0] = slice.end - slice.begin;
      row0 = slice.begin;
    } else if (slice.split == ShardSplit::kCols) {
      out_shape[1] = slice.end - slice.begin;
      col0 = slice.begin;
    }
    const int64_t n = shape_numel(out_shape);
    const int64_t out_cols = out_shape.size() == 2 ? out_shape[1] : 1, full_cols = shape.size() == 2 ? shape[1] : 1;
    auto full_index = [&](int64_t i) { return (row0 + i / out_cols) * full_cols + col0 + i % out_cols; };
    if (linear && config_.fp8 && name.find("mlp.gate.") == std::string::npos) {
      Tensor t = Tensor::empty(out_shape, DType::kF8E4M3);
      auto* p = t.data<uint8_t>();
      parallel_for(n, 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) p[i] = f32_to_fp8e4m3(uniform(key, full_index(i)) * 16.0f * 1.7320508f);
      });
      return t;
    }
    Tensor t = Tensor::empty(out_shape, DType::kBF16);
    auto* p = t.data<uint16_t>();
    parallel_for(n, 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        p[i] = f32_to_bf16(is_norm ? 1.0f : is_bias ? 0.0f : uniform(key, full_index(i)) * kHalfWidth);
    });
    return t;
  }

  StatusOr<Tensor> scale_for(const std::string&, DType weight_dtype, const std::vector<int64_t>&,
                             const std::vector<int64_t>& scale_shape) override {
    if (weight_dtype != DType::kF8E4M3) return Tensor();
    Tensor s = Tensor::empty(scale_shape, DType::kF32);
    for (int64_t i = 0; i < s.numel(); ++i) s.data<float>()[i] = 0.02f / 16.0f;
    return s;
  }

 private:
  // Uniform in [-1, 1) from (key, i).
  static float uniform(uint64_t key, int64_t i) {
    uint64_t x = key + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }

  const ModelConfig& config_;
  uint64_t seed_;
};

class Progress {
 public:
  Progress(const TensorSource& src, bool enabled) : src_(src), enabled_(enabled && isatty(2)) {}
  void update() {
    if (!enabled_ || src_.progress_total() == 0) return;
    int64_t done = src_.progress_done(), total = src_.progress_total();
    std::fprintf(stderr, "\rLoading weights: %lld/%lld tensors (%d%%)", static_cast<long long>(done),
                 static_cast<long long>(total), static_cast<int>(100 * done / total));
    std::fflush(stderr);
  }
  ~Progress() {
    if (enabled_ && src_.progress_total() > 0) std::fprintf(stderr, "\n");
  }

 private:
  const TensorSource& src_;
  bool enabled_;
};

class Loader {
 public:
  Loader(const ModelConfig& c, TensorSource& src, WeightBackend& backend, const TpShard& shard)
      : c_(c), src_(src), backend_(backend), shard_(shard) {}

  // This rank's slice of a dimension of `size` split `split`-wise.
  StatusOr<SliceSpec> slice_of(const std::string& name, ShardSplit split, int64_t size) {
    if (split == ShardSplit::kReplicated || shard_.world_size == 1) return SliceSpec{};
    NUCLEUS_ASSIGN_OR_RETURN(auto range, shard_range(size, shard_, name));
    return SliceSpec{split, range.first, range.second};
  }

  StatusOr<Tensor> dense(const std::string& name, std::vector<int64_t> shape,
                         ShardSplit split = ShardSplit::kReplicated) {
    NUCLEUS_ASSIGN_OR_RETURN(SliceSpec slice, slice_of(name, split, shape[0]));
    NUCLEUS_ASSIGN_OR_RETURN(Tensor host, src_.get(name, shape, /*linear=*/false, slice));
    return shape.size() == 1 ? backend_.vector(name, host) : backend_.embedding(name, host);
  }

  StatusOr<LinearWeight> linear(const std::string& prefix, int64_t out, int64_t in,
                                ShardSplit split = ShardSplit::kReplicated) {
    const int64_t split_size = split == ShardSplit::kCols ? in : out;
    NUCLEUS_ASSIGN_OR_RETURN(SliceSpec slice, slice_of(prefix + ".weight", split, split_size));
    return linear_slice(prefix, out, in, slice);
  }

  // The `slice` of the [out, in] linear weight `prefix` (rows or columns
  // [begin, end), or all of it), its FP8 scale sliced with it.
  StatusOr<LinearWeight> linear_slice(const std::string& prefix, int64_t out, int64_t in, const SliceSpec& slice) {
    const std::string wname = prefix + ".weight";
    const int64_t split_size = slice.split == ShardSplit::kCols ? in : out;
    NUCLEUS_ASSIGN_OR_RETURN(Tensor w, src_.get(wname, {out, in}, /*linear=*/true, slice));
    const int64_t bn = c_.weight_block_n, bk = c_.weight_block_k;
    std::vector<int64_t> scale_shape;
    if (c_.fp8) scale_shape = {(out + bn - 1) / bn, (in + bk - 1) / bk};
    NUCLEUS_ASSIGN_OR_RETURN(Tensor scale, src_.scale_for(wname, w.dtype(), {out, in}, scale_shape));
    if (scale.defined() && slice.split != ShardSplit::kReplicated) {
      NUCLEUS_ASSIGN_OR_RETURN(scale, slice_block_scale(scale, slice.split, slice.begin, slice.end, split_size,
                                                        slice.split == ShardSplit::kRows ? bn : bk,
                                                        shard_.world_size, wname));
    }
    auto lw = backend_.linear(prefix, w, scale, bn, bk);
    if (!lw.ok()) return lw.status().with_context(wname);
    return lw;
  }

  // The layer's FP8 KV-cache scale (see load_weights in weights.h). A scalar
  // of the latent cache, which every rank keeps whole: replicated.
  StatusOr<std::optional<float>> kv_cache_scale(const std::string& attn_prefix) {
    std::optional<float> out;
    std::string found;
    for (const char* where : {"", "attn.", "mla_attn."}) {
      for (const char* what : {"k_scale", "kv_scale", "v_scale"}) {
        const std::string name = attn_prefix + where + what;
        NUCLEUS_ASSIGN_OR_RETURN(std::optional<float> v, src_.optional_scalar(name));
        if (!v || std::string(what) == "v_scale") continue;
        NUCLEUS_RETURN_IF_ERROR(check_k_scale(*v, "checkpoint tensor '" + name + "'"));
        if (out && *out != *v)
          return invalid_argument("checkpoint KV-cache scales disagree: '" + found + "' = " + std::to_string(*out) +
                                  " but '" + name + "' = " + std::to_string(*v));
        out = v;
        found = name;
      }
    }
    return out;
  }

  // gate_proj and up_proj column-parallel, down_proj row-parallel: a rank
  // computes its slice of the intermediate width; the ranks' down_proj
  // outputs are partial sums of the MLP's output.
  StatusOr<MlpWeights> mlp(const std::string& prefix, int64_t inter) {
    MlpWeights m;
    m.inter = inter / shard_.world_size;
    const int64_t H = c_.hidden_size;
    NUCLEUS_ASSIGN_OR_RETURN(LinearWeight gate, linear(prefix + ".gate_proj", inter, H, ShardSplit::kRows));
    NUCLEUS_ASSIGN_OR_RETURN(LinearWeight up, linear(prefix + ".up_proj", inter, H, ShardSplit::kRows));
    NUCLEUS_ASSIGN_OR_RETURN(m.gate_up, backend_.concat_rows(prefix + ".gate_up_proj", gate, up));
    NUCLEUS_ASSIGN_OR_RETURN(m.down, linear(prefix + ".down_proj", H, inter, ShardSplit::kCols));
    return m;
  }

  // The shared experts (width n_shared_experts * moe_intermediate_size, this
  // rank's slice of it) as n_shared_experts MLPs of the routed experts' width
  // (MoeWeights::shared_experts): piece s holds intermediate units [s I_r,
  // (s + 1) I_r) of the slice, I_r = moe_intermediate_size / tp; gate and up
  // rows, down columns. The MLP's output is the sum of its pieces' (SwiGLU
  // acts on each intermediate unit alone). Empty when FP8 scale blocks do not
  // fall on the pieces' boundaries (the caller then loads the whole MLP).
  StatusOr<std::vector<MlpWeights>> shared_pieces(const std::string& prefix) {
    const int64_t ns = c_.n_shared_experts, full = ns * c_.moe_intermediate_size, H = c_.hidden_size;
    std::vector<MlpWeights> pieces;
    if (ns == 1) {  // the whole MLP is one routed-expert-shaped MLP
      NUCLEUS_ASSIGN_OR_RETURN(MlpWeights m, mlp(prefix, full));
      pieces.push_back(std::move(m));
      return pieces;
    }
    const int64_t inter = c_.moe_intermediate_size / shard_.world_size;
    if (c_.fp8 && (inter % c_.weight_block_n != 0 || inter % c_.weight_block_k != 0)) return pieces;
    NUCLEUS_ASSIGN_OR_RETURN(SliceSpec rank, slice_of(prefix + ".gate_proj.weight", ShardSplit::kRows, full));
    const int64_t first = rank.split == ShardSplit::kReplicated ? 0 : rank.begin;
    for (int64_t piece = 0; piece < ns; ++piece) {
      const int64_t b = first + piece * inter;
      const SliceSpec rows{ShardSplit::kRows, b, b + inter}, cols{ShardSplit::kCols, b, b + inter};
      MlpWeights m;
      m.inter = inter;
      NUCLEUS_ASSIGN_OR_RETURN(LinearWeight gate, linear_slice(prefix + ".gate_proj", full, H, rows));
      NUCLEUS_ASSIGN_OR_RETURN(LinearWeight up, linear_slice(prefix + ".up_proj", full, H, rows));
      NUCLEUS_ASSIGN_OR_RETURN(
          m.gate_up, backend_.concat_rows(prefix + ".gate_up_proj[" + std::to_string(piece) + "]", gate, up));
      NUCLEUS_ASSIGN_OR_RETURN(m.down, linear_slice(prefix + ".down_proj", H, full, cols));
      m.down.name = prefix + ".down_proj[" + std::to_string(piece) + "]";
      pieces.push_back(std::move(m));
    }
    return pieces;
  }

  StatusOr<LayerWeights> layer(int64_t l) {
    const std::string p = layer_prefix(l);
    const int64_t H = c_.hidden_size, nh = c_.num_attention_heads;
    LayerWeights w;
    NUCLEUS_ASSIGN_OR_RETURN(w.input_layernorm, dense(p + "input_layernorm.weight", {H}));
    NUCLEUS_ASSIGN_OR_RETURN(w.post_attention_layernorm, dense(p + "post_attention_layernorm.weight", {H}));
    AttentionWeights& a = w.attn;
    const std::string ap = p + "self_attn.";
    if (c_.q_lora_rank > 0) {
      NUCLEUS_ASSIGN_OR_RETURN(a.q_a_proj, linear(ap + "q_a_proj", c_.q_lora_rank, H));
      NUCLEUS_ASSIGN_OR_RETURN(a.q_a_layernorm, dense(ap + "q_a_layernorm.weight", {c_.q_lora_rank}));
      NUCLEUS_ASSIGN_OR_RETURN(a.q_b_proj,
                               linear(ap + "q_b_proj", nh * c_.qk_head_dim(), c_.q_lora_rank, ShardSplit::kRows));
    } else {
      NUCLEUS_ASSIGN_OR_RETURN(a.q_proj, linear(ap + "q_proj", nh * c_.qk_head_dim(), H, ShardSplit::kRows));
    }
    NUCLEUS_ASSIGN_OR_RETURN(a.kv_a_proj, linear(ap + "kv_a_proj_with_mqa", c_.kv_cache_width(), H));
    NUCLEUS_ASSIGN_OR_RETURN(a.kv_a_layernorm, dense(ap + "kv_a_layernorm.weight", {c_.kv_lora_rank}));
    NUCLEUS_ASSIGN_OR_RETURN(a.kv_b_proj, linear(ap + "kv_b_proj", nh * (c_.qk_nope_head_dim + c_.v_head_dim),
                                                 c_.kv_lora_rank, ShardSplit::kRows));
    NUCLEUS_ASSIGN_OR_RETURN(a.o_proj, linear(ap + "o_proj", H, nh * c_.v_head_dim, ShardSplit::kCols));
    NUCLEUS_ASSIGN_OR_RETURN(a.k_scale, kv_cache_scale(ap));
    if (c_.is_moe_layer(l)) {
      MoeWeights m;
      const int64_t E = c_.n_routed_experts;
      NUCLEUS_ASSIGN_OR_RETURN(Tensor router_host, src_.get(p + "mlp.gate.weight", {E, H}, false));
      m.router.name = p + "mlp.gate";
      m.router.out_features = E;
      m.router.in_features = H;
      NUCLEUS_ASSIGN_OR_RETURN(m.router.weight, backend_.router(p + "mlp.gate.weight", router_host));
      if (c_.topk_method == TopkMethod::kNoauxTc) {
        NUCLEUS_ASSIGN_OR_RETURN(Tensor bias_host, src_.get(p + "mlp.gate.e_score_correction_bias", {E}, false));
        NUCLEUS_ASSIGN_OR_RETURN(m.e_score_correction_bias,
                                 backend_.vector(p + "mlp.gate.e_score_correction_bias", bias_host));
      }
      for (int64_t e = 0; e < E; ++e) {
        NUCLEUS_ASSIGN_OR_RETURN(MlpWeights ew,
                                 mlp(p + "mlp.experts." + std::to_string(e), c_.moe_intermediate_size));
        m.experts.push_back(std::move(ew));
        progress_->update();
      }
      if (c_.n_shared_experts > 0 && fuse_shared_) {
        NUCLEUS_ASSIGN_OR_RETURN(m.shared_experts, shared_pieces(p + "mlp.shared_experts"));
        if (m.shared_experts.empty() && !std::exchange(logged_whole_shared_, true))
          NUCLEUS_LOG_INFO("shared experts stay one MLP (NUCLEUS_MOE_FUSE_SHARED): their {}-wide pieces are not "
                           "whole {}x{} FP8 scale blocks",
                           c_.moe_intermediate_size / shard_.world_size, c_.weight_block_n, c_.weight_block_k);
      }
      if (c_.n_shared_experts > 0 && m.shared_experts.empty()) {
        NUCLEUS_ASSIGN_OR_RETURN(m.shared,
                                 mlp(p + "mlp.shared_experts", c_.moe_intermediate_size * c_.n_shared_experts));
      }
      w.moe = std::move(m);
    } else {
      NUCLEUS_ASSIGN_OR_RETURN(w.mlp, mlp(p + "mlp", c_.intermediate_size));
    }
    return w;
  }

  StatusOr<ModelWeights> all(Progress* progress) {
    progress_ = progress;
    NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMoeFuseShared));
    const std::optional<AutoSwitch> fuse = env_auto_switch(Knob::kMoeFuseShared);
    // auto: on for CUDA, the measured rule (docs/perf.md "MoE decode: the
    // shared experts as routed experts", session 13); off for the CPU
    // reference, which keeps the checkpoint's MLP.
    fuse_shared_ = *fuse == AutoSwitch::kOn || (*fuse == AutoSwitch::kAuto && backend_.device() == Device::kCuda);
    ModelWeights w;
    const int64_t V = c_.vocab_size, H = c_.hidden_size;
    NUCLEUS_ASSIGN_OR_RETURN(w.embed_tokens, dense("model.embed_tokens.weight", {V, H}, ShardSplit::kRows));
    if (with_mtp_ && !share_always_) {  // this rank's vocabulary slice, as the MTP's is compared
      NUCLEUS_ASSIGN_OR_RETURN(SliceSpec embed_slice, slice_of("model.embed_tokens.weight", ShardSplit::kRows, V));
      NUCLEUS_ASSIGN_OR_RETURN(embed_host_, src_.get("model.embed_tokens.weight", {V, H}, false, embed_slice));
    }
    progress->update();
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      NUCLEUS_ASSIGN_OR_RETURN(LayerWeights lw, layer(l));
      w.layers.push_back(std::move(lw));
      progress->update();
    }
    NUCLEUS_ASSIGN_OR_RETURN(w.norm, dense("model.norm.weight", {H}));
    const std::string head = c_.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    NUCLEUS_ASSIGN_OR_RETURN(SliceSpec head_slice, slice_of(head, ShardSplit::kRows, V));
    NUCLEUS_ASSIGN_OR_RETURN(Tensor head_host, src_.get(head, {V, H}, /*linear=*/false, head_slice));
    NUCLEUS_ASSIGN_OR_RETURN(w.lm_head, backend_.linear("lm_head", head_host, Tensor(), 0, 0));
    head_host_ = head_host;
    progress->update();
    if (with_mtp_) {
      NUCLEUS_ASSIGN_OR_RETURN(ModelWeights m, mtp(w));
      w.mtp = std::make_shared<ModelWeights>(std::move(m));
    }
    return w;
  }

  // Loads the MTP module (layer num_hidden_layers) with all(); `share_always`
  // (dummy weights) shares the main model's embedding and head without
  // comparing them.
  void set_mtp(bool with_mtp, bool share_always) {
    with_mtp_ = with_mtp;
    share_always_ = share_always;
  }

 private:
  // Whether a checkpoint tensor holds exactly the bytes of `main` (then the
  // MTP module uses the main model's converted copy).
  bool same_bytes(const Tensor& a, const Tensor& main) const {
    if (share_always_) return true;
    return a.defined() && main.defined() && a.dtype() == main.dtype() && a.shape() == main.shape() &&
           std::memcmp(a.raw(), main.raw(), a.nbytes()) == 0;
  }

  // Under tensor parallelism the module is split as the main model is (its
  // decoder layer as layer() splits any layer, embed_tokens and
  // shared_head.head by vocabulary rows); enorm, hnorm, eh_proj and
  // shared_head.norm are replicated (eh_proj's output is the layer's whole
  // input on every rank: DeepseekModel::build does not all-reduce it).
  StatusOr<ModelWeights> mtp(const ModelWeights& main) {
    const int64_t l = c_.num_hidden_layers, V = c_.vocab_size, H = c_.hidden_size;
    const std::string p = layer_prefix(l);
    if (c_.num_nextn_predict_layers < 1)
      return failed_precondition("speculative decoding with method deepseek_mtp needs a checkpoint with a "
                                 "multi-token-prediction layer, but config.json has num_nextn_predict_layers = 0");
    ModelWeights m;
    MtpFrontWeights f;
    auto enorm = dense(p + "enorm.weight", {H});
    if (!enorm.ok())
      return enorm.status().with_context("the multi-token-prediction (MTP) layer " + std::to_string(l) +
                                         " that config.json's num_nextn_predict_layers promises (speculative "
                                         "decoding needs it)");
    f.enorm = std::move(*enorm);
    NUCLEUS_ASSIGN_OR_RETURN(f.hnorm, dense(p + "hnorm.weight", {H}));
    NUCLEUS_ASSIGN_OR_RETURN(f.eh_proj, linear(p + "eh_proj", H, 2 * H));
    m.mtp_front = std::move(f);
    NUCLEUS_ASSIGN_OR_RETURN(LayerWeights lw, layer(l));
    m.layers.push_back(std::move(lw));
    NUCLEUS_ASSIGN_OR_RETURN(m.norm, dense(p + "shared_head.norm.weight", {H}));
    const std::string embed = p + "embed_tokens.weight", head = p + "shared_head.head.weight";
    Tensor embed_host, head_host;
    NUCLEUS_ASSIGN_OR_RETURN(SliceSpec embed_slice, slice_of(embed, ShardSplit::kRows, V));
    NUCLEUS_ASSIGN_OR_RETURN(SliceSpec head_slice, slice_of(head, ShardSplit::kRows, V));
    if (!share_always_) {
      NUCLEUS_ASSIGN_OR_RETURN(embed_host, src_.get(embed, {V, H}, false, embed_slice));
    }
    if (same_bytes(embed_host, embed_host_)) {
      m.embed_tokens = main.embed_tokens;
    } else {
      NUCLEUS_ASSIGN_OR_RETURN(m.embed_tokens, backend_.embedding(embed, embed_host));
    }
    if (!share_always_) {
      NUCLEUS_ASSIGN_OR_RETURN(head_host, src_.get(head, {V, H}, false, head_slice));
    }
    if (same_bytes(head_host, head_host_)) {
      m.lm_head = main.lm_head;
    } else {
      NUCLEUS_ASSIGN_OR_RETURN(m.lm_head, backend_.linear(p + "shared_head.head", head_host, Tensor(), 0, 0));
    }
    NUCLEUS_LOG_INFO("MTP layer {} loaded (embed_tokens {}, shared_head.head {})", l,
                     m.embed_tokens.raw() == main.embed_tokens.raw() ? "shared with the model" : "its own copy",
                     m.lm_head.weight.raw() == main.lm_head.weight.raw() ? "shared with lm_head" : "its own copy");
    return m;
  }

 public:

 private:
  const ModelConfig& c_;
  TensorSource& src_;
  WeightBackend& backend_;
  TpShard shard_;
  Progress* progress_ = nullptr;
  bool with_mtp_ = false, share_always_ = false;
  // NUCLEUS_MOE_FUSE_SHARED: shared experts loaded as routed-expert-shaped
  // pieces (MoeWeights::shared_experts); logged_whole_shared_: said once why not.
  bool fuse_shared_ = false, logged_whole_shared_ = false;
  Tensor embed_host_, head_host_;  // the main model's checkpoint tensors (host views), for the MTP's dedup
};

}  // namespace

std::unique_ptr<WeightBackend> make_weight_backend(Device device) {
  return device == Device::kCuda ? make_cuda_weight_backend() : make_cpu_weight_backend();
}

StatusOr<ModelWeights> load_weights(const Checkpoint& ckpt, const ModelConfig& config, WeightBackend& backend,
                                    const LoadOptions& options, const TpShard& shard) {
  NUCLEUS_RETURN_IF_ERROR(check_tp_config(config, shard.world_size));
  CheckpointSource src(ckpt, config, options.check_values);
  Loader loader(config, src, backend, shard);
  loader.set_mtp(options.load_mtp, false);
  Progress progress(src, options.show_progress);
  NUCLEUS_ASSIGN_OR_RETURN(ModelWeights w, loader.all(&progress));
  NUCLEUS_RETURN_IF_ERROR(src.check_unused());
  if (options.check_values)
    NUCLEUS_LOG_INFO("weight check{}: {:.1f} MiB in {:.1f} ms ({:.2f} GB/s; --skip-weight-check skips it)",
                     shard.world_size > 1 ? " (rank " + std::to_string(shard.rank) + ")" : std::string(),
                     src.checked_bytes() / double(1 << 20), 1e3 * src.check_seconds(),
                     src.checked_bytes() / 1e9 / std::max(src.check_seconds(), 1e-9));
  return w;
}

StatusOr<ModelWeights> make_dummy_weights(const ModelConfig& config, WeightBackend& backend, uint64_t seed,
                                          const TpShard& shard, bool with_mtp) {
  NUCLEUS_RETURN_IF_ERROR(check_tp_config(config, shard.world_size));
  DummySource src(config, seed);
  Loader loader(config, src, backend, shard);
  loader.set_mtp(with_mtp, true);
  Progress progress(src, false);
  return loader.all(&progress);
}

}  // namespace nucleus
