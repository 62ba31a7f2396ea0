#include "core/cuda/context.h"
#include "core/cuda/try_alloc.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "core/cuda/cuda_check.h"
#include "core/knobs.h"
#include "core/logging.h"
#include "core/tensor.h"

namespace nucleus::cuda {

namespace {
std::atomic<size_t> g_allocated{0};
Context* g_contexts[kMaxDevices] = {};
Status g_init_status[kMaxDevices];
std::once_flag g_once[kMaxDevices];
std::once_flag g_allocator_once;
thread_local int t_device = 0;

// NUCLEUS_CUDA_POISON_ALLOCS: -1 (unset: off), else the byte every new device
// allocation is filled with. "1" means 0xff (NaN in bf16, f32 and e4m3), so
// a kernel that reads memory nothing wrote gives NaN at once instead of
// whatever an earlier, freed allocation left there (or zeros in a fresh
// process, which hide the read). A debugging switch: slow.
int poison_byte() {
  static const int v = [] {
    auto s = env_string(Knob::kCudaPoisonAllocs);
    if (!s || s->empty() || *s == "0") return -1;
    if (*s == "1") return 0xff;
    char* end = nullptr;
    const long b = std::strtol(s->c_str(), &end, 0);
    NUCLEUS_CHECK(end && *end == 0 && b >= 0 && b <= 255,
                  "NUCLEUS_CUDA_POISON_ALLOCS='{}' is not 0, 1 or a byte value (e.g. 0x7e)", *s);
    return static_cast<int>(b);
  }();
  return v;
}

}  // namespace

StatusOr<std::shared_ptr<Storage>> try_allocate(size_t bytes) {
  auto st = std::make_shared<Storage>();
  st->device = Device::kCuda;
  st->bytes = bytes;
  if (!bytes) return st;
  int device = 0;
  NUCLEUS_CUDA_CHECK(cudaGetDevice(&device));
  cudaError_t e = cudaMalloc(&st->data, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();  // an allocation failure is not sticky: clear it
    st->data = nullptr;
    return resource_exhausted("cudaMalloc of " + std::to_string(bytes) + " bytes on device " + std::to_string(device) +
                              " failed: " + cudaGetErrorString(e) + " (" + std::to_string(g_allocated.load()) +
                              " bytes held by tensors)");
  }
  g_allocated += bytes;
  if (const int b = poison_byte(); b >= 0) {
    // Not while the device's engine stream captures a graph (an
    // allocation there is a bug the graph tests catch; a memset would
    // break the capture). Waits for this device only.
    const Context* c = device >= 0 && device < kMaxDevices ? g_contexts[device] : nullptr;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(c ? c->stream : nullptr, &cs);
    if (cs == cudaStreamCaptureStatusNone) {
      NUCLEUS_CUDA_CHECK(cudaMemset(st->data, b, bytes));
      NUCLEUS_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  st->release = [bytes, device](void* p) {
    int current = 0;
    cudaGetDevice(&current);
    if (current != device) cudaSetDevice(device);
    cudaFree(p);
    if (current != device) cudaSetDevice(current);
    g_allocated -= bytes;
  };
  return st;
}

namespace {

// Device memory for Tensor::empty on the calling thread's current device:
// a failed allocation stops the process (set-up: weights, KV pool, step
// buffers are sized before they are allocated); ops' scratch in a step uses
// try_allocate (via try_empty, ops/op.h) instead.
void register_allocator() {
  register_device_allocator(Device::kCuda, [](size_t bytes) {
    auto st = try_allocate(bytes);
    NUCLEUS_CHECK(st.ok(), "{}", st.status().message());
    return std::move(*st);
  });
}

void init_device(int device) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    g_init_status[device] = unsupported(std::string("no CUDA device: ") +
                                        (err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0"));
    cudaGetLastError();  // clear
    return;
  }
  if (device >= count) {
    g_init_status[device] = unsupported("CUDA device " + std::to_string(device) + " does not exist (" +
                                        std::to_string(count) + " visible)");
    return;
  }
  auto* c = new Context();
  c->device = device;
  NUCLEUS_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop{};
  NUCLEUS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  c->name = prop.name;
  c->num_sms = prop.multiProcessorCount;
  c->l2_bytes = static_cast<size_t>(prop.l2CacheSize);
  c->total_memory = prop.totalGlobalMem;
  if (prop.major != 9) {
    g_init_status[device] = unsupported(std::string("CUDA device '") + prop.name + "' is sm_" +
                                        std::to_string(prop.major) + std::to_string(prop.minor) +
                                        "; nucleus' kernels are built for sm_90a (Hopper)");
    delete c;
    return;
  }
  NUCLEUS_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  NUCLEUS_CUBLAS_CHECK(cublasLtCreate(&c->lt));
  c->workspace_bytes = 64ull << 20;
  NUCLEUS_CUDA_CHECK(cudaMalloc(&c->workspace, c->workspace_bytes));
  std::call_once(g_allocator_once, register_allocator);
  g_contexts[device] = c;
  NUCLEUS_LOG_INFO("cuda: device {}: {} ({} SMs, {:.1f} GiB)", device, c->name, c->num_sms,
                   c->total_memory / double(1ull << 30));
}
}  // namespace

StatusOr<Context*> get_context() {
  const int d = t_device;
  std::call_once(g_once[d], init_device, d);
  if (!g_contexts[d]) return g_init_status[d];
  return g_contexts[d];
}

Context& context() {
  Context* c = g_contexts[t_device];
  NUCLEUS_CHECK(c != nullptr, "CUDA context of device {} used before initialisation", t_device);
  return *c;
}

Status bind_thread_to_device(int device) {
  if (device < 0 || device >= kMaxDevices)
    return invalid_argument("CUDA device " + std::to_string(device) + " is outside [0, " +
                            std::to_string(kMaxDevices) + ")");
  t_device = device;
  NUCLEUS_ASSIGN_OR_RETURN(Context * c, get_context());
  NUCLEUS_CUDA_CHECK(cudaSetDevice(c->device));
  return ok_status();
}

int thread_device() { return t_device; }

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

size_t allocated_bytes() { return g_allocated.load(); }

}  // namespace nucleus::cuda
