// FP8 block-scaled GEMM through cuBLASLt (cuBLAS >= 12.9, Hopper):
//   out[m, n] (+)= sum_k (xq[m, k] * x_scale[k / 128, m]) * (w[n, k] * w_scale[n / 128, k / 128])
// with e4m3 operands, f32 accumulation (no fast accumulation) and bf16 or f32
// output. In cuBLAS' column-major terms D (n x m, ld out_stride) = op(A) B with
// A = w seen as k x n (transposed, BLK128x128_32F scales) and B = xq seen as
// k x m (VEC128_32F scales). Only compiled with CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "core/status.h"

namespace nucleus::kernels {

struct Fp8CublasArgs {
  const uint8_t* xq = nullptr;     // [m, k] e4m3, contiguous (row stride k)
  const float* x_scale = nullptr;  // [ceil(k / 128), m] f32: x_scale[g * m + r] scales xq[r, 128g .. 128g+127]
  const uint8_t* w = nullptr;      // [n, k] e4m3, contiguous
  const float* w_scale = nullptr;  // [ceil(n / 128), ceil(k / 128)] f32, contiguous (DeepSeek scale_inv)
  void* out = nullptr;             // [m, n] out_dtype, row stride out_stride
  int64_t out_stride = 0;
  DType out_dtype = DType::kBF16;
  int64_t m = 0, n = 0, k = 0;
  bool accumulate = false;  // beta = 1
};

// Runs on `stream` (async; graph-capturable once the shape's plan exists:
// the algorithm is chosen and cached per shape on first use, so call once per
// shape before capturing). kUnsupported (with cuBLAS' status) when cuBLASLt
// has no algorithm for the layout or refuses the call; nothing is written then.
Status gemm_fp8_cublaslt(const Fp8CublasArgs& args, cudaStream_t stream);

}  // namespace nucleus::kernels
