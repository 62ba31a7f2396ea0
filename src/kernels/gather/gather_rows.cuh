// CUDA row gather (any element type).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

// out[i, :] = in[index[i], :] for i < num_rows; rows are row_bytes wide
// (a multiple of 4). Stream-async, graph-safe.
cudaError_t launch_gather_rows(const void* in, const int32_t* index, int64_t num_rows, int64_t row_bytes, void* out,
                               cudaStream_t stream);

// out[i, c] = float(in[index[i], c]) for i < num_rows, c < width: a row
// gather that widens to f32 (exact: every bf16 is an f32). `in` is
// [>= max(index) + 1, width] bf16 (in_bf16) or f32; out [num_rows, width] f32.
// The MTP module's input rows (runtime/spec_decode.cpp): the target step's
// final-normed hidden states (bf16) or the MTP layer's own pre-norm output
// (f32). Stream-async, graph-safe. Errors: cudaErrorInvalidValue for
// num_rows < 0 or width < 1.
cudaError_t launch_gather_rows_f32(const void* in, bool in_bf16, const int32_t* index, int64_t num_rows,
                                   int64_t width, float* out, cudaStream_t stream);

}  // namespace nucleus::kernels
