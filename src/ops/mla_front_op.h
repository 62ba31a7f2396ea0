// The MLA decode front end as one op: what the decode graph's chain
//   q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa,
//   kv_a_layernorm, rope_kv_cache_write, and the attention's gather of q_nope
//   and its W_UK absorption
// computes between the input RMSNorm and the decode attention, served per
// step width by a width build (jit/mla_front_builds.h: the fused
// persistent kernel, else the lean pair) or, for a width both were refused
// at or a step wider than every width, by the plain chain of the same
// kernels the separate ops run (width::launch_mla_front_plain). The decode
// graph uses it only with NUCLEUS_WIDTH_BUILDS=1|lean on CUDA (docs/width_builds.md).
//
// For each of the step's T rows (position p, slot s):
//   q_a    = rmsnorm(x . W_qa^T) * w_qa          (no q LoRA: skipped)
//   q      = q_a . W_qb^T  (no q LoRA: x . W_q^T), q_pe rotated in place
//   kv_a   = x . W_kva^T; c_kv = rmsnorm(kv_a[:512]) * w_kva; k_pe = rope(kv_a[512:], p)
//   cache[layer, s] = [c_kv | k_pe]              (s = -1: nothing written)
//   q_full[t, h] = [q_nope[t, h] . W_UK[h] | q_pe[t, h]]   (W_UK: kv_b_proj rows h*256 .. h*256+127)
// with bf16 rounding after every GEMM (f32 accumulation) as the chain.
//
// Buffers: in = {x [T, hidden] bf16 (the input RMSNorm's output)};
// out = {q [T, num_heads * 192], q_full [T, num_heads * 576], kv_a [T, 576],
// q_a [T, max(q_lora, 8)] scratch, q_nope [T, num_heads * 128] scratch}, all
// bf16. MlaDecodeAttentionOp then reads q_full instead of absorbing q itself.
// Supported (else the graph keeps the separate ops): bf16 weights, a bf16
// cache, DeepSeek's MLA widths (kv_lora 512, qk_rope 64, qk_nope 128,
// v_head 128), hidden and q_lora multiples of 8, q_lora <= 8192.
#pragma once

#include <memory>

#include "kernels/mla/mla_attention_ref.h"
#include "ops/kv_cache_dtype.h"
#include "ops/linear_weight.h"
#include "ops/op.h"

namespace nucleus {

namespace width {
class MlaFrontWidthBuilds;
}

class MlaFrontOp : public OpWithBackends<MlaFrontOp> {
 public:
  struct Weights {
    const LinearWeight* q_a = nullptr;  // q_a_proj [q_lora, hidden]; null without a q LoRA
    const Tensor* q_a_norm = nullptr;   // q_a_layernorm [q_lora] f32; null without a q LoRA
    const LinearWeight* q = nullptr;    // q_b_proj [heads * 192, q_lora], or q_proj [heads * 192, hidden]
    const LinearWeight* kv_a = nullptr; // kv_a_proj_with_mqa [576, hidden]
    const Tensor* kv_a_norm = nullptr;  // kv_a_layernorm [512] f32
    const LinearWeight* kv_b = nullptr; // kv_b_proj [heads * 256, 512]
  };
  // `builds` (shared by the model's layers) and `barrier` ([2] u32 device
  // memory, zero; one per model: the launches run one after another on the
  // engine stream) come from the model; inv_freq_device ([32] f32) and
  // attention_factor give RopeKvCacheWriteOp's rotation.
  MlaFrontOp(int64_t layer, Weights w, int64_t hidden, int64_t q_lora, int64_t num_heads, float eps,
             const float* inv_freq_device, float attention_factor, KvCacheDtype cache_dtype,
             const width::MlaFrontWidthBuilds* builds, void* barrier)
      : layer_(layer), w_(w), hidden_(hidden), q_lora_(q_lora), num_heads_(num_heads), eps_(eps),
        inv_freq_device_(inv_freq_device), attention_factor_(attention_factor), cache_dtype_(cache_dtype),
        builds_(builds), barrier_(barrier) {}
  const char* kind() const override { return "mla_front"; }
  std::string attrs() const override;
  static const std::vector<Backend<MlaFrontOp>>& backends();

  int64_t layer() const { return layer_; }
  const Weights& weights() const { return w_; }
  int64_t hidden() const { return hidden_; }
  int64_t q_lora() const { return q_lora_; }
  int64_t num_heads() const { return num_heads_; }
  float eps() const { return eps_; }
  const float* inv_freq_device() const { return inv_freq_device_; }
  float attention_factor() const { return attention_factor_; }
  KvCacheDtype cache_dtype() const { return cache_dtype_; }
  const width::MlaFrontWidthBuilds* builds() const { return builds_; }
  void* barrier() const { return barrier_; }

 private:
  int64_t layer_;
  Weights w_;
  int64_t hidden_, q_lora_, num_heads_;
  float eps_;
  const float* inv_freq_device_;
  float attention_factor_;
  KvCacheDtype cache_dtype_;
  const width::MlaFrontWidthBuilds* builds_;
  void* barrier_;
};

// Why the front-end op cannot serve a layer with these weights, dims and
// cache (a message), or OK: the checks of the header comment.
Status mla_front_supported(const MlaFrontOp::Weights& w, int64_t hidden, int64_t q_lora, const kernels::MlaDims& dims,
                           KvCacheDtype cache_dtype);

}  // namespace nucleus
