#include "jit/nvrtc_compile.h"

#include <cuda.h>
#include <dlfcn.h>
#include <nvrtc.h>

#include <mutex>
#include <type_traits>

namespace nucleus::width {
namespace {

// NVRTC's entry points, from dlopen.
struct Nvrtc {
  void* lib = nullptr;
  std::string error;
  nvrtcResult (*version)(int*, int*) = nullptr;
  const char* (*error_string)(nvrtcResult) = nullptr;
  nvrtcResult (*create)(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*) = nullptr;
  nvrtcResult (*compile)(nvrtcProgram, int, const char* const*) = nullptr;
  nvrtcResult (*log_size)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*log)(nvrtcProgram, char*) = nullptr;
  nvrtcResult (*cubin_size)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*cubin)(nvrtcProgram, char*) = nullptr;
  nvrtcResult (*destroy)(nvrtcProgram*) = nullptr;
};

const Nvrtc& nvrtc() {
  static Nvrtc n;
  static std::once_flag once;
  std::call_once(once, [] {
    for (const char* name : {"libnvrtc.so.13", "libnvrtc.so"}) {
      n.lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (n.lib) break;
    }
    if (!n.lib) {
      n.error = std::string("cannot load NVRTC (libnvrtc.so.13): ") + dlerror();
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(n.lib, name));
      if (!fn && n.error.empty()) n.error = std::string("NVRTC lacks ") + name;
    };
    sym(n.version, "nvrtcVersion");
    sym(n.error_string, "nvrtcGetErrorString");
    sym(n.create, "nvrtcCreateProgram");
    sym(n.compile, "nvrtcCompileProgram");
    sym(n.log_size, "nvrtcGetProgramLogSize");
    sym(n.log, "nvrtcGetProgramLog");
    sym(n.cubin_size, "nvrtcGetCUBINSize");
    sym(n.cubin, "nvrtcGetCUBIN");
    sym(n.destroy, "nvrtcDestroyProgram");
  });
  return n;
}

// The driver's entry points, from the CUDA runtime (no link against libcuda).
struct Driver {
  std::string error;
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_unload)(CUmodule) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*func_get_attribute)(int*, CUfunction_attribute, CUfunction) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*occupancy)(int*, CUfunction, int, size_t) = nullptr;
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void**, void**) = nullptr;
  CUresult (*launch_ex)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
};

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    // Initialises the runtime and makes the device's primary context current.
    if (cudaError_t e = cudaFree(nullptr); e != cudaSuccess) {
      d.error = std::string("CUDA runtime: ") + cudaGetErrorString(e);
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess || !p) {
        if (d.error.empty()) d.error = std::string("driver entry point ") + name + " not found";
        return;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    sym(d.module_load_data, "cuModuleLoadData");
    sym(d.module_unload, "cuModuleUnload");
    sym(d.module_get_function, "cuModuleGetFunction");
    sym(d.func_get_attribute, "cuFuncGetAttribute");
    sym(d.func_set_attribute, "cuFuncSetAttribute");
    sym(d.occupancy, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    sym(d.launch, "cuLaunchKernel");
    sym(d.launch_ex, "cuLaunchKernelEx");
    sym(d.error_name, "cuGetErrorName");
  });
  return d;
}

Status driver_status(CUresult r, const std::string& what) {
  if (r == CUDA_SUCCESS) return ok_status();
  const char* name = "unknown";
  if (driver().error_name) driver().error_name(r, &name);
  return internal_error(what + ": " + name);
}

}  // namespace

StatusOr<std::string> nvrtc_version() {
  const Nvrtc& n = nvrtc();
  if (!n.error.empty()) return unsupported(n.error);
  int major = 0, minor = 0;
  n.version(&major, &minor);
  return "nvrtc-" + std::to_string(major) + "." + std::to_string(minor);
}

