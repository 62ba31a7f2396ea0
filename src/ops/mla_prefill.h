// The mla_prefill op family: expanded-form causal MLA attention (its CUDA
// backends: ops/mla_prefill_cuda.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ops/mla_attention.h"
#include "ops/op.h"

namespace nucleus {

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
