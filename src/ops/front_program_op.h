// The front of an MLA decode layer as one decode program (issue #20;
// docs/decode_program.md; kernels/mono FrontChain): what the decode graph's
//   input_layernorm, self_attn.q_proj (with a q LoRA: q_a_proj,
//   q_a_layernorm, q_b_proj), self_attn.kv_a_proj_with_mqa,
//   self_attn.rope_kv_cache_write (kv_a_layernorm fused)
// compute, as one launch of the decode-program kernel for steps of at most
// max_rows() rows (8 unless NUCLEUS_DECODE_PROGRAM_MAX_ROWS says less):
//   residual += delta (not for the first layer);  x = rmsnorm(residual) * w
//   q = x . W_q^T (q = rmsnorm(x . W_qa^T) * w_qa . W_qb^T), q_pe rotated;  kv_a = x . W_kva^T
//   cache[layer, slot] = [rmsnorm(c_kv) * w_kv | rope(k_pe)]   (slot -1: none)
// Steps of more rows run the ops above, which this op holds.
//
// With kv_b set (Parts::kv_b, NUCLEUS_DECODE_PROGRAM_ABSORB) a program step
// also writes the decode attention's absorbed query (MLA's absorbed form):
//   q_full[r, h] = [q_nope[r, h] . W_UK[h] | rotated q_pe[r, h]]   [T, heads, kv_lora + qk_rope] bf16
// (W_UK[h] = kv_b_proj's rows h * (qk_nope + v_head) ... + qk_nope, read
// from a transposed copy made at reserve), which the attention op then reads
// instead of absorbing q itself (MlaDecodeAttentionOp::set_absorbed_input_rows(8));
// wider steps leave it unwritten.
//
// Buffers: in = {residual [T, hidden] f32, delta [T, hidden] bf16} ({residual}
// for the first layer); out = {residual (in[0]), x_norm [T, hidden] bf16 (the
// held ops' scratch), q [T, heads * (qk_nope + qk_rope)] bf16, kv_a [T,
// kv_lora + qk_rope] bf16[, q_a [T, q_lora] bf16 with a q LoRA][, q_full
// with kv_b]}. CUDA only;
// the decode graph uses it with
// NUCLEUS_DECODE_PROGRAMS=1 (docs/flags.md).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ops/basic_ops.h"
#include "ops/linear_op.h"
#include "ops/op.h"
#include "ops/rope_kv_cache_write.h"

namespace nucleus {

// The split partials of decode programs' own attention (FrontProgramOp::
// set_attend), one buffer for every layer of a graph: a front's kAttend stage
// writes it, the layer's MoE program merges it before the next front writes
// it again (the program checker orders them). Allocated by the first reserve:
// kernels::mono::program_attention_floats f32.
struct ProgramAttentionBuffer {
  Tensor partials;
};

class FrontProgramOp : public OpHoldingOps<FrontProgramOp> {
 public:
  struct Parts {
    std::unique_ptr<AddRmsNormOp> norm;          // input_layernorm (has_delta unless the first layer)
    std::unique_ptr<LinearOp> q_proj;            // without a q LoRA
    std::unique_ptr<LinearOp> q_a;               // with a q LoRA: q_a_proj, q_a_layernorm, q_b_proj
    std::unique_ptr<RmsNormOp> q_a_norm;
    std::unique_ptr<LinearOp> q_b;
    std::unique_ptr<LinearOp> kv_a;
    std::unique_ptr<RopeKvCacheWriteOp> rope;    // with kv_a_layernorm fused
    // Optional: the decode attention's kv_b_proj; the program then also
    // absorbs the query (NUCLEUS_DECODE_PROGRAM_ABSORB; see above).
    const LinearWeight* kv_b = nullptr;
  };
  FrontProgramOp(int64_t layer, Parts parts, int64_t hidden)
      : layer_(layer), parts_(std::move(parts)), hidden_(hidden) {}
  const char* kind() const override { return "front_program"; }
  std::string attrs() const override;
  static const std::vector<Backend<FrontProgramOp>>& backends();

  int64_t layer() const { return layer_; }
  const Parts& parts() const { return parts_; }
  Parts& parts() { return parts_; }
  int64_t hidden() const { return hidden_; }
  bool has_delta() const { return parts_.norm && parts_.norm->has_delta(); }
  bool absorbs() const { return parts_.kv_b != nullptr; }
  // The decode attention in the program too (NUCLEUS_DECODE_PROGRAM_ATTENTION;
  // an absorbing front only): a kAttend stage after RoPE writes the split
  // partials into `buffer`, which the layer's MoE program merges
  // (ops/moe_program_op.h); the attention op does nothing for the steps
  // programs run (MlaDecodeAttentionOp::set_attention_in_program_rows).
  // `scale`: the softmax scale (ModelConfig::softmax_scale). set_attend(false)
  // takes it back.
  void set_attend(bool on, float scale = 0.0f, std::shared_ptr<ProgramAttentionBuffer> buffer = nullptr) {
    attend_ = on;
    attend_scale_ = scale;
    attend_buffer_ = on ? std::move(buffer) : nullptr;
  }
  bool attends() const { return attend_; }
  float attend_scale() const { return attend_scale_; }
  const std::shared_ptr<ProgramAttentionBuffer>& attend_buffer() const { return attend_buffer_; }
  // Steps of at most this many rows (1, 2, 4 or 8; ops/decode_program.h) run
  // as a program; wider steps the held ops. Default 8.
  void set_max_rows(int64_t rows) { max_rows_ = rows; }
  int64_t max_rows() const { return max_rows_; }
  std::shared_ptr<void>& device_state() { return state_; }
  const std::shared_ptr<void>& device_state() const { return state_; }

 protected:
  std::vector<Op*> held() const override {
    return {parts_.norm.get(), parts_.q_proj.get(), parts_.q_a.get(), parts_.q_a_norm.get(), parts_.q_b.get(), parts_.kv_a.get(), parts_.rope.get()};
  }

 private:
  int64_t layer_;
  Parts parts_;
  int64_t hidden_;
  int64_t max_rows_ = 8;
  bool attend_ = false;
  float attend_scale_ = 0.0f;
  std::shared_ptr<ProgramAttentionBuffer> attend_buffer_;
  std::shared_ptr<void> state_;
};

// OK, or why a decode program cannot serve the front: q and kv_a weights
// bf16 or FP8 e4m3 with 128 x 128 block scales (ops/decode_program.h
// program_weight_supported; q_lora a multiple of 16 up to 8192), hidden a
// multiple of 16 up to 8192, the kv norm fused into the RoPE op, a bf16
// cache, an even qk_rope up to 128, kv_lora up to 1024, one rank; to absorb,
// a kv_b_proj [heads * (qk_nope + v_head), kv_lora] of those types (FP8:
// qk_nope and v_head multiples of 128), at most 128 heads, qk_nope a
// multiple of 16.
Status front_program_supported(const FrontProgramOp& op);

}  // namespace nucleus
