// Device selection for --device cpu | cuda | auto.
#pragma once

#include <string>

#include "core/status.h"
#include "core/tensor.h"

namespace nucleus {

// Whether this build has CUDA kernels and a usable (Hopper) device; `why`
// receives the reason when not.
bool cuda_available(std::string* why = nullptr);

// "cpu" -> kCpu; "cuda" -> kCuda (an error saying why when unusable);
// "auto" -> kCuda when available, else kCpu.
StatusOr<Device> resolve_device(const std::string& name);

// Copies between host and device memory (synchronous; for set-up and tests).
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
// A device tensor holding a copy of host tensor `t`.
Tensor to_device(const Tensor& t);
// A host tensor holding a copy of device tensor `t`.
Tensor to_host(const Tensor& t);
// Free and total bytes of device memory (cudaMemGetInfo).
void device_memory_info(size_t* free_bytes, size_t* total_bytes);
// Fills a device tensor with zero bytes (synchronous).
void zero_device(Tensor& t);
// Zeroes rows [begin, begin + count) of a 2-D device tensor on the engine
// stream (async, graph-safe).
void zero_rows_async(const Tensor& t, int64_t begin, int64_t count);
// Copies rows [0, src.dim(0)) of `src` (host or device) into the first rows
// of device tensor `dst` (same row width and dtype) on the engine stream
// (async; a host source must stay alive until the stream passes the copy).
void copy_rows_async(const Tensor& dst, const Tensor& src);
// Waits for the engine stream's work (no-op on the CPU).
void synchronize_device();
// Whether the calling thread's device can still run work: waits for the
// engine stream; an error there that a second query still returns is
// sticky (cudaErrorIllegalAddress, a launch failure, ...: the CUDA context is
// unusable until the process exits) and comes back as kAborted naming it; an
// error that clears is cleared and OK is returned. OK on the CPU.
Status device_health();

}  // namespace nucleus
