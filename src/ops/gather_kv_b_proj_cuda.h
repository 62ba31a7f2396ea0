// The CUDA implementations of gather_kv_b_proj (ops/gather_kv_b_proj_cuda.cpp),
// listed in its dispatch (ops/gather_kv_b_proj.cpp) when the build has CUDA:
// "fused" (one launch) and "unfused" (gather + dequantize -> cuBLASLt GEMM ->
// split/concat). supports() returns OK or why not; make()
// builds the implementation for a supported weight and spec.
#pragma once

#include <memory>

#include "core/status.h"
#include "ops/gather_kv_b_proj.h"

namespace nucleus::gather_kv_b_proj_impl {

Status fused_supports(const LinearWeight& kv_b, const GatherKvBProjSpec& spec, const Format& format);
StatusOr<std::unique_ptr<GatherKvBProj>> fused_make(const LinearWeight& kv_b, const GatherKvBProjSpec& spec,
                                                    const kernels::KvBWeightFormat& format);
Status unfused_supports(const LinearWeight& kv_b, const GatherKvBProjSpec& spec, const Format& format);
StatusOr<std::unique_ptr<GatherKvBProj>> unfused_make(const LinearWeight& kv_b, const GatherKvBProjSpec& spec,
                                                      const kernels::KvBWeightFormat& format);

}  // namespace nucleus::gather_kv_b_proj_impl
