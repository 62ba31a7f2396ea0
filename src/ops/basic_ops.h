// Element-wise and row-wise ops of the step graph: embedding, RMSNorm (plain
// and fused with the residual add), SwiGLU activation, row gather.
#pragma once

#include "comm/communicator.h"
#include "ops/op.h"
#include "ops/prezero.h"

namespace nucleus {

// Tensor parallelism: the rows [vocab_start, vocab_start + table rows) of the
// vocabulary an embedding table holds, and the group to sum the lookups over.
struct VocabShard {
  int64_t vocab_start = 0;
  Communicator* comm = nullptr;  // null: the table is the whole vocabulary
};

// out[t, :] = table[token_ids[t], :]. Buffers: out = {hidden [num_tokens, hidden]}.
// Vocabulary-parallel (a shard with a communicator): each rank looks up the
// ids in its slice, writes zeros for the others, and the lookups are summed
// over the ranks (Megatron-LM's VocabParallelEmbedding): out is the full
// lookup on every rank.
class EmbeddingOp : public OpWithBackends<EmbeddingOp> {
 public:
  explicit EmbeddingOp(Tensor table, VocabShard shard = {}) : table_(std::move(table)), shard_(shard) {}
  const char* kind() const override { return "embedding"; }
  std::string attrs() const override;
  static const std::vector<Backend<EmbeddingOp>>& backends();
  const Tensor& table() const { return table_; }
  const VocabShard& shard() const { return shard_; }

 private:
  Tensor table_;  // [vocab (or this rank's slice of it), hidden]
  VocabShard shard_;
};

// Tensor parallelism: how an AddRmsNormOp sums its delta (each rank's partial
// sum of o_proj or of the MoE/MLP output) over the ranks before the add.
struct AllReduceSpec {
  Communicator* comm = nullptr;     // null: the delta is complete (no all-reduce)
  std::vector<void*> peer_signals;  // CUDA: every rank's signal buffer for the fused kernel
                                    // (kernels/allreduce), by rank; empty: no fused kernel
  bool fuse = true;                 // false: never the fused kernel (NUCLEUS_FUSE_ALLREDUCE_NORM=0)
};

// On the first `width` columns of each row: y = rmsnorm(x) * weight.
// Buffers: in = {x [num_rows, row_width >= width]}, out = {y [num_rows,
// row_width]}. Usually y is x (in place). When x is a split-K GEMM's f32
// output (graph/passes/splitk_pass.h) y is the declared buffer (bf16 on
// CUDA): the first `width` columns normalised, columns [width, row_width)
// copied (converted), e.g. kv_a's k_pe.
class RmsNormOp : public OpWithBackends<RmsNormOp> {
 public:
  RmsNormOp(Tensor weight, float eps) : weight_(std::move(weight)), eps_(eps) {}
  const char* kind() const override { return "rmsnorm"; }
  std::string attrs() const override;
  bool accepts_f32_input(size_t index) const override { return index == 0; }
  static const std::vector<Backend<RmsNormOp>>& backends();
  const Tensor& weight() const { return weight_; }
  int64_t width() const { return weight_.dim(0); }
  float eps() const { return eps_; }

