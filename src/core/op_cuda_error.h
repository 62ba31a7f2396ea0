// OpCudaError: how a failed CUDA call inside an op's run reaches the engine
// (no CUDA headers here: the step graph's runner catches it in every build).
#pragma once

#include <stdexcept>
#include <string>

namespace nucleus {
// A CUDA or cuBLAS call inside an op's run failed. Thrown only by
// NUCLEUS_OP_CUDA_CHECK / NUCLEUS_OP_CUBLAS_CHECK and caught by the step
// graph's runner (graph/step_graph.h), which reports it as the step's error:
// the engine then fails that step's requests, or the whole engine (and the
// server drains and exits) when the device's error is sticky; never a bare
// abort in the middle of serving.
struct OpCudaError : std::runtime_error {
  using std::runtime_error::runtime_error;  // what(): "file:line: cudaErrorX: text"
};
}  // namespace nucleus
