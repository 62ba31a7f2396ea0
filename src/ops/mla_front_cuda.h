// The CUDA backend of the mla_front op family (ops/mla_front_cuda.cpp).
#pragma once

#include "core/status.h"
#include "ops/mla_front_op.h"

namespace nucleus::cuda_ops {

// The MLA decode front end (ops/mla_front_op.h): the width build serving the
// step's rows (jit/mla_front_builds.h), else the plain chain.
Status mla_front_supports(const MlaFrontOp& op);
void mla_front(MlaFrontOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
