// The attention's output projection and the MoE block of a decode layer as
// one decode program (issue #20; docs/decode_program.md; kernels/mono): what
// the decode graph's
//   self_attn.o_proj, post_attention_layernorm, mlp.gate, mlp.route, mlp.experts
// (the shared experts fused as routed experts) compute, as one launch of the
// persistent decode-program kernel for steps of at most max_rows() rows (8
// unless NUCLEUS_DECODE_PROGRAM_MAX_ROWS says less):
//   delta = attn_out . W_o^T
//   residual += delta;  x = rmsnorm(residual) * w
//   logits = x . W_router^T;  the route table (kernels/moe/moe_ref.h's rules)
//   delta = sum over the chosen experts e of weight * expert_e(x) + sum of the shared experts(x)
// (kernels/mono/mono_program_ref.h MoeChain; the routed experts' weights are
// streamed once a step however many rows chose them; o_proj's weights stream
// while the attention before it still runs, PDL). Steps of more rows run the
// five ops above, which this op holds and dispatches to, so a graph of any
// width keeps one node.
//
// Buffers: in = {attn_out [T, heads * v_head] bf16, residual [T, hidden]
// f32}; out = {residual (in[1]), delta [T, hidden] bf16 (the block's
// output), x_norm [T, hidden], router_logits [T, E] f32, topk_ids [T, slots]
// i32, topk_weights [T, slots] f32, moe_scratch}: the last five are the held
// ops' buffers (a program step leaves them untouched; nothing reads them
// after the block). CUDA only; the decode graph uses it with
// NUCLEUS_DECODE_PROGRAMS=1 (docs/flags.md).
//
// A dense layer (dense(): DeepSeek's first_k_dense_replace layers) holds its
// MLP's ops instead of router, routing and experts, and the program is
//   delta = attn_out . W_o^T;  residual += delta;  x = rmsnorm(residual) * w
//   delta = (silu(x . W_gate^T) * (x . W_up^T)) . W_down^T
// with out = {residual, delta, x_norm, gate_up [T, 2 inter] bf16, h [T,
// inter] bf16} (the held ops' buffers), then the joined front's as below.
//
// Joined with the next layer's attention front (set_next_front;
// NUCLEUS_DECODE_PROGRAM_JOIN, on by default with programs): one program runs
// the block and then that front (kernels/mono join_programs: the front's
// first stages wait for the block's combine), so a layer boundary is one
// launch instead of two. out then continues with the front's own outputs:
// {..., moe_scratch (dense: h), q, kv_a[, q_a][, q_full]} (ops/front_program_op.h), the front
// reading residual = out[0] and delta = out[1] and using x_norm = out[2].
// Wider steps run the block's ops, then the front op.
//
// Starting at the attention's output (set_attention;
// NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT, on by default with programs): for steps the program runs, the
// attention op stops after its kernel (MlaDecodeAttentionOp::
// set_output_in_program_rows) and the program first merges its KV splits and
// applies W_UV of every head (kernels/mono attention_output_stages), writing
// attn_out itself; in then has a third buffer, the attention op's o_lat
// scratch (out[2]: o_lat when the attention ran one split), and the program
// writes attn_out (in[0]) before its o_proj reads it (buffers are named, never
// aliased: nothing else reads attn_out). Wider steps: the attention op wrote
// attn_out as before. When the attention itself ran in this layer's front
// program (attention_in_program_rows, NUCLEUS_DECODE_PROGRAM_ATTENTION) the
// program merges that front's partials (set_attention_buffer) with the
// front's split plan (kernels/mono program_attention_splits); in has no third
// buffer then.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ops/basic_ops.h"
#include "ops/front_program_op.h"
#include "ops/linear_op.h"
#include "ops/mla_decode.h"
#include "ops/moe_ops.h"
#include "ops/op.h"