 private:
  Tensor weight_;  // [width]
  float eps_;
};

// residual += delta (when the op has a delta input), out = rmsnorm(residual) * weight.
// Buffers: in = {residual, delta?} [num_tokens, hidden]; out = {residual, normed}.
// With an all-reduce (tensor parallelism, set_all_reduce) the delta is first
// summed over the ranks: residual += sum_r delta_r. On CUDA the fused backend
// does the sum, the add and the norm in one kernel (kernels/allreduce); the
// plain one runs an NCCL all-reduce of the delta, then the add+norm kernel.
// The fused form saves a pass over the hidden state; the first layer's input
// norm has no delta (the residual is the embedding).
// delta may be f32 (o_proj or the dense MLP's down_proj run split-K) where
// the model declared bf16.
// As a prezero donor (set by the prezero pass) it also zero-fills out[2]
// ([num_tokens, n_total] f32, its column slices stored one after another, so
// the first n_base columns are its first num_tokens * n_base elements): all
// of it, its first n_base columns, or nothing, by prezero_fill(num_tokens,
// n_total, n_base) (ops/prezero.h), decided at each run (each captured graph
// size decides for itself). CUDA runs the fill on extra blocks of the norm's
// launch (kernels/rmsnorm/rmsnorm.cuh).
class AddRmsNormOp : public OpWithBackends<AddRmsNormOp> {
 public:
  AddRmsNormOp(Tensor weight, float eps, bool has_delta)
      : weight_(std::move(weight)), eps_(eps), has_delta_(has_delta) {}
  bool accepts_f32_input(size_t index) const override { return index == 1; }
  const PrezeroDonor& prezero() const { return prezero_; }
  void set_prezero(PrezeroDonor d) { prezero_ = d; }
  const AllReduceSpec& all_reduce() const { return all_reduce_; }
  void set_all_reduce(AllReduceSpec s) { all_reduce_ = std::move(s); }
  const char* kind() const override { return "add_rmsnorm"; }
  std::string attrs() const override;
  static const std::vector<Backend<AddRmsNormOp>>& backends();
  const Tensor& weight() const { return weight_; }
  float eps() const { return eps_; }
  bool has_delta() const { return has_delta_; }

 private:
  Tensor weight_;
  float eps_;
  bool has_delta_;
  PrezeroDonor prezero_;
  AllReduceSpec all_reduce_;
};

// out[r, i] = silu(in[r, i]) * in[r, width + i]. in: [rows, 2 * width]
// (f32 or the activation dtype); out: [rows, width].
class SiluMulOp : public OpWithBackends<SiluMulOp> {
 public:
  const char* kind() const override { return "silu_mul"; }
  bool accepts_f32_input(size_t index) const override { return index == 0; }
  static const std::vector<Backend<SiluMulOp>>& backends();
};

// The input of a multi-token-prediction (MTP) layer (DeepSeek-V3; design.md
// "Speculative decoding (MTP)"), the concatenation eh_proj reads:
//   cat[t, 0:H]  = rmsnorm(embed[t]) * enorm      (embed: the embedding of row t's token)
//   cat[t, H:2H] = rmsnorm(h[t]) * hnorm          (h: StepInputs::mtp_hidden, the previous
//                                                  model's hidden state for row t)
// and zeroes the residual stream, so the layer's first add + RMSNorm adds
// eh_proj's output to zero. With zero_embed_at_position0 a row at position 0
// takes a zero embedding (vLLM's deepseek_mtp convention).
// Buffers: in = {embed [num_tokens, H] f32}; out = {cat [num_tokens, 2H]
// (activation dtype), residual [num_tokens, H] f32}. ctx.inputs->mtp_hidden:
// [num_tokens, H] f32 on the step's device. Fails the step (naming the op)
// when mtp_hidden is missing or of another shape.
class MtpInputOp : public OpWithBackends<MtpInputOp> {
 public:
  MtpInputOp(Tensor enorm, Tensor hnorm, float eps, bool zero_embed_at_position0)
      : enorm_(std::move(enorm)), hnorm_(std::move(hnorm)), eps_(eps), zero_pos0_(zero_embed_at_position0) {}
  const char* kind() const override { return "mtp_input"; }
  std::string attrs() const override;
  bool accepts_f32_input(size_t index) const override { return index == 0; }
  static const std::vector<Backend<MtpInputOp>>& backends();
  const Tensor& enorm() const { return enorm_; }
  const Tensor& hnorm() const { return hnorm_; }
  float eps() const { return eps_; }
  bool zero_embed_at_position0() const { return zero_pos0_; }
  // OK, or why ctx's mtp_hidden cannot feed `num_tokens` rows of this op.
  Status check_hidden(const OpContext& ctx, int64_t num_tokens) const;

 private:
  Tensor enorm_, hnorm_;  // [H] f32
  float eps_;
  bool zero_pos0_;
};

// out[i, :] = in[logit_indices[i], :] (the rows whose logits the step returns).
class GatherLogitRowsOp : public OpWithBackends<GatherLogitRowsOp> {
 public:
  const char* kind() const override { return "gather_rows"; }
  static const std::vector<Backend<GatherLogitRowsOp>>& backends();
};

}  // namespace nucleus
