#include "comm/nccl_communicator.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <dlfcn.h>
#include <glob.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>

#include "core/cuda/cuda_check.h"
#include "core/knobs.h"
#include "core/logging.h"

namespace nucleus {

namespace {

// The NCCL entry points nucleus uses (present in every NCCL 2.x).
struct NcclApi {
  std::string path;
  int version = 0;
  ncclResult_t (*get_version)(int*) = nullptr;
  const char* (*get_error_string)(ncclResult_t) = nullptr;
  ncclResult_t (*comm_init_all)(ncclComm_t*, int, const int*) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_abort)(ncclComm_t) = nullptr;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                             cudaStream_t) = nullptr;
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
};

// Candidate locations after the loader's own path (see the header).
std::vector<std::string> wheel_and_toolkit_candidates() {
  std::vector<std::string> prefixes;
  for (const char* var : {"VIRTUAL_ENV", "CONDA_PREFIX"})
    if (const char* v = std::getenv(var); v && *v) prefixes.push_back(v);
  if (const char* home = std::getenv("HOME"); home && *home) prefixes.push_back(std::string(home) + "/.local");
  for (const char* p : {"/usr/local", "/usr", "/opt/conda", "/opt/venv"}) prefixes.push_back(p);
  std::vector<std::string> out;
  for (const auto& prefix : prefixes)
    for (const char* packages : {"site-packages", "dist-packages"})
      for (const char* sub : {"nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"}) {
        const std::string pattern = prefix + "/lib/python3*/" + packages + "/" + sub + "/libnccl.so.2";
        glob_t g{};
        if (glob(pattern.c_str(), 0, nullptr, &g) == 0)
          for (size_t i = 0; i < g.gl_pathc; ++i) out.push_back(g.gl_pathv[i]);
        globfree(&g);
      }
  for (const char* p : {"/usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2",
                        "/usr/local/cuda/lib64/libnccl.so.2",
                        "/usr/local/cuda/targets/x86_64-linux/lib/libnccl.so.2"})
    out.push_back(p);
  return out;
}

StatusOr<NcclApi> load_nccl() {
  std::vector<std::string> tried;
  void* handle = nullptr;
  std::string path;
  auto try_open = [&](const std::string& p) {
    handle = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle) {
      path = p;
      return true;
    }
    const char* err = dlerror();
    tried.push_back(p + " (" + (err ? err : "not loadable") + ")");
    return false;
  };
  if (auto env = env_string(Knob::kNcclLibrary); env && !env->empty()) {
    if (!try_open(*env))
      return not_found("NUCLEUS_NCCL_LIBRARY='" + *env + "' could not be loaded: " + tried.back());
  } else if (!try_open("libnccl.so.2")) {
    for (const auto& p : wheel_and_toolkit_candidates()) {
      if (access(p.c_str(), R_OK) != 0) continue;
      if (try_open(p)) break;
    }
  }
  if (!handle) {
    std::string list;
    for (const auto& t : tried) list += "\n  " + t;
    return not_found(
        "NCCL (libnccl.so.2) is needed for --tensor-parallel-size > 1 on CUDA and was not found. Tried:" + list +
        "\n  and the Python wheels' nvidia/nccl/lib, nvidia/cu13/lib under site-/dist-packages, and "
        "/usr/local/cuda/lib{,64}.\nPoint nucleus at one: NUCLEUS_NCCL_LIBRARY=/path/to/libnccl.so.2 or "
        "LD_LIBRARY_PATH=<its directory> (`pip install nvidia-nccl-cu13` provides one; to find it: "
        "python3 -c \"import glob, site; print(glob.glob(site.getsitepackages()[0] + "
        "'/nvidia/**/libnccl.so.2', recursive=True))\").");
  }
  NcclApi api;
  api.path = path;
  auto sym = [&](const char* name) { return dlsym(handle, name); };
  api.get_version = reinterpret_cast<decltype(api.get_version)>(sym("ncclGetVersion"));
  api.get_error_string = reinterpret_cast<decltype(api.get_error_string)>(sym("ncclGetErrorString"));
  api.comm_init_all = reinterpret_cast<decltype(api.comm_init_all)>(sym("ncclCommInitAll"));
  api.comm_destroy = reinterpret_cast<decltype(api.comm_destroy)>(sym("ncclCommDestroy"));
  api.comm_abort = reinterpret_cast<decltype(api.comm_abort)>(sym("ncclCommAbort"));
  api.all_reduce = reinterpret_cast<decltype(api.all_reduce)>(sym("ncclAllReduce"));
  api.all_gather = reinterpret_cast<decltype(api.all_gather)>(sym("ncclAllGather"));
  api.broadcast = reinterpret_cast<decltype(api.broadcast)>(sym("ncclBroadcast"));
  if (!api.get_version || !api.get_error_string || !api.comm_init_all || !api.comm_destroy || !api.comm_abort ||
      !api.all_reduce || !api.all_gather || !api.broadcast)
    return unsupported(path + " lacks NCCL 2.x symbols (ncclCommInitAll, ncclAllReduce, ...): not an NCCL library?");
  if (api.get_version(&api.version) != ncclSuccess) api.version = 0;
  return api;
}

StatusOr<const NcclApi*> nccl_api() {
  static std::once_flag once;
  static StatusOr<NcclApi>* api = nullptr;
  std::call_once(once, [] { api = new StatusOr<NcclApi>(load_nccl()); });
  if (!api->ok()) return api->status();
  return &**api;
}

