#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>

namespace nucleus {

const char* device_name(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }

namespace {
std::mutex g_alloc_mu;
std::map<Device, DeviceAllocFn>& allocators() {
  static std::map<Device, DeviceAllocFn> m;
  return m;
}
}  // namespace

void register_device_allocator(Device device, DeviceAllocFn alloc) {
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  allocators()[device] = std::move(alloc);
}

bool device_allocator_registered(Device device) {
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  return allocators().count(device) != 0;
}

int64_t shape_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t host_memory_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

StatusOr<Tensor> Tensor::try_empty_host(std::vector<int64_t> shape, DType dtype, const std::string& what) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return invalid_argument(what + ": negative dim in " + shape_to_string(shape));
    numel *= d;
  }
  const int64_t bytes = numel * static_cast<int64_t>(dtype_size(dtype));
  auto gib = [](int64_t b) { return fmt::format("{:.2f} GiB", static_cast<double>(b) / double(1ull << 30)); };
  const int64_t available = host_memory_available_bytes();
  if (available > 0 && bytes > available)
    return resource_exhausted(what + " needs " + gib(bytes) + " of host memory; " + gib(available) + " are available");
  return empty(std::move(shape), dtype, Device::kCpu);
}

Tensor Tensor::empty(std::vector<int64_t> shape, DType dtype, Device device) {
  for (int64_t d : shape) NUCLEUS_CHECK(d >= 0, "negative dim in {}", shape_to_string(shape));
  Tensor t;
  t.dtype_ = dtype;
  t.device_ = device;
  t.shape_ = std::move(shape);
  size_t bytes = t.nbytes();
  if (device == Device::kCpu) {
    auto st = std::make_shared<Storage>();
    size_t alloc_bytes = (bytes + 63) / 64 * 64;
    st->data = alloc_bytes ? std::aligned_alloc(64, alloc_bytes) : nullptr;
    NUCLEUS_CHECK(alloc_bytes == 0 || st->data, "out of host memory allocating {} bytes", bytes);
    st->bytes = bytes;
    st->release = [](void* p) { std::free(p); };
    t.storage_ = std::move(st);
  } else {
    DeviceAllocFn alloc;
    {
      std::lock_guard<std::mutex> lock(g_alloc_mu);
      auto it = allocators().find(device);
      NUCLEUS_CHECK(it != allocators().end(), "no allocator registered for device {}",
                    device_name(device));
      alloc = it->second;
    }
    t.storage_ = alloc(bytes);
  }
  return t;
}

Tensor Tensor::zeros(std::vector<int64_t> shape, DType dtype) {
  Tensor t = empty(std::move(shape), dtype, Device::kCpu);
  t.zero_();
  return t;
}

Tensor Tensor::from_f32(std::vector<int64_t> shape, const std::vector<float>& values) {
  Tensor t = empty(std::move(shape), DType::kF32);
  NUCLEUS_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "from_f32: {} values for shape {}",
                values.size(), t.shape_string());
  if (!values.empty()) std::memcpy(t.raw(), values.data(), values.size() * 4);
  return t;
}

Tensor Tensor::wrap(void* data, std::vector<int64_t> shape, DType dtype, Device device,
                    std::shared_ptr<const void> owner) {
  Tensor t;
  auto st = std::make_shared<Storage>();
  st->data = data;
  st->device = device;
  st->keep_alive = std::move(owner);
  t.dtype_ = dtype;
  t.device_ = device;
  t.shape_ = std::move(shape);
  st->bytes = t.nbytes();
  t.storage_ = std::move(st);
  return t;
}

int64_t Tensor::dim(int i) const {
  int r = rank();
  if (i < 0) i += r;
  NUCLEUS_CHECK(i >= 0 && i < r, "dim {} out of range for shape {}", i, shape_string());
  return shape_[i];
}

int64_t Tensor::numel() const { return shape_numel(shape_); }

int64_t Tensor::row_numel() const {
  NUCLEUS_CHECK(rank() >= 1, "row_numel of a scalar");
  int64_t n = 1;
  for (size_t i = 1; i < shape_.size(); ++i) n *= shape_[i];
  return n;
}

Tensor Tensor::rows(int64_t begin, int64_t count) const {
  NUCLEUS_CHECK(rank() >= 1 && begin >= 0 && count >= 0 && begin + count <= shape_[0],
                "rows({}, {}) out of range for shape {}", begin, count, shape_string());
  Tensor t = *this;
  t.offset_bytes_ += static_cast<size_t>(begin * row_numel()) * dtype_size(dtype_);
  t.shape_[0] = count;
  return t;
}

Tensor Tensor::view(std::vector<int64_t> shape) const {
  NUCLEUS_CHECK(shape_numel(shape) == numel(), "view {} of a tensor of shape {}", shape_to_string(shape),
                shape_string());
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice_flat(int64_t offset, std::vector<int64_t> shape) const {
  NUCLEUS_CHECK(offset >= 0 && offset + shape_numel(shape) <= numel(), "slice_flat({}, {}) of a tensor of shape {}",
                offset, shape_to_string(shape), shape_string());
  Tensor t = *this;
  t.offset_bytes_ += static_cast<size_t>(offset) * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::clone() const {
  NUCLEUS_CHECK(device_ == Device::kCpu, "clone() of a {} tensor", device_name(device_));
  Tensor t = empty(shape_, dtype_, Device::kCpu);
  if (nbytes()) std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

void Tensor::zero_() {
  NUCLEUS_CHECK(device_ == Device::kCpu, "zero_() of a {} tensor", device_name(device_));
  if (nbytes()) std::memset(raw(), 0, nbytes());
}

std::string Tensor::shape_string() const { return shape_to_string(shape_); }

}  // namespace nucleus
