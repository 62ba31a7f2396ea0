// Multi-head latent attention ops: RoPE fused with the latent KV-cache write,
// and attention over the cache in expanded or absorbed form.
#pragma once

#include "kernels/mla/mla_attention_ref.h"
#include "kernels/rope/rope_ref.h"
#include "ops/linear_weight.h"
#include "ops/op.h"

namespace nucleus {

// For each token t (position p = positions[t]):
//   q[t, h, qk_nope:] = rope(q[t, h, qk_nope:], p) for every head h;
//   k_pe = rope(kv_a[t, kv_lora:], p);
//   if slot_mapping[t] >= 0: cache[layer, slot] = stored([kv_a[t, :kv_lora] | k_pe])
// where stored() is the cache dtype's encoding (ops/kv_cache_dtype.h): the
// value (f32), its bf16 rounding, or e4m3(value / k_scale[layer]) (FP8).
// kv_a's first kv_lora columns must already be normalised (kv_a_layernorm).
// Buffers: in = {q [T, num_heads * qk_head], kv_a [T, kv_lora + qk_rope]};
// out = {q} (in place), or, when in[0] is a split-K GEMM's f32 output
// (graph/passes/splitk_pass.h), out = {the declared q buffer}: q written whole
// from in[0] (q_nope copied, q_pe rotated). The same kernel writes prefill and
// decode rows, so a token's row does not depend on the step that wrote it.
class RopeKvCacheWriteOp : public OpWithBackends<RopeKvCacheWriteOp> {
 public:
  // `inv_freq_device` ([qk_rope / 2] f32 on the device, CUDA only) and
  // `attention_factor` give the CUDA kernel the same rotation as `rope`.
  // `cache_dtype`: the cache this op writes (backends refuse dtypes they
  // cannot encode; run() checks the cache it is given against it).
  RopeKvCacheWriteOp(int64_t layer, const kernels::RopeTable* rope, kernels::MlaDims dims,
                     const float* inv_freq_device = nullptr, float attention_factor = 1.0f,
                     KvCacheDtype cache_dtype = KvCacheDtype::kBF16)
      : layer_(layer), rope_(rope), dims_(dims), inv_freq_device_(inv_freq_device),
        attention_factor_(attention_factor), cache_dtype_(cache_dtype) {}
  const char* kind() const override { return "rope_kv_cache_write"; }
  std::string attrs() const override;
  bool accepts_f32_input(size_t index) const override { return index == 0; }
  static const std::vector<Backend<RopeKvCacheWriteOp>>& backends();
  int64_t layer() const { return layer_; }
  const kernels::RopeTable& rope() const { return *rope_; }
  const kernels::MlaDims& dims() const { return dims_; }
  const float* inv_freq_device() const { return inv_freq_device_; }
  float attention_factor() const { return attention_factor_; }
  KvCacheDtype cache_dtype() const { return cache_dtype_; }

 private:
  int64_t layer_;
  const kernels::RopeTable* rope_;
  kernels::MlaDims dims_;
  const float* inv_freq_device_;
  float attention_factor_;
  KvCacheDtype cache_dtype_;
};

// How attention reads the latent cache.
//   kExpanded: kv_b_proj applied to every cached latent (prefill form).
//   kAbsorbed: W_UK folded into the query, W_UV into the output (decode form).
//   kAuto:     absorbed for sequences with one query token, else expanded.
enum class AttentionMode { kAuto, kExpanded, kAbsorbed };
const char* attention_mode_name(AttentionMode m);
StatusOr<AttentionMode> parse_attention_mode(const std::string& s);

// Which sequences an attention op serves in a step, by the model's mode:
// kAuto: the decode op serves sequences with one query token, the prefill op
// the others; kAbsorbed: the decode op serves all; kExpanded: the prefill op
// serves all.
bool serves_sequence(AttentionMode mode, bool decode_op, int32_t query_len);

// Fields both attention ops share. `cache_dtype` is the latent cache the op
// reads, fixed when the graph is built: a backend that cannot read it refuses
// in supports() (never fed bytes it would misread); run() checks the cache it
// is given against it. An FP8 cache is read as stored * k_scale[layer].
class MlaAttentionBase {
 public:
  MlaAttentionBase(int64_t layer, const LinearWeight* kv_b, kernels::MlaDims dims, AttentionMode mode,
                   KvCacheDtype cache_dtype = KvCacheDtype::kBF16)
      : layer_(layer), kv_b_(kv_b), dims_(dims), mode_(mode), cache_dtype_(cache_dtype) {}
  int64_t layer() const { return layer_; }
  const LinearWeight& kv_b() const { return *kv_b_; }
  const kernels::MlaDims& dims() const { return dims_; }
  AttentionMode mode() const { return mode_; }
  KvCacheDtype cache_dtype() const { return cache_dtype_; }
  // Backend-owned device state (scratch, prepared weights), built on first use.
  std::vector<Tensor>& state() { return state_; }

