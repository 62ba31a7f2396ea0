#include "core/device.h"

#include <cstring>

#ifdef NUCLEUS_HAVE_CUDA
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#endif

namespace nucleus {

bool cuda_available(std::string* why) {
#ifdef NUCLEUS_HAVE_CUDA
  auto c = cuda::get_context();
  if (!c.ok() && why) *why = c.status().message();
  return c.ok();
#else
  if (why) *why = "this build has no CUDA kernels (configured without nvcc)";
  return false;
#endif
}

StatusOr<Device> resolve_device(const std::string& name) {
  if (name == "cpu") return Device::kCpu;
  std::string why;
  if (name == "cuda") {
    if (!cuda_available(&why)) return unsupported("--device cuda: " + why);
    return Device::kCuda;
  }
  if (name == "auto") return cuda_available() ? Device::kCuda : Device::kCpu;
  return invalid_argument("--device '" + name + "' is not one of cpu, cuda, auto");
}

void copy_to_device(void* dst, const void* src, size_t bytes) {
#ifdef NUCLEUS_HAVE_CUDA
  // The engine stream is cudaStreamNonBlocking: it does not synchronize with
  // the legacy default stream, where cudaMemcpy / cudaMemset run (and where
  // tests launch kernels). So the engine stream is drained first (no kernel
  // still reads the old contents) and the legacy stream after (the copy has
  // landed before any engine-stream kernel reads it). Without the second,
  // a model loaded while the legacy stream was still zeroing a freed
  // engine's KV pool fused its gate_up weights (a device-to-device copy on
  // the engine stream) before their upload arrived: gpu_kv_cache_fp8_test,
  // PromptRowsAndLogitsFollowTheCpuReferencePerLayer.
  if (!bytes) return;
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(cuda::context().stream));
  NUCLEUS_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
#else
  NUCLEUS_CHECK(false, "copy_to_device without CUDA");
#endif
}

void copy_to_host(void* dst, const void* src, size_t bytes) {
#ifdef NUCLEUS_HAVE_CUDA
  if (!bytes) return;
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(cuda::context().stream));  // after the engine's writers (see above)
  NUCLEUS_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
#else
  NUCLEUS_CHECK(false, "copy_to_host without CUDA");
#endif
}

Tensor to_device(const Tensor& t) {
  NUCLEUS_CHECK(t.device() == Device::kCpu, "to_device of a device tensor");
  Tensor d = Tensor::empty(t.shape(), t.dtype(), Device::kCuda);
  copy_to_device(d.raw(), t.raw(), t.nbytes());
  return d;
}

Tensor to_host(const Tensor& t) {
  if (t.device() == Device::kCpu) return t;
  Tensor h = Tensor::empty(t.shape(), t.dtype(), Device::kCpu);
  copy_to_host(h.raw(), t.raw(), t.nbytes());  // waits for the engine stream itself
  return h;
}

void device_memory_info(size_t* free_bytes, size_t* total_bytes) {
#ifdef NUCLEUS_HAVE_CUDA
  NUCLEUS_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
#else
  *free_bytes = *total_bytes = 0;
#endif
}

void zero_device(Tensor& t) {
#ifdef NUCLEUS_HAVE_CUDA
  if (!t.nbytes()) return;
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(cuda::context().stream));  // ordered both ways (see copy_to_device)
  NUCLEUS_CUDA_CHECK(cudaMemset(t.raw(), 0, t.nbytes()));
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
#else
  NUCLEUS_CHECK(false, "zero_device without CUDA");
#endif
}

void zero_rows_async(const Tensor& t, int64_t begin, int64_t count) {
  if (count <= 0) return;
#ifdef NUCLEUS_HAVE_CUDA
  const size_t row_bytes = static_cast<size_t>(t.row_numel()) * dtype_size(t.dtype());
  NUCLEUS_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(t.raw()) + begin * row_bytes, 0, count * row_bytes,
                                     cuda::context().stream));
#else
  NUCLEUS_CHECK(false, "zero_rows_async without CUDA");
#endif
}

void copy_rows_async(const Tensor& dst, const Tensor& src) {
  NUCLEUS_CHECK(dst.dtype() == src.dtype() && dst.row_numel() == src.row_numel() && dst.dim(0) >= src.dim(0),
                "copy_rows_async: {} {} into {} {}", dtype_name(src.dtype()), src.shape_string(),
                dtype_name(dst.dtype()), dst.shape_string());
#ifdef NUCLEUS_HAVE_CUDA
  NUCLEUS_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDefault, cuda::context().stream));
#else
  NUCLEUS_CHECK(false, "copy_rows_async without CUDA");
#endif
}

void synchronize_device() {
#ifdef NUCLEUS_HAVE_CUDA
  if (cuda_available()) NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(cuda::context().stream));
#endif
}

Status device_health() {
#ifdef NUCLEUS_HAVE_CUDA
  if (!cuda_available()) return ok_status();
  cudaStream_t stream = cuda::context().stream;
  cudaError_t e = cudaStreamSynchronize(stream);
  if (e == cudaSuccess) e = cudaGetLastError();  // a launch error nothing checked: not sticky
  if (e == cudaSuccess) return ok_status();
  cudaGetLastError();  // clears the error unless it is sticky
  const cudaError_t again = cudaStreamSynchronize(stream);
  if (again == cudaSuccess && cudaPeekAtLastError() == cudaSuccess) return ok_status();
  return aborted(std::string("the CUDA device is in a sticky error state: ") + cudaGetErrorName(e) + ": " +
                 cudaGetErrorString(e));
#else
  return ok_status();
#endif
}

}  // namespace nucleus
