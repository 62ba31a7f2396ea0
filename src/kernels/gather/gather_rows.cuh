// CUDA row gather (any element type).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

// out[i, :] = in[index[i], :] for i < num_rows; rows are row_bytes wide
// (a multiple of 4). Stream-async, graph-safe.
cudaError_t launch_gather_rows(const void* in, const int32_t* index, int64_t num_rows, int64_t row_bytes, void* out,
                               cudaStream_t stream);

}  // namespace nucleus::kernels
