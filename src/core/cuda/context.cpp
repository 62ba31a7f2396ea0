#ifdef NUCLEUS_HAVE_CUDA
#include "core/cuda/context.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "core/cuda/cuda_check.h"
#include "core/env.h"
#include "core/logging.h"
#include "core/tensor.h"

namespace nucleus::cuda {

namespace {
std::atomic<size_t> g_allocated{0};
Context* g_context = nullptr;
Status g_init_status;
std::once_flag g_once;

// NUCLEUS_CUDA_POISON_ALLOCS: -1 (unset: off), else the byte every new device
// allocation is filled with. "1" means 0xff (NaN in bf16, f32 and e4m3), so
// a kernel that reads memory nothing wrote gives NaN at once instead of
// whatever an earlier, freed allocation left there (or zeros in a fresh
// process, which hide the read). A debugging switch: slow.
int poison_byte() {
  static const int v = [] {
    auto s = env_string("NUCLEUS_CUDA_POISON_ALLOCS");
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

void init_once() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    g_init_status = unsupported(std::string("no CUDA device: ") +
                                (err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0"));
    cudaGetLastError();  // clear
    return;
  }
  auto* c = new Context();
  NUCLEUS_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  NUCLEUS_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  c->name = prop.name;
  c->num_sms = prop.multiProcessorCount;
  c->l2_bytes = static_cast<size_t>(prop.l2CacheSize);
  c->total_memory = prop.totalGlobalMem;
  if (prop.major != 9) {
    g_init_status = unsupported(std::string("CUDA device '") + prop.name + "' is sm_" + std::to_string(prop.major) +
                                std::to_string(prop.minor) + "; nucleus' kernels are built for sm_90a (Hopper)");
    delete c;
    return;
  }
  NUCLEUS_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  NUCLEUS_CUBLAS_CHECK(cublasLtCreate(&c->lt));
  c->workspace_bytes = 64ull << 20;
  NUCLEUS_CUDA_CHECK(cudaMalloc(&c->workspace, c->workspace_bytes));
  register_device_allocator(Device::kCuda, [](size_t bytes) {
    auto st = std::make_shared<Storage>();
    st->device = Device::kCuda;
    st->bytes = bytes;
    if (bytes) {
      cudaError_t e = cudaMalloc(&st->data, bytes);
      NUCLEUS_CHECK(e == cudaSuccess, "cudaMalloc of {} bytes failed: {} ({} bytes held by tensors)", bytes,
                    cudaGetErrorString(e), g_allocated.load());
      g_allocated += bytes;
      if (const int b = poison_byte(); b >= 0) {
        // Not while a stream captures a graph (an allocation there is a bug
        // the graph tests catch; a memset would break the capture).
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        cudaStreamIsCapturing(g_context ? g_context->stream : nullptr, &cs);
        if (cs == cudaStreamCaptureStatusNone) {
          NUCLEUS_CUDA_CHECK(cudaMemset(st->data, b, bytes));
          NUCLEUS_CUDA_CHECK(cudaDeviceSynchronize());
        }
      }
      st->release = [bytes](void* p) {
        cudaFree(p);
        g_allocated -= bytes;
      };
    }
    return st;
  });
  g_context = c;
  NUCLEUS_LOG_INFO("cuda: {} ({} SMs, {:.1f} GiB)", c->name, c->num_sms, c->total_memory / double(1ull << 30));
}
}  // namespace

StatusOr<Context*> get_context() {
  std::call_once(g_once, init_once);
  if (!g_context) return g_init_status;
  return g_context;
}

Context& context() {
  NUCLEUS_CHECK(g_context != nullptr, "CUDA context used before initialisation");
  return *g_context;
}

size_t allocated_bytes() { return g_allocated.load(); }

}  // namespace nucleus::cuda
#endif  // NUCLEUS_HAVE_CUDA
