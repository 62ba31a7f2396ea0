#include "ops/op.h"

#include <map>
#include <mutex>
#include <cstdlib>
#include <sstream>

#include "core/knobs.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "core/cuda/try_alloc.h"
#endif

namespace nucleus {

namespace {
std::string g_forced_malformed;  // items of NUCLEUS_FORCE_KERNEL without family=backend
std::string g_forced_unknown;    // a family no op has

// Every family that dispatches through choose_backend: the ops' kind()
// names and gather_kv_b_proj (ops/gather_kv_b_proj.cpp, kFamily).
const char* const kFamilies[] = {"add_rmsnorm", "all_gather_vocab", "embedding", "gather_kv_b_proj", "gather_rows",
                                 "linear", "mla_decode", "mla_front", "mla_prefill", "moe_experts", "moe_route", "rmsnorm",
                                 "rope_kv_cache_write", "silu_mul"};
}  // namespace

bool is_kernel_family(const std::string& family) {
  for (const char* f : kFamilies)
    if (family == f) return true;
  return false;
}

std::string forced_backend_error() {
  forced_backend("");
  if (!g_forced_malformed.empty())
    return "NUCLEUS_FORCE_KERNEL: '" + g_forced_malformed + "' is not family=backend (e.g. linear=cuda_naive)";
  if (!g_forced_unknown.empty()) {
    std::string known;
    for (const char* f : kFamilies) known += std::string(known.empty() ? "" : ", ") + f;
    return "NUCLEUS_FORCE_KERNEL: no kernel family '" + g_forced_unknown + "' (families: " + known + ")";
  }
  return std::string();
}

std::string forced_backend(const char* family) {
  static std::once_flag once;
  static std::map<std::string, std::string> forced;
  std::call_once(once, [] {
    auto v = env_string(Knob::kForceKernel);
    if (!v) return;
    std::stringstream ss(*v);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.empty()) continue;
      auto eq = item.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
        g_forced_malformed = item;
        continue;
      }
      const std::string family = item.substr(0, eq);
      if (!is_kernel_family(family) && g_forced_unknown.empty()) g_forced_unknown = family;
      forced[family] = item.substr(eq + 1);
    }
  });
  auto it = forced.find(family);
  return it == forced.end() ? std::string() : it->second;
}

StatusOr<Tensor> try_empty(std::vector<int64_t> shape, DType dtype, Device device, const std::string& what) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  if (device == Device::kCpu) {
    const size_t alloc_bytes = (bytes + 63) / 64 * 64;
    void* p = alloc_bytes ? std::aligned_alloc(64, alloc_bytes) : nullptr;
    if (alloc_bytes && !p)
      return resource_exhausted(what + ": out of host memory allocating " + std::to_string(bytes) + " bytes");
    return Tensor::wrap(p, std::move(shape), dtype, device, std::shared_ptr<void>(p, [](void* q) { std::free(q); }));
  }
#ifdef NUCLEUS_HAVE_CUDA
  auto st = cuda::try_allocate(bytes);
  if (!st.ok()) return st.status().with_context(what);
  void* data = (*st)->data;
  return Tensor::wrap(data, std::move(shape), dtype, device, std::move(*st));
#else
  return unsupported(what + ": a " + device_name(device) + " allocation needs a CUDA build");
#endif
}

}  // namespace nucleus