StatusOr<std::vector<char>> nvrtc_compile_cubin(const std::string& source, const std::string& name,
                                                const std::vector<std::pair<std::string, std::string>>& headers,
                                                const std::vector<std::string>& options) {
  const Nvrtc& n = nvrtc();
  if (!n.error.empty()) return unsupported(n.error);
  std::vector<const char*> header_texts, header_names, opts;
  for (const auto& [include, text] : headers) {
    header_names.push_back(include.c_str());
    header_texts.push_back(text.c_str());
  }
  for (const std::string& o : options) opts.push_back(o.c_str());
  nvrtcProgram prog = nullptr;
  nvrtcResult r = n.create(&prog, source.c_str(), name.c_str(), static_cast<int>(headers.size()),
                           header_texts.data(), header_names.data());
  if (r != NVRTC_SUCCESS) return internal_error(std::string("nvrtcCreateProgram: ") + n.error_string(r));
  r = n.compile(prog, static_cast<int>(opts.size()), opts.data());
  std::string log;
  size_t log_size = 0;
  if (n.log_size(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    log.resize(log_size);
    n.log(prog, log.data());
    log.resize(log_size - 1);
  }
  if (r != NVRTC_SUCCESS) {
    n.destroy(&prog);
    return invalid_argument("NVRTC could not compile " + name + " (" + n.error_string(r) + "): " + log);
  }
  size_t size = 0;
  std::vector<char> cubin;
  r = n.cubin_size(prog, &size);
  if (r == NVRTC_SUCCESS && size > 0) {
    cubin.resize(size);
    r = n.cubin(prog, cubin.data());
  }
  n.destroy(&prog);
  if (r != NVRTC_SUCCESS || cubin.empty())
    return internal_error("NVRTC gave no cubin for " + name + " (is -arch a real sm_ target?)");
  return cubin;
}

LoadedModule::~LoadedModule() {
  if (module_ && driver().module_unload) driver().module_unload(static_cast<CUmodule>(module_));
}

StatusOr<std::unique_ptr<LoadedModule>> LoadedModule::load(const std::vector<char>& cubin,
                                                           const std::vector<std::string>& kernels) {
  const Driver& d = driver();
  if (!d.error.empty()) return unsupported(d.error);
  std::unique_ptr<LoadedModule> m(new LoadedModule());
  CUmodule mod = nullptr;
  NUCLEUS_RETURN_IF_ERROR(driver_status(d.module_load_data(&mod, cubin.data()), "cuModuleLoadData"));
  m->module_ = mod;
  for (const std::string& k : kernels) {
    CUfunction f = nullptr;
    NUCLEUS_RETURN_IF_ERROR(driver_status(d.module_get_function(&f, mod, k.c_str()), "cuModuleGetFunction " + k));
    m->functions_.push_back(f);
  }
  return m;
}

StatusOr<LoadedModule::Attributes> LoadedModule::attributes(int i) const {
  const Driver& d = driver();
  auto f = static_cast<CUfunction>(functions_.at(i));
  int regs = 0, local = 0, smem = 0;
  NUCLEUS_RETURN_IF_ERROR(driver_status(d.func_get_attribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, f), "NUM_REGS"));
  NUCLEUS_RETURN_IF_ERROR(
      driver_status(d.func_get_attribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f), "LOCAL_SIZE_BYTES"));
  NUCLEUS_RETURN_IF_ERROR(
      driver_status(d.func_get_attribute(&smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f), "SHARED_SIZE_BYTES"));
  return Attributes{regs, local, smem};
}

StatusOr<int> LoadedModule::max_active_blocks_per_sm(int i, int threads, int64_t dynamic_smem_bytes) const {
  const Driver& d = driver();
  auto f = static_cast<CUfunction>(functions_.at(i));
  if (d.func_set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, static_cast<int>(dynamic_smem_bytes)) !=
      CUDA_SUCCESS)
    return 0;  // more shared memory than a CTA may have
  int blocks = 0;
  NUCLEUS_RETURN_IF_ERROR(driver_status(d.occupancy(&blocks, f, threads, static_cast<size_t>(dynamic_smem_bytes)),
                                        "cuOccupancyMaxActiveBlocksPerMultiprocessor"));
  return blocks;
}

Status LoadedModule::launch(int i, unsigned grid, unsigned threads, int64_t dynamic_smem_bytes, void* arg,
                            cudaStream_t stream, bool cooperative) const {
  void* args[] = {arg};
  const auto f = static_cast<CUfunction>(functions_.at(i));
  if (!cooperative)
    return driver_status(driver().launch(f, grid, 1, 1, threads, 1, 1, static_cast<unsigned>(dynamic_smem_bytes),
                                         reinterpret_cast<CUstream>(stream), args, nullptr),
                         "cuLaunchKernel");
  // A cooperative launch: the driver guarantees every CTA of the grid is
  // resident at once (or refuses the launch), as grid barriers need; valid
  // under stream capture (a cooperative kernel node).
  CUlaunchAttribute attr{};
  attr.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
  attr.value.cooperative = 1;
  CUlaunchConfig cfg{};
  cfg.gridDimX = grid;
  cfg.gridDimY = cfg.gridDimZ = 1;
  cfg.blockDimX = threads;
  cfg.blockDimY = cfg.blockDimZ = 1;
  cfg.sharedMemBytes = static_cast<unsigned>(dynamic_smem_bytes);
  cfg.hStream = reinterpret_cast<CUstream>(stream);
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return driver_status(driver().launch_ex(&cfg, f, args, nullptr), "cuLaunchKernelEx (cooperative)");
}

}  // namespace nucleus::width
