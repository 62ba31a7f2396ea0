// CUDA backend of the front_program op (ops/front_program_op.h): the front as
// one decode program (kernels/mono/mono_kernel.cuh) for steps of at most 8
// rows, the held ops for wider ones.
#pragma once

#include "core/status.h"
#include "ops/front_program_op.h"

namespace nucleus::cuda_ops {

Status front_program_supports(const FrontProgramOp& op);
// The program's residual scratch (8 rows), its per-width job queues and
// counters, made once before any capture.
Status front_program_reserve(FrontProgramOp& op, const StepLimits& limits, Device device);
void front_program(FrontProgramOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
