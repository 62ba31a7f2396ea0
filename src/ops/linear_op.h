// Linear layer op: out (+)= in W^T.
#pragma once

#include <cstdint>

#include "ops/linear_weight.h"
#include "ops/op.h"

namespace nucleus {

// out[m, n] = sum_k in[m, k] W[n, k] (accumulate = false, "zero_init"), or
// out += that (accumulate = true: split-K / prezero consumers and residual
// contributions such as the shared experts). in: [rows, in_features];
// out: [rows, out_features].
//
// Backends (first supporter wins; NUCLEUS_FORCE_KERNEL=linear=NAME):
//   cpu_ref       f32 reference; adds into out when !zero_init.
//   cuda_splitk   decode GEMMs of bf16 weights the split-K choice takes
//                 (ops/splitk.h): writes f32 (its output buffer must be f32,
//                 graph/passes/splitk_pass.h), atomically accumulated,
//                 honouring zero_init; rows it does not take run cuBLASLt.
//   cuda_skinny   decode GEMMs of bf16 weights at the row counts the skinny
//                 choice takes (ops/skinny.h, m <= 8): bf16 or f32 out,
//                 overwrite or add; rows it does not take run cuBLASLt.
//   cuda_skinny_fp8  decode GEMMs of FP8 block-scaled weights at the row
//                 counts the FP8 skinny choice takes (ops/skinny.h, m <= 16):
//                 bf16 or f32 out, overwrite or add; other rows run the FP8
//                 linear's other paths (cuBLASLt FP8 or the own kernels).
//   cublaslt, cublaslt_fp8, cuda_fp8, cuda_naive: overwrite or add (accumulate).
class LinearOp : public OpWithBackends<LinearOp> {
 public:
  LinearOp(const LinearWeight* weight, bool accumulate) : weight_(weight), accumulate_(accumulate) {}
  const char* kind() const override { return "linear"; }
  std::string attrs() const override;
  static const std::vector<Backend<LinearOp>>& backends();

  const LinearWeight& weight() const { return *weight_; }
  bool accumulate() const { return accumulate_; }
  void set_accumulate(bool v) { accumulate_ = v; }
  // A prezero consumer: its output is a slice of a donor's buffer, and it
  // accumulates (zero_init = false) into it exactly when rows <=
  // prezero_max_rows and is_prezero_free(rows, prezero_gate_n), i.e. when
  // the donor (PrezeroDonor with the same max_rows) zeroed the slice;
  // otherwise it zeroes its own output. gate_n 0: not a consumer.
  int64_t prezero_gate_n() const { return prezero_gate_n_; }
  int64_t prezero_max_rows() const { return prezero_max_rows_; }
  void set_prezero_gate(int64_t gate_n, int64_t max_rows) {
    prezero_gate_n_ = gate_n;
    prezero_max_rows_ = max_rows;
  }
  // The accumulate flag for a run of `rows` rows (zero_init = !accumulate_for).
  bool accumulate_for(int64_t rows) const;

  // A decode-graph GEMM (set by the model on its decode graph): the split-K
  // backend may take it. Prefill GEMMs never run split-K.
  bool splitk_allowed() const { return splitk_allowed_; }
  void set_splitk_allowed(bool v) { splitk_allowed_ = v; }
  // Whether the chosen backend accumulates into its output and honours
  // zero_init, so that a prezero donor can take its zeroing (cpu_ref,
  // cuda_splitk).
  bool honours_zero_init() const { return backend_ == "cpu_ref" || backend_ == "cuda_splitk"; }
  // The most rows at which the chosen backend honours zero_init (cpu_ref:
  // any; cuda_splitk: splitk_max_rows; others: 0). Above it, the backend
  // overwrites its output whatever zero_init says.
  int64_t zero_init_max_rows() const;
  // Whether the chosen backend writes f32 only (cuda_splitk).
  bool needs_f32_output() const { return backend_ == "cuda_splitk"; }

  // State the chosen backend keeps across runs (Op::reserve): the split-K
  // counters (device ints, zero between runs) and the most rows a step's
  // workspace was sized for (0: not reserved).
  Tensor& split_counters() { return split_counters_; }
  int64_t reserved_rows() const { return reserved_rows_; }
  void set_reserved_rows(int64_t rows) { reserved_rows_ = rows; }

 private:
  const LinearWeight* weight_;  // owned by the model
  bool accumulate_;
  int64_t prezero_gate_n_ = 0;
  int64_t prezero_max_rows_ = INT64_MAX;
  bool splitk_allowed_ = false;
  Tensor split_counters_;
  int64_t reserved_rows_ = 0;
};

}  // namespace nucleus