 private:
  int64_t layer_;
  const LinearWeight* kv_b_;
  kernels::MlaDims dims_;
  AttentionMode mode_;
  KvCacheDtype cache_dtype_;
  std::vector<Tensor> state_;
};

// Checks (a bug if not) that `kv` stores `expected` rows; `who` names the op.
void check_cache_dtype(const KvCache& kv, KvCacheDtype expected, const char* who);

// Absorbed-form (decode) attention over the paged latent cache for the rows of
// the sequences it serves (run after RopeKvCacheWriteOp, so a row sees its own
// key). Buffers: in = {q [T, num_heads * qk_head]}; out = {attn_out
// [T, num_heads * v_head] (only its rows written), q_lat, o_lat scratch
// [W, num_heads * kv_lora] f32 (backends may use them, W rows at a time)}.
class MlaDecodeAttentionOp : public OpWithBackends<MlaDecodeAttentionOp>, public MlaAttentionBase {
 public:
  using MlaAttentionBase::MlaAttentionBase;
  const char* kind() const override { return "mla_decode"; }
  std::string attrs() const override;
  // A plan serves the ops of one head count and mode.
  std::string step_plan_key() const override {
    return "heads=" + std::to_string(dims().num_heads) + " mode=" + attention_mode_name(mode());
  }
  static const std::vector<Backend<MlaDecodeAttentionOp>>& backends();
};

// Expanded-form (prefill) causal attention for the sequences it serves: each
// query attends to the sequence's cached rows (earlier chunks, prefix-cache
// hits) and its own chunk, K_nope / V rebuilt from the latent rows by
// kv_b_proj. CUDA expands at most `context_chunk` cached rows at a time and
// merges the pieces by log-sum-exp. Buffers: in = {q}; out = {attn_out}.
class MlaPrefillAttentionOp : public OpWithBackends<MlaPrefillAttentionOp>, public MlaAttentionBase {
 public:
  MlaPrefillAttentionOp(int64_t layer, const LinearWeight* kv_b, kernels::MlaDims dims, AttentionMode mode,
                        int64_t context_chunk, KvCacheDtype cache_dtype = KvCacheDtype::kBF16)
      : MlaAttentionBase(layer, kv_b, dims, mode, cache_dtype), context_chunk_(context_chunk) {}
  const char* kind() const override { return "mla_prefill"; }
  std::string attrs() const override;
  // A plan serves the ops of one head shape, mode and context chunk.
  std::string step_plan_key() const override {
    return "heads=" + std::to_string(dims().num_heads) + " qk=" + std::to_string(dims().qk_head()) +
           " v=" + std::to_string(dims().v_head) + " mode=" + attention_mode_name(mode()) +
           " chunk=" + std::to_string(context_chunk_);
  }
  static const std::vector<Backend<MlaPrefillAttentionOp>>& backends();
  int64_t context_chunk() const { return context_chunk_; }

 private:
  int64_t context_chunk_;
};

}  // namespace nucleus
