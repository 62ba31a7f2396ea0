// CUDA backend of the moe_program op (ops/moe_program_op.h): the block as one
// decode program (kernels/mono/mono_kernel.cuh) for steps of at most 8 rows,
// the held ops for wider ones.
#pragma once

#include "core/status.h"
#include "ops/moe_program_op.h"

namespace nucleus::cuda_ops {

Status moe_program_supports(const MoeProgramOp& op);
// The program's buffers (route table, expert activations and outputs for 8
// rows), its per-width job queues (1, 2, 4 and 8 rows) and counters, made
// once before any capture.
Status moe_program_reserve(MoeProgramOp& op, const StepLimits& limits, Device device);
void moe_program(MoeProgramOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
