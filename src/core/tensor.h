// Tensor: a contiguous, row-major n-d array on one device. A tensor holds a
// shared reference to its storage, so views (row ranges, reshapes) keep the
// memory alive. Kernels take raw pointers and sizes; Tensor is the glue.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "core/status.h"

namespace nucleus {

enum class Device : uint8_t { kCpu, kCuda };
const char* device_name(Device device);

// Memory for tensors. `data` is owned through `release` (may be empty for
// memory owned elsewhere, e.g. a memory-mapped checkpoint kept alive by
// `keep_alive`).
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device = Device::kCpu;
  std::function<void(void*)> release;
  std::shared_ptr<const void> keep_alive;
  ~Storage() {
    if (release && data) release(data);
  }
};

// Allocation hook for a device (the CUDA backend registers one at start-up),
// so that core does not depend on CUDA.
using DeviceAllocFn = std::function<std::shared_ptr<Storage>(size_t bytes)>;
void register_device_allocator(Device device, DeviceAllocFn alloc);
bool device_allocator_registered(Device device);

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised tensor. CPU memory is 64-byte aligned.
  static Tensor empty(std::vector<int64_t> shape, DType dtype, Device device = Device::kCpu);
  // A host tensor like empty(), or resource_exhausted naming `what` when it is
  // larger than the host's MemAvailable (where the first touch of its pages
  // would wake the OOM killer, or empty() would abort).
  static StatusOr<Tensor> try_empty_host(std::vector<int64_t> shape, DType dtype, const std::string& what);
  // Zero-filled CPU tensor.
  static Tensor zeros(std::vector<int64_t> shape, DType dtype);
  // CPU f32 tensor with the given values (size must equal the shape's numel).
  static Tensor from_f32(std::vector<int64_t> shape, const std::vector<float>& values);
  // Wraps memory owned elsewhere (no copy). `owner` keeps it alive.
  static Tensor wrap(void* data, std::vector<int64_t> shape, DType dtype, Device device,
                     std::shared_ptr<const void> owner);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const;  // negative i counts from the end
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  // Elements per row of dim 0 (product of the other dims).
  int64_t row_numel() const;

  void* raw() const { return static_cast<char*>(storage_->data) + offset_bytes_; }
  template <typename T>
  T* data() const { return static_cast<T*>(raw()); }

  // Rows [begin, begin + count) of dim 0, sharing storage.
  Tensor rows(int64_t begin, int64_t count) const;
  // The same memory with another shape of equal numel.
  Tensor view(std::vector<int64_t> shape) const;
  // A contiguous tensor of `shape` starting `offset` elements into this one
  // (sharing storage; must lie inside it).
  Tensor slice_flat(int64_t offset, std::vector<int64_t> shape) const;

  // Deep copy on the CPU (the source must be on the CPU).
  Tensor clone() const;
  // Fills every byte with zero (CPU tensors only).
  void zero_();

  std::string shape_string() const;  // "[2, 3, 4]"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
  std::vector<int64_t> shape_;
};

int64_t shape_numel(const std::vector<int64_t>& shape);
std::string shape_to_string(const std::vector<int64_t>& shape);

// MemAvailable of /proc/meminfo in bytes (what can be allocated without
// swapping), or 0 when unknown.
int64_t host_memory_available_bytes();

}  // namespace nucleus
