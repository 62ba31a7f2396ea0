// The prezero pass (ops/prezero.h; design.md "Graph passes and prezero";
// seed 000): for each fused residual-add + RMSNorm whose output feeds
// decode GEMMs, allocate one [num_tokens, n_total] f32 buffer sliced per
// consumer, make the norm the donor that zero-fills it, and make the GEMMs
// write their slices with zero_init decided by the gate.
//
// Donors and consumers (it keys on the DeepSeek-V2/V3 layout, by node name,
// like ATOM's deepseek_v2_prezero pass):
//   layers.L.input_layernorm -> [q_a_proj or q_proj | kv_a_proj_with_mqa |
//       q_b_proj] (the base, n_base) | o_proj (the tail); where the decode
//       graph folded that add + norm into layers.L-1.mlp.experts
//       (MoeExpertsOp::fuse_add_rmsnorm), that op is the donor
//   layers.L.post_attention_layernorm -> [mlp.gate (router) | the first GEMM
//       of the shared experts, or the dense MLP's gate_up_proj]
// Consumers are the GEMMs whose chosen backend honours zero_init
// (LinearOp::honours_zero_init: cpu_ref, or cuda_splitk, whose outputs the
// split-K pass made f32); a GEMM on another backend (cuBLASLt, the FP8
// kernels) overwrites its output, gains nothing, and is left out (the others
// keep their order). A consumer's readers, up to its old output buffer's next
// writer, read the slice instead (graph/passes/redirect.h). Decode graphs
// only (never prefill).
#pragma once

#include "core/status.h"
#include "graph/step_graph.h"

namespace nucleus {

struct PrezeroPassReport {
  int donors = 0;
  int consumers = 0;
};

// Rewrites `graph` in place (after backend selection and the split-K pass).
// Errors: a consumer that honours zero_init but writes a non-f32 buffer (the
// split-K pass did not run), or a donor that is not a residual add + RMSNorm
// (nor a MoE op that runs one).
StatusOr<PrezeroPassReport> apply_prezero_pass(StepGraph& graph);

}  // namespace nucleus
