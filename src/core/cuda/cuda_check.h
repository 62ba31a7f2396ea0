// Checks for CUDA runtime and cuBLASLt calls: a failure is a bug or a broken
// device; stop with file:line and the error's name.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "core/check.h"

#define NUCLEUS_CUDA_CHECK(expr)                                                                   \
  do {                                                                                             \
    cudaError_t nucleus_cuda_err_ = (expr);                                                        \
    NUCLEUS_CHECK(nucleus_cuda_err_ == cudaSuccess, "{}: {}", cudaGetErrorName(nucleus_cuda_err_), \
                  cudaGetErrorString(nucleus_cuda_err_));                                          \
  } while (0)

// After a kernel launch: the launch's own error (bad configuration).
#define NUCLEUS_CUDA_CHECK_LAUNCH() NUCLEUS_CUDA_CHECK(cudaGetLastError())

#define NUCLEUS_CUBLAS_CHECK(expr)                                                      \
  do {                                                                                  \
    cublasStatus_t nucleus_cublas_st_ = (expr);                                         \
    NUCLEUS_CHECK(nucleus_cublas_st_ == CUBLAS_STATUS_SUCCESS, "cuBLAS status {}: {}",  \
                  static_cast<int>(nucleus_cublas_st_), #expr);                         \
  } while (0)
