// Dense GEMMs through cuBLASLt: out (+)= x W^T with bf16 operands and f32
// accumulation (CUBLAS_COMPUTE_32F). Only compiled with CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "core/status.h"

namespace nucleus::kernels {

struct GemmArgs {
  const void* x = nullptr;  // [m, k] bf16, row stride x_stride (elements)
  int64_t x_stride = 0;
  const void* w = nullptr;  // [n, k] bf16, contiguous (nn.Linear weight)
  void* out = nullptr;      // [m, n] out_dtype (bf16 or f32), row stride out_stride
  int64_t out_stride = 0;
  DType out_dtype = DType::kBF16;
  int64_t m = 0, n = 0, k = 0;
  bool accumulate = false;  // out += x W^T (beta = 1) instead of out = x W^T
};

// Runs on `stream` (async, graph-capturable: the workspace is preallocated and
// algorithms are chosen and cached per shape on first use — call once per
// shape before capturing). kUnsupported when cuBLASLt finds no algorithm.
Status gemm_bf16_cublaslt(const GemmArgs& args, cudaStream_t stream);

}  // namespace nucleus::kernels
