// CUDA SwiGLU activation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

// out[r, i] = bf16(silu(f32(gate_up[r, i])) * f32(gate_up[r, width + i]))
//   gate_up: [rows, 2 * width] bf16; out: [rows, width] bf16. Stream-async, graph-safe.
// dependent: launched as a programmatic dependent (PDL, kernels/common/pdl.cuh)
// of the kernel before it, which it waits for before it reads anything.
cudaError_t launch_silu_mul(const __nv_bfloat16* gate_up, int64_t rows, int64_t width, __nv_bfloat16* out,
                            cudaStream_t stream, bool dependent = false);
// The same reading an f32 gate_up (a split-K GEMM's output): [rows, 2 * width] f32.
cudaError_t launch_silu_mul(const float* gate_up, int64_t rows, int64_t width, __nv_bfloat16* out,
                            cudaStream_t stream, bool dependent = false);

}  // namespace nucleus::kernels
