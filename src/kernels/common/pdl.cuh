// Programmatic dependent launch (PDL, sm_90): device-side signals. Only for .cu
// files.
//
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization
// (a programmatic dependent) may start before the previous kernel on its
// stream has finished: its CTAs are scheduled once every CTA of the previous
// kernel has called launch_dependents() (or exited). It must call
// wait_for_inputs() before it reads anything the previous kernel writes or
// writes anything that kernel reads. Inside CUDA graphs the dependency is
// captured as a programmatic edge.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace nucleus::kernels::pdl {

// Lets a programmatic dependent launched after this kernel start its CTAs
// (no effect when the next kernel is launched normally).
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Waits until the kernels this one depends on have completed and their writes
// are visible; returns at once in a kernel not launched as a programmatic
// dependent.
__device__ __forceinline__ void wait_for_inputs() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Launches `kernel` on `stream` over the `grid` of CTAs of `block` threads with
// `smem` bytes of dynamic shared memory, as a programmatic dependent of the
// kernel before it when `dependent` (launched normally otherwise). The
// arguments convert to the kernel's parameter types. Host side; returns
// cudaLaunchKernelEx's error.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, int block, size_t smem, bool dependent,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(block));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// The same over a one-dimensional grid of `grid` CTAs.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int64_t grid, int block, size_t smem, bool dependent,
                   cudaStream_t stream, Args&&... args) {
  return launch(kernel, dim3(static_cast<unsigned>(grid)), block, smem, dependent, stream,
                std::forward<Args>(args)...);
}

}  // namespace nucleus::kernels::pdl