std::string version_string(int code) {
  // NCCL_VERSION(X, Y, Z): X * 1000 + Y * 100 + Z before 2.9, X * 10000 + Y * 100 + Z after.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code / 100 % 100 : code / 100 % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

StatusOr<ncclDataType_t> nccl_dtype(DType d) {
  switch (d) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8:
    case DType::kF8E4M3: return ncclUint8;
  }
  return unsupported(std::string("NCCL has no type for ") + dtype_name(d));
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(const NcclApi* api, ncclComm_t comm, int rank, int world_size)
      : api_(api), comm_(comm), rank_(rank), world_size_(world_size) {}
  ~NcclCommunicator() override {
    if (comm_) (aborted_ ? api_->comm_abort : api_->comm_destroy)(comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device device() const override { return Device::kCuda; }
  const char* backend() const override { return "nccl"; }

  Status all_reduce_sum(const void* send, void* recv, int64_t count, DType dtype, void* stream) override {
    if (dtype != DType::kF32 && dtype != DType::kBF16)
      return unsupported(std::string("NCCL all-reduce of ") + dtype_name(dtype) + " (F32 and BF16 only)");
    NUCLEUS_ASSIGN_OR_RETURN(ncclDataType_t t, nccl_dtype(dtype));
    return check(api_->all_reduce(send, recv, static_cast<size_t>(count), t, ncclSum, comm_,
                                  static_cast<cudaStream_t>(stream)),
                 "ncclAllReduce");
  }

  Status all_gather(const void* send, void* recv, int64_t count, DType dtype, void* stream) override {
    NUCLEUS_ASSIGN_OR_RETURN(ncclDataType_t t, nccl_dtype(dtype));
    return check(api_->all_gather(send, recv, static_cast<size_t>(count), t, comm_, static_cast<cudaStream_t>(stream)),
                 "ncclAllGather");
  }

  Status broadcast(void* buf, int64_t count, DType dtype, int root, void* stream) override {
    if (root < 0 || root >= world_size_)
      return invalid_argument("broadcast root " + std::to_string(root) + " outside [0, " +
                              std::to_string(world_size_) + ")");
    NUCLEUS_ASSIGN_OR_RETURN(ncclDataType_t t, nccl_dtype(dtype));
    return check(api_->broadcast(buf, buf, static_cast<size_t>(count), t, root, comm_,
                                 static_cast<cudaStream_t>(stream)),
                 "ncclBroadcast");
  }

  void abort(const std::string& why) override {
    if (aborted_ || !comm_) return;
    NUCLEUS_LOG_ERROR("NCCL rank {}: aborting its communicator: {}", rank_, why);
    aborted_ = true;
    api_->comm_abort(comm_);
    comm_ = nullptr;
  }

 private:
  Status check(ncclResult_t r, const char* what) const {
    if (aborted_) return aborted(std::string(what) + " on an aborted NCCL communicator");
    if (r == ncclSuccess) return ok_status();
    return internal_error(std::string(what) + " failed on rank " + std::to_string(rank_) + ": " +
                          api_->get_error_string(r));
  }

  const NcclApi* api_;
  ncclComm_t comm_;
  int rank_, world_size_;
  bool aborted_ = false;
};

}  // namespace

StatusOr<std::string> nccl_library_description() {
  NUCLEUS_ASSIGN_OR_RETURN(const NcclApi* api, nccl_api());
  return api->path + " (NCCL " + version_string(api->version) + ")";
}

StatusOr<std::vector<std::unique_ptr<Communicator>>> make_nccl_communicators(const std::vector<int>& devices) {
  if (devices.empty()) return invalid_argument("NCCL group of no devices");
  for (size_t i = 0; i < devices.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (devices[i] == devices[j])
        return invalid_argument("NCCL group lists device " + std::to_string(devices[i]) +
                                " twice (NCCL needs one GPU per rank)");
  NUCLEUS_ASSIGN_OR_RETURN(const NcclApi* api, nccl_api());
  // NVLink SHARP (multicast objects) is forbidden on the shared GPU machines
  // and buys little at these sizes: off unless the user decided otherwise.
  if (std::getenv("NCCL_NVLS_ENABLE") == nullptr) {
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    NUCLEUS_LOG_INFO("nccl: NCCL_NVLS_ENABLE=0 (set by nucleus; export NCCL_NVLS_ENABLE to choose)");
  } else {
    NUCLEUS_LOG_INFO("nccl: NCCL_NVLS_ENABLE={} (from the environment)", std::getenv("NCCL_NVLS_ENABLE"));
  }
  int current = 0;
  if (cudaError_t e = cudaGetDevice(&current); e != cudaSuccess) {
    cudaGetLastError();
    return unsupported(std::string("NCCL communicators need a CUDA device: ") + cudaGetErrorString(e));
  }
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  const ncclResult_t r = api->comm_init_all(comms.data(), static_cast<int>(devices.size()), devices.data());
  NUCLEUS_CUDA_CHECK(cudaSetDevice(current));
  if (r != ncclSuccess)
    return internal_error("ncclCommInitAll over " + std::to_string(devices.size()) +
                          " GPUs failed: " + api->get_error_string(r) + " (NCCL_DEBUG=WARN shows why)");
  NUCLEUS_LOG_INFO("nccl: {} ranks on {} (NCCL {})", devices.size(), api->path, version_string(api->version));
  std::vector<std::unique_ptr<Communicator>> out;
  for (size_t i = 0; i < devices.size(); ++i)
    out.push_back(std::make_unique<NcclCommunicator>(api, comms[i], static_cast<int>(i),
                                                     static_cast<int>(devices.size())));
  return out;
}

}  // namespace nucleus

#else  // no CUDA

namespace nucleus {
StatusOr<std::vector<std::unique_ptr<Communicator>>> make_nccl_communicators(const std::vector<int>&) {
  return unsupported("NCCL communicators need a CUDA build of nucleus");
}
StatusOr<std::string> nccl_library_description() { return unsupported("this build has no CUDA (and no NCCL)"); }
}  // namespace nucleus
#endif
