// The split-K pass: gives each decode GEMM that runs split-K
// (LinearOp::needs_f32_output, the cuda_splitk backend) an f32 output buffer
// of its own, since split-K accumulates in f32 atomics and the model declared
// the activations bf16 on CUDA. The buffer is named after the declared one
// ("q_a" -> "q_a.f32"); the GEMM's readers up to the declared buffer's next
// writer read it instead (graph/passes/redirect.h), so an in-place reader
// (q_a_layernorm, kv_a_layernorm, the RoPE of q) becomes the conversion back
// into the declared bf16 buffer, fused with its own work, and a plain reader
// (the residual add + RMSNorm reading o_proj's output, SwiGLU reading
// gate_up) reads f32. A GEMM whose readers do not all accept f32
// (Op::accepts_f32_input), or that adds onto a bf16 buffer (a genuine
// accumulator), is sent back to the next backend in its list.
//
// Runs on the decode graph after backend selection, before the prezero pass
// (which slices these f32 outputs out of its donors' buffers). Nothing to do
// on the CPU (every buffer is f32 there), so nothing of it shows in CPU dumps.
#pragma once

#include "core/status.h"
#include "graph/step_graph.h"

namespace nucleus {

struct SplitKPassReport {
  int redirected = 0;  // GEMMs given an f32 output
  int reselected = 0;  // GEMMs sent back to another backend
};

// Rewrites `graph` (backends already chosen for `device`) in place. Errors:
// a GEMM that no other backend supports after split-K is ruled out.
StatusOr<SplitKPassReport> apply_splitk_pass(StepGraph& graph, Device device);

}  // namespace nucleus
