// The mla_decode op family: absorbed-form MLA attention over the paged latent
// cache (its CUDA backends: ops/mla_decode_cuda.h).
#pragma once

#include <string>
#include <vector>

#include "ops/mla_attention.h"
#include "ops/op.h"

namespace nucleus {

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

}  // namespace nucleus
