// Checks for CUDA and cuBLAS calls inside ops' run functions (src/ops/*_cuda.cpp).
// Unlike NUCLEUS_CUDA_CHECK (core/cuda/cuda_check.h), which stops the process,
// these report the failure as the step's error, so the engine fails the step's
// requests (or, when the device's error is sticky, the engine) and the server
// goes on or drains cleanly.
#pragma once

#include <fmt/format.h>

#include "core/cuda/cuda_check.h"
#include "core/op_cuda_error.h"

// In an op's run: a failing CUDA or cuBLAS call throws OpCudaError, which
// the step graph's runner turns into the step's error (core/op_cuda_error.h).
#define NUCLEUS_OP_CUDA_CHECK(expr)                                                                     \
  do {                                                                                                  \
    cudaError_t nucleus_cuda_err_ = (expr);                                                             \
    if (nucleus_cuda_err_ != cudaSuccess) [[unlikely]]                                                  \
      throw ::nucleus::OpCudaError(fmt::format("{}:{}: {}: {}", __FILE__, __LINE__,                     \
                                               cudaGetErrorName(nucleus_cuda_err_),                     \
                                               cudaGetErrorString(nucleus_cuda_err_)));                 \
  } while (0)

#define NUCLEUS_OP_CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                                  \
    cublasStatus_t nucleus_cublas_st_ = (expr);                                                         \
    if (nucleus_cublas_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                       \
      throw ::nucleus::OpCudaError(fmt::format("{}:{}: cuBLAS status {}: {}", __FILE__, __LINE__,       \
                                               static_cast<int>(nucleus_cublas_st_), #expr));           \
  } while (0)
