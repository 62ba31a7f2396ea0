// Ops that exist for tensor parallelism: the gather of the vocabulary-sliced
// logits. (The all-reduces ride in EmbeddingOp and AddRmsNormOp, basic_ops.h.)
#pragma once

#include "comm/communicator.h"
#include "ops/op.h"

namespace nucleus {

// The full logits from every rank's vocabulary slice (lm_head is split along
// the vocabulary: rank r computes columns [r * V_r, (r + 1) * V_r)).
//   gathered = all_gather(local)           rank-major: [world_size, L, V_r]
//   logits[l, r * V_r + j] = gathered[r, l, j]
// Buffers: in = {local [L, V_r] f32}; out = {logits [L, V] f32, gathered
// (scratch, [L, V] f32 viewed as [world_size, L, V_r])}; V = world_size * V_r.
// Every rank ends with the full logits.
class AllGatherVocabOp : public OpWithBackends<AllGatherVocabOp> {
 public:
  explicit AllGatherVocabOp(Communicator* comm) : comm_(comm) {}
  const char* kind() const override { return "all_gather_vocab"; }
  std::string attrs() const override;
  static const std::vector<Backend<AllGatherVocabOp>>& backends();
  Communicator& comm() const { return *comm_; }

 private:
  Communicator* comm_;
};

}  // namespace nucleus
