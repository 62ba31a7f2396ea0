// The rope_kv_cache_write op family: RoPE of multi-head latent attention fused
// with the latent KV-cache write (its CUDA backend: ops/rope_kv_cache_write_cuda.h).
#pragma once

#include <string>
#include <vector>

#include "kernels/mla/mla_attention_ref.h"
#include "kernels/rope/rope_ref.h"
#include "ops/kv_cache_dtype.h"
#include "ops/op.h"

namespace nucleus {

// For each token t (position p = positions[t]):
//   q[t, h, qk_nope:] = rope(q[t, h, qk_nope:], p) for every head h;
//   k_pe = rope(kv_a[t, kv_lora:], p);
//   if slot_mapping[t] >= 0: cache[layer, slot] = stored([kv_a[t, :kv_lora] | k_pe])
// where stored() is the cache dtype's encoding (ops/kv_cache_dtype.h): the
// value (f32), its bf16 rounding, or e4m3(value / k_scale[layer]) (FP8).
// kv_a's first kv_lora columns must already be normalised (kv_a_layernorm),
// unless the op has the norm fused in (fuse_kv_norm): then the stored c_kv is
// rmsnorm(kv_a[t, :kv_lora]) * weight (the RmsNormOp's math: on CUDA rounded
// to bf16 as that op's kernel rounds it) and kv_a is only read.
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
  // Fuses kv_a_layernorm (weight [kv_lora] f32 on the op's device, eps) into
  // the op, in place of an RmsNormOp on kv_a before it
  // (NUCLEUS_FUSE_KV_A_NORM). kv_a must then be bf16 on CUDA (the op does not
  // take a split-K GEMM's f32 kv_a; the split-K pass then keeps kv_a_proj off
  // split-K).
  void fuse_kv_norm(Tensor weight, float eps) {
    kv_norm_weight_ = std::move(weight);
    kv_norm_eps_ = eps;
  }
  const Tensor& kv_norm_weight() const { return kv_norm_weight_; }  // undefined unless fused
  float kv_norm_eps() const { return kv_norm_eps_; }
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
  Tensor kv_norm_weight_;
  float kv_norm_eps_ = 0.0f;
};

}  // namespace nucleus
