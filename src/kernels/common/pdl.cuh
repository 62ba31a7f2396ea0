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

namespace nucleus::kernels::pdl {

// Lets a programmatic dependent launched after this kernel start its CTAs
// (no effect when the next kernel is launched normally).
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Waits until the kernels this one depends on have completed and their writes
// are visible; returns at once in a kernel not launched as a programmatic
// dependent.
__device__ __forceinline__ void wait_for_inputs() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

}  // namespace nucleus::kernels::pdl
