// Device allocations that can fail without stopping the process: for the
// scratch and workspace ops grow inside a step, where running out of device
// memory is a resource error of that step (reported, the engine goes on)
// rather than a bug. Only compiled with CUDA.
#pragma once

#include <cstddef>
#include <memory>

#include "core/status.h"
#include "core/tensor.h"

namespace nucleus::cuda {

// `bytes` of device memory on the calling thread's device, freed when the
// last reference goes (on that device, from any thread), counted in
// allocated_bytes(). Errors: kResourceExhausted when cudaMalloc fails (the
// CUDA error is cleared; it is not sticky).
StatusOr<std::shared_ptr<Storage>> try_allocate(size_t bytes);

}  // namespace nucleus::cuda