namespace nucleus {

class MoeProgramOp : public OpHoldingOps<MoeProgramOp> {
 public:
  // The ops the block is made of, as the decode graph would run them; the
  // experts op holds the routed experts, then `shared_pieces` shared ones.
  struct Parts {
    std::unique_ptr<LinearOp> o_proj;
    std::unique_ptr<AddRmsNormOp> norm;
    std::unique_ptr<LinearOp> router;
    std::unique_ptr<MoeRouteOp> route;
    std::unique_ptr<MoeExpertsOp> experts;
    // A dense layer's MLP instead of router, route and experts (dense()):
    // gate_up [2 inter, hidden], SiLU * up, down [hidden, inter], as the
    // decode graph's mlp.gate_up_proj, mlp.act, mlp.down_proj.
    std::unique_ptr<LinearOp> gate_up;
    std::unique_ptr<SiluMulOp> act;
    std::unique_ptr<LinearOp> down;
  };
  MoeProgramOp(int64_t layer, Parts parts, int64_t hidden, int64_t shared_pieces)
      : layer_(layer), parts_(std::move(parts)), hidden_(hidden), shared_pieces_(shared_pieces) {}
  const char* kind() const override { return "moe_program"; }
  std::string attrs() const override;
  static const std::vector<Backend<MoeProgramOp>>& backends();

  int64_t layer() const { return layer_; }
  const Parts& parts() const { return parts_; }
  Parts& parts() { return parts_; }
  int64_t hidden() const { return hidden_; }
  int64_t shared_pieces() const { return shared_pieces_; }
  // A dense layer's MLP (Parts::gate_up / act / down; no router, routing or
  // experts): the program is o_proj, the add + norm, gate_up with SiLU * up,
  // down and the sum to bf16 (kernels/mono MoeChain without routed experts).
  bool dense() const { return parts_.gate_up != nullptr; }
  // Backend-owned state (the program's buffers and queues), made by reserve.
  std::shared_ptr<void>& device_state() { return state_; }
  // The next layer's front, run in the same program (see above); null: none.
  void set_next_front(std::unique_ptr<FrontProgramOp> front) { next_front_ = std::move(front); }
  const FrontProgramOp* next_front() const { return next_front_.get(); }
  FrontProgramOp* next_front() { return next_front_.get(); }
  std::unique_ptr<FrontProgramOp> take_next_front() { return std::move(next_front_); }
  // The attention op whose output the program computes (see above; not
  // owned: the same graph holds it); null: the program starts at o_proj.
  void set_attention(const MlaDecodeAttentionOp* attention) { attention_ = attention; }
  const MlaDecodeAttentionOp* attention() const { return attention_; }
  // With the attention run in this layer's front program: the partials
  // buffer that front writes (FrontProgramOp::set_attend).
  void set_attention_buffer(std::shared_ptr<ProgramAttentionBuffer> b) { attention_buffer_ = std::move(b); }
  const std::shared_ptr<ProgramAttentionBuffer>& attention_buffer() const { return attention_buffer_; }
  // Steps of at most this many rows (1, 2, 4 or 8; ops/decode_program.h) run
  // as a program; wider steps the held ops (and the joined front's). Default 8.
  void set_max_rows(int64_t rows) { max_rows_ = rows; }
  int64_t max_rows() const { return max_rows_; }

 protected:
  std::vector<Op*> held() const override {
    return {parts_.o_proj.get(), parts_.norm.get(), parts_.router.get(), parts_.route.get(), parts_.experts.get(),
            parts_.gate_up.get(), parts_.act.get(), parts_.down.get(), next_front_.get()};
  }

 private:
  int64_t layer_;
  Parts parts_;
  std::unique_ptr<FrontProgramOp> next_front_;
  const MlaDecodeAttentionOp* attention_ = nullptr;
  std::shared_ptr<ProgramAttentionBuffer> attention_buffer_;
  int64_t max_rows_ = 8;
  int64_t hidden_, shared_pieces_;
  std::shared_ptr<void> state_;
};

// OK, or why a decode program cannot serve the block: o_proj and expert
// weights bf16 or FP8 e4m3 with 128 x 128 block scales (ops/decode_program.h
// program_weight_supported; each stage's experts of one type), a bf16 router,
// hidden and the expert widths multiples of 16 up to 8192, o_proj's input a
// multiple of 16 up to 32768, at most 384 routed experts, greedy routing
// (groups unused) or noaux_tc in at most 8 groups, top_k * 8 <= 64, shared
// pieces of one width, one rank (no all-reduce before the norm), no add +
// norm folded into the experts op; a next front that front_program_supported
// accepts, of layer + 1, with a delta and the same hidden size; an attention
// op of this layer set to leave its output to the program
// (output_in_program_rows = max_rows()), with kv_lora 512, qk_rope 64,
// qk_nope 128, v_head 128, at most 128 heads and a kv_b_proj of those types.
Status moe_program_supported(const MoeProgramOp& op);

}  // namespace nucleus
