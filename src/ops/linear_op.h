// Linear layer op: out (+)= in W^T.
#pragma once

#include "ops/linear_weight.h"
#include "ops/op.h"

namespace nucleus {

// out[m, n] = sum_k in[m, k] W[n, k] (accumulate = false, "zero_init"), or
// out += that (accumulate = true: split-K / prezero consumers and residual
// contributions such as the shared experts). in: [rows, in_features];
// out: [rows, out_features].
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
  // accumulates (zero_init = false) into it exactly when
  // is_prezero_free(rows, prezero_gate_n) says the donor zeroed the slice;
  // otherwise it zeroes its own output. 0: not a consumer.
  int64_t prezero_gate_n() const { return prezero_gate_n_; }
  void set_prezero_gate_n(int64_t n) { prezero_gate_n_ = n; }
  // The accumulate flag for a run of `rows` rows.
  bool accumulate_for(int64_t rows) const;

 private:
  const LinearWeight* weight_;  // owned by the model
  bool accumulate_;
  int64_t prezero_gate_n_ = 0;
};

}  // namespace nucleus
