// Multi-head latent attention: what the mla_decode and mla_prefill op
// families (ops/mla_decode.h, ops/mla_prefill.h) share: the attention mode,
// the ops' common fields, the cache dtype check and the CPU reference run.
#pragma once

#include <string>
#include <vector>

#include "kernels/mla/mla_attention_ref.h"
#include "ops/kv_cache_dtype.h"
#include "ops/linear_weight.h"
#include "ops/op.h"

namespace nucleus {

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
  const std::vector<Tensor>& state() const { return state_; }

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

// The CPU reference of an attention op: `ref` (kernels::mla_attention_absorbed_ref
// or mla_attention_expanded_ref) for every sequence the op serves
// (serves_sequence() with `decode_op`), over its latent rows [0, context +
// query) gathered through its block table and decoded to f32. q: [T,
// num_heads * qk_head] f32; o: [T, num_heads * v_head] f32, only the served
// sequences' rows written. A bug (check) when the cache is not the op's
// dtype or a sequence lacks a block for one of its positions.
using MlaReferenceFn = void (*)(const kernels::MlaDims& dims, const float* q, int64_t q_stride, int64_t num_queries,
                                int64_t context_len, const float* latent, const float* w_kv_b, float* out,
                                int64_t out_stride, float* lse);
void run_mla_reference(const MlaAttentionBase& op, bool decode_op, OpContext& ctx, const Tensor& q, const Tensor& o,
                       MlaReferenceFn ref);

// OK when the CPU reference reads the op's kv_b_proj (an F32 weight).
Status cpu_kv_b_supported(const MlaAttentionBase& op);

}  // namespace nucleus
