// Run-time compilation of CUDA C++ to a cubin through NVRTC, and the driver
// API calls that load a cubin and read its kernels' resource figures.
// NVRTC is opened with dlopen (libnvrtc.so.13, then libnvrtc.so) and the
// driver's entry points are taken from the CUDA runtime
// (cudaGetDriverEntryPointByVersion), so a binary that links this still
// starts on a machine without a GPU, a driver or NVRTC: only these calls
// fail, with a Status. CUDA builds only.
#pragma once

#ifdef NUCLEUS_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace nucleus::width {

// "nvrtc-<major>.<minor>". Errors: NVRTC cannot be loaded.
StatusOr<std::string> nvrtc_version();

// Compiles `source` (named `name` in messages) with the given headers
// ({include name, text}) and options (e.g. "-arch=sm_90a", "-DNUCLEUS_WIDTH=8")
// to a cubin. Errors: NVRTC missing, or the compile failed (the message holds
// NVRTC's log). Host-only; touches no device.
StatusOr<std::vector<char>> nvrtc_compile_cubin(const std::string& source, const std::string& name,
                                                const std::vector<std::pair<std::string, std::string>>& headers,
                                                const std::vector<std::string>& options);

// A cubin loaded into the current device's primary context (unloaded on
// destruction) and the kernels looked up in it.
class LoadedModule {
 public:
  ~LoadedModule();
  LoadedModule(const LoadedModule&) = delete;
  LoadedModule& operator=(const LoadedModule&) = delete;

  // Loads `cubin` and looks up `kernels` (extern "C" names). Errors: no
  // driver, an image the device cannot load, a missing kernel.
  static StatusOr<std::unique_ptr<LoadedModule>> load(const std::vector<char>& cubin,
                                                      const std::vector<std::string>& kernels);

  struct Attributes {
    int num_regs = 0;
    int64_t local_bytes = 0;
    int64_t static_smem_bytes = 0;
  };
  // CU_FUNC_ATTRIBUTE_NUM_REGS, _LOCAL_SIZE_BYTES, _SHARED_SIZE_BYTES of kernel i.
  StatusOr<Attributes> attributes(int i) const;
  // Allows dynamic_smem_bytes (above 48 KiB needs the opt-in) and returns
  // cuOccupancyMaxActiveBlocksPerMultiprocessor for that launch shape; 0 when
  // the shared memory cannot be granted.
  StatusOr<int> max_active_blocks_per_sm(int i, int threads, int64_t dynamic_smem_bytes) const;
  // Launches kernel i with one argument (a struct passed by value):
  // cuLaunchKernel, or with `cooperative` cuLaunchKernelEx with the
  // cooperative attribute (the driver refuses a grid that cannot be
  // co-resident instead of letting a grid barrier hang). Stream-async;
  // capturable in a CUDA graph.
  Status launch(int i, unsigned grid, unsigned threads, int64_t dynamic_smem_bytes, void* arg, cudaStream_t stream,
                bool cooperative = false) const;

 private:
  LoadedModule() = default;
  void* module_ = nullptr;             // CUmodule
  std::vector<void*> functions_;       // CUfunction
};

}  // namespace nucleus::width

#endif  // NUCLEUS_HAVE_CUDA
