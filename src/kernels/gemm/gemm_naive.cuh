// A plain CUDA GEMM for any weight form WeightView reads (bf16 or FP8
// block-scaled): out (+)= x W^T with f32 accumulation. One warp per output
// element, 16-byte-free plain loads: the fallback behind the GEMM dispatch
// for shapes or dtypes the fast backends refuse, and the check for them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "core/dtype.h"
#include "kernels/common/weight_view.cuh"

namespace nucleus::kernels {

// x: [m, k] bf16 (row stride x_stride); out: [m, n] bf16 or f32 (row stride
// out_stride); accumulate adds to out. Stream-async, graph-safe.
cudaError_t launch_gemm_naive(const __nv_bfloat16* x, int64_t x_stride, const WeightView& w, int64_t m, void* out,
                              DType out_dtype, int64_t out_stride, bool accumulate, cudaStream_t stream);

}  // namespace nucleus::kernels
